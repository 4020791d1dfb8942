"""OpenAI's request and response shapes: /v1/completions, /v1/chat/completions, /v1/models; and vLLM's
/tokenize and /detokenize. Fields the server cannot honour are accepted only at their neutral value
(the schema says which), unknown fields are ignored, as vLLM does."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from app.protocol.common import MAX_INT, STRICT, Seed, StopString, null_only, only_off

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 16  # prompts per /v1/completions request

TokenId = Annotated[int, Field(ge=0)]
Stop = StopString | Annotated[list[StopString], Field(max_length=64)] | None


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = Field(None, description="send a last chunk with the token counts")


class JsonSchemaFormat(BaseModel):
    model_config = {**STRICT, "populate_by_name": True}
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema", description="the JSON schema the output must follow")
    strict: bool | None = Field(None, description="accepted; the output always follows the schema")


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: free text; json_object: any JSON object; json_schema: JSON that follows json_schema.schema")
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema")


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    model_config = {**STRICT, "populate_by_name": True}
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: str | None = Field(None, description="the whole output matches this regex (Rust regex syntax)")
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)] | None = Field(
        None, description="the output is exactly one of these strings")
    grammar: str | None = Field(None, description="a Lark grammar, or GBNF (llama.cpp's `root ::= ...`)")
    json_object: bool | None = Field(None, description="true: any JSON object")


class SamplingFields(BaseModel):
    """What both generation requests share."""

    model_config = STRICT

    model: str | None = Field(None, description="ignored: this server serves one model")
    temperature: float | None = Field(None, ge=0, le=100, description="default 1 (sampled); 0: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT, description="vLLM extension; -1 or 0: off")
    repetition_penalty: float | None = Field(None, ge=0.01, le=100, description="vLLM extension")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    n: int | None = Field(None, ge=1, le=MAX_N, description="choices per prompt; choice i uses seed + i")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop = Field(None, description="up to the server's GPT_MAX_STOP_SEQUENCES strings")
    seed: Seed = None
    user: str | None = None
    logit_bias: only_off(dict, {}, "logit_bias is not supported", {"maxProperties": 0}) = None
    best_of: only_off(int, 1, "only best_of=1 is supported", {"minimum": 1, "maximum": 1}) = None
    response_format: ResponseFormat | None = Field(None, description="constrain the output to JSON (OpenAI)")
    structured_outputs: StructuredOutputs | None = Field(None, description="constrain the output to a JSON schema, "
                                                         "a regex, a grammar or a choice (vLLM)")


class CompletionRequest(SamplingFields):
    # Echoing the prompt with log-probabilities would need the prompt's own log-probabilities, which
    # this server does not compute: refused, and the schema says so.
    model_config = {**STRICT, "json_schema_extra": {"not": {
        "required": ["echo", "logprobs"],
        "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}}}}}

    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT, description="default 16, as OpenAI's")
    logprobs: int | None = Field(None, ge=0, le=MAX_INT, description="log-probabilities of the chosen token "
                                 "and of this many alternatives")
    echo: bool | None = Field(None, description="prepend the prompt to the text")
    suffix: only_off(str, "", "suffix is not supported", {"maxLength": 0}) = None


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(max_length=64)]
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT, description="deprecated name of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT, description="default: as much as the context "
                                              "and the server's GPT_DEFAULT_MAX_NEW_TOKENS allow")
    logprobs: bool | None = Field(None, description="return the chosen tokens' log-probabilities")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token (with logprobs)")
    tools: only_off(list, [], "tools are not supported", {"maxItems": 0}) = None
    tool_choice: only_off(str, "none", "tools are not supported", {"enum": ["none", None]}) = None
    parallel_tool_calls: bool | None = None
    functions: null_only("functions are not supported") = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template (exactly one)."""

    model_config = {**STRICT, "json_schema_extra": {"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}}
    model: str | None = None
    prompt: str = None  # type: ignore[assignment]  # absent or a string (null is refused, as the schema says)
    messages: Annotated[list[ChatMessage], Field(max_length=1024)] = None  # type: ignore[assignment]
    add_generation_prompt: bool | None = Field(None, description="with messages: end with the assistant cue "
                                               "(default true)")
    add_special_tokens: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)


# ------------------------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    text_offset: list[int]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk (`data: {...}`, then `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(BaseModel):
    """One streamed event (`data: {...}`), then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
