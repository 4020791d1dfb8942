"""TGI's request and response shapes (huggingface/text-generation-inference router/src/server.rs,
validation.rs): `GenerateRequest`, `CompatGenerateRequest` (POST /, with `stream`), `GenerateResponse`,
`StreamResponse`. POST / answers a non-streaming request with a list of one `GenerateResponse`, as TGI does."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from app.protocol.common import MAX_INT, STRICT, Seed, StopString, bound, null_only, off_flag, only_off


class TGIGrammar(BaseModel):
    """TGI's `grammar`: the output follows a JSON schema or matches a regex."""

    model_config = STRICT
    type: Literal["json", "regex"]
    value: dict[str, Any] | str = Field(description="json: a JSON schema (object or text); regex: the regex")


class TGIParameters(BaseModel):
    model_config = STRICT

    max_new_tokens: int | None = Field(None, **bound("max_new_tokens", le=MAX_INT), description="default: the server's "
                                       "GPT_DEFAULT_MAX_NEW_TOKENS, within the context")
    temperature: float | None = Field(None, **bound("temperature"), description="0: greedy")
    top_k: int | None = Field(None, **bound("top_k", le=MAX_INT), description="0: off")
    top_p: float | None = Field(None, **bound("top_p"))
    repetition_penalty: float | None = Field(None, **bound("repetition_penalty"))
    frequency_penalty: float | None = Field(None, **bound("frequency_penalty"))
    stop: list[StopString] | None = None
    seed: Seed = None
    do_sample: bool | None = Field(None, description="sample (else greedy, unless a warper is set)")
    details: bool | None = None
    return_full_text: bool | None = None
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_INT)
    truncate: int | None = Field(None, ge=1, le=MAX_INT, description="keep only the last N prompt tokens")
    decoder_input_details: bool | None = Field(None, description="details.prefill: each prompt token with its "
                                               "log-probability (the first null); implies details; not with "
                                               "streaming (as TGI)")
    # TGI parameters accepted only at their "off" value
    typical_p: only_off(float, 1.0, "typical sampling is not supported (use top_p / top_k)",
                        {"minimum": 1, "maximum": 1}) = None
    best_of: only_off(int, 1, "only best_of=1 is supported", {"minimum": 1, "maximum": 1}) = None
    watermark: off_flag("watermarking is not supported") = None
    grammar: TGIGrammar | None = None
    adapter_id: null_only("adapters are not supported") = None


_PREFILL_DETAILS = {"required": ["parameters"], "properties": {"parameters": {
    "type": "object", "required": ["decoder_input_details"], "properties": {"decoder_input_details": {"const": True}}}}}


class TGIRequest(BaseModel):
    """/generate and POST / (with `stream`)."""

    # TGI refuses decoder_input_details while streaming; the schema says so
    model_config = {**STRICT, "json_schema_extra": {"not": {"allOf": [
        {"required": ["stream"], "properties": {"stream": {"const": True}}}, _PREFILL_DETAILS]}}}

    inputs: str = Field(min_length=1, description="the prompt")
    parameters: TGIParameters | None = None
    stream: bool | None = Field(None, description="/generate only: answer with server-sent events")


class CompatRequest(TGIRequest):
    """POST / (TGI's compatibility route, used by huggingface_hub and text_generation)."""


class StreamRequest(TGIRequest):
    """/generate_stream: always a stream, so never decoder_input_details."""

    model_config = {**STRICT, "json_schema_extra": {"not": _PREFILL_DETAILS}}


# ------------------------------------------------------------------------------------------- responses
class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None = Field(description="null for the first prompt token")


class Details(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = Field(description="the seed used (null for greedy)")
    input_length: int = Field(description="prompt tokens (ours; TGI's streams carry it)")
    prompt_tokens: int
    prefill: list[PrefillToken] = Field(default_factory=list, description="with decoder_input_details: the prompt's "
                                        "tokens")
    tokens: list[Token] | None = None
    top_tokens: list[list[Token]] | None = None
    best_of_sequences: Any = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamResponse(BaseModel):
    """One server-sent event per token (`data: {...}`); the last carries generated_text and details."""

    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None
    details: Details | None
