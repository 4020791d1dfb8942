"""Request bodies (TGI's /generate shape and OpenAI's /v1/completions), their validation, and how a
request becomes a prompt plus `SamplingParams`.

Validation is strict: wrong JSON types are refused (no "10" for an integer), numbers are range-checked,
and every problem is reported as a 422 naming its field, e.g. `parameters.temperature: must be >= 0`.
Parameters this server cannot honour are refused when set to a non-default value instead of being
silently ignored; unknown keys are ignored (as TGI and vLLM do).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.errors import ApiError, validation_message
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

MAX_INT = 2**31 - 1
MAX_SEED = 2**63 - 1
_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Limits:
    block_size: int
    max_prompt_tokens: int
    max_new_tokens: int  # cap
    default_max_new_tokens: int
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_top_n_tokens: int = 5


# ---------------------------------------------------------------------------------------------- TGI
class TGIParameters(BaseModel):
    model_config = _STRICT

    max_new_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float | None = Field(None, ge=0, le=100)
    top_k: int | None = Field(None, ge=0, le=MAX_INT)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    stop: list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    do_sample: bool | None = None
    details: bool | None = None
    return_full_text: bool | None = None
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_INT)
    truncate: int | None = Field(None, ge=1, le=MAX_INT)
    # TGI parameters that are accepted only at their "off" value
    decoder_input_details: bool | None = None
    typical_p: float | None = Field(None, gt=0, le=1)
    best_of: int | None = Field(None, ge=1, le=MAX_INT)
    watermark: bool | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    grammar: Any = None
    adapter_id: str | None = None


class TGIRequest(BaseModel):
    model_config = _STRICT

    inputs: str
    parameters: TGIParameters | None = None
    stream: bool | None = None


# ------------------------------------------------------------------------------------------- OpenAI
class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None


class CompletionRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    prompt: Any = None  # str | [str] | [int, ...] | [[int, ...]]; checked by hand for clear messages
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)  # vLLM extension; -1 or 0: off
    repetition_penalty: float | None = Field(None, gt=0, le=100)  # vLLM extension
    n: int | None = Field(None, ge=1, le=MAX_INT)
    best_of: int | None = Field(None, ge=1, le=MAX_INT)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_INT)
    echo: bool | None = None
    stop: Any = None  # str | [str]
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict | None = None
    suffix: str | None = None
    user: str | None = None


# ---------------------------------------------------------------------------------------------- parsing
def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _clean(obj: Any) -> Any:
    """Replace lone UTF-16 surrogates (legal in JSON escapes, not in Unicode text) by U+FFFD."""
    if isinstance(obj, str):
        return _SURROGATE.sub("\ufffd", obj) if _SURROGATE.search(obj) else obj
    if isinstance(obj, list):
        return [_clean(x) for x in obj]
    if isinstance(obj, dict):
        return {_clean(k): _clean(v) for k, v in obj.items()}
    return obj


def parse_json_body(body: bytes) -> Any:
    if not body.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (invalid byte at offset {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") \
            from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(422, f"body: must be a JSON object, got {type(data).__name__ if data is not None else 'null'}",
                       "validation")
    return _clean(data)


def _validate(model: type[BaseModel], data: dict, prefix: str = ""):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(422, validation_message(e.errors()), "validation") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


def _unsupported(field: str, why: str) -> ApiError:
    return ApiError(422, f"{field}: {why}", "validation")


def check_stop(stop: Any, field: str, limits: Limits) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise ApiError(422, f"{field}: must be a string or a list of strings", "validation")
    if len(stop) > limits.max_stop_sequences:
        raise ApiError(422, f"{field}: at most {limits.max_stop_sequences} stop sequences are allowed, "
                            f"got {len(stop)}", "validation")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise ApiError(422, f"{field}.{i}: must be a string", "validation")
        if not 1 <= len(s) <= limits.max_stop_length:
            raise ApiError(422, f"{field}.{i}: must be 1 to {limits.max_stop_length} characters long, "
                                f"got {len(s)}", "validation")
    return stop


def check_top_n(n: int | None, field: str, limits: Limits) -> int:
    if not n:
        return 0
    if n > limits.max_top_n_tokens:
        raise ApiError(422, f"{field}: must be <= {limits.max_top_n_tokens}", "validation")
    return n


@dataclass
class Plan:
    """A validated request: what the engine runs and what the response needs to echo back."""

    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    sampling: bool
    top_n: int = 0
    stream: bool = False
    details: bool = False
    return_full_text: bool = False
    include_usage: bool = False
    model: str | None = None


def fit_context(n_prompt: int, max_new: int | None, limits: Limits, prompt_field: str, new_field: str) -> int:
    """Check the prompt and the generation budget against the limits; returns max_new_tokens to use."""
    if n_prompt > limits.max_prompt_tokens:
        raise ApiError(422, f"{prompt_field}: the prompt has {n_prompt} tokens; at most "
                            f"{limits.max_prompt_tokens} are allowed", "validation")
    room = limits.block_size - n_prompt
    if room < 1:
        raise ApiError(422, f"{prompt_field}: the prompt has {n_prompt} tokens, which fills the model's context "
                            f"of {limits.block_size} tokens and leaves no room to generate", "validation")
    if max_new is None:
        return max(1, min(limits.default_max_new_tokens, limits.max_new_tokens, room))
    if max_new > limits.max_new_tokens:
        raise ApiError(422, f"{new_field}: must be <= {limits.max_new_tokens}", "validation")
    if max_new > room:
        raise ApiError(422, f"{new_field}: the prompt ({n_prompt} tokens) + {new_field} ({max_new}) = "
                            f"{n_prompt + max_new} exceeds the model's context length of {limits.block_size} "
                            f"tokens; ask for at most {room}", "validation")
    return max_new


def _encode(tokenizer: Tokenizer, text: str, field: str) -> list[int]:
    if not text:
        raise ApiError(422, f"{field}: must not be empty", "validation")
    ids = tokenizer.encode(text)
    if not ids:
        raise ApiError(422, f"{field}: must not be empty", "validation")
    return ids


def plan_tgi(data: dict, tokenizer: Tokenizer, limits: Limits, stream: bool | None = None) -> Plan:
    """TGI's /generate body → Plan. `stream` forces the mode (/generate_stream); else the body's `stream`."""
    req = _validate(TGIRequest, data)
    p = req.parameters or TGIParameters()
    if p.decoder_input_details:
        raise _unsupported("parameters.decoder_input_details", "prompt token details are not supported")
    if p.typical_p is not None and p.typical_p < 1.0:
        raise _unsupported("parameters.typical_p", "typical sampling is not supported (use top_p / top_k)")
    if p.best_of is not None and p.best_of > 1:
        raise _unsupported("parameters.best_of", "only best_of=1 is supported")
    if p.watermark:
        raise _unsupported("parameters.watermark", "watermarking is not supported")
    if p.grammar is not None:
        raise _unsupported("parameters.grammar", "grammar-constrained generation is not supported")
    if p.adapter_id is not None:
        raise _unsupported("parameters.adapter_id", "adapters are not supported")
    stop = check_stop(p.stop, "parameters.stop", limits)
    top_n = check_top_n(p.top_n_tokens, "parameters.top_n_tokens", limits)

    ids = _encode(tokenizer, req.inputs, "inputs")
    if p.truncate is not None:
        ids = ids[-p.truncate:]
    max_new = fit_context(len(ids), p.max_new_tokens, limits, "inputs", "parameters.max_new_tokens")

    # TGI: sample when do_sample is set or any warper differs from its neutral value; else greedy.
    # temperature 0 is greedy whatever do_sample says (TGI refuses 0; we accept it).
    warpers = ((p.temperature is not None and p.temperature != 1.0) or bool(p.top_k)
               or (p.top_p is not None and p.top_p < 1.0))
    sampling = bool(p.do_sample or warpers) and p.temperature != 0.0
    params = SamplingParams(
        max_new_tokens=max_new,
        temperature=(p.temperature if p.temperature is not None else 1.0) if sampling else 0.0,
        top_k=p.top_k or 0,
        top_p=p.top_p if p.top_p is not None else 1.0,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        seed=p.seed, stop=stop)
    return Plan(ids, req.inputs, params, sampling, top_n,
                stream=bool(req.stream) if stream is None else stream,
                details=bool(p.details), return_full_text=bool(p.return_full_text))


def plan_completion(data: dict, tokenizer: Tokenizer, limits: Limits) -> Plan:
    req = _validate(CompletionRequest, data)
    if req.n is not None and req.n > 1:
        raise _unsupported("n", "only n=1 is supported")
    if req.best_of is not None and req.best_of > 1:
        raise _unsupported("best_of", "only best_of=1 is supported")
    if req.logit_bias:
        raise _unsupported("logit_bias", "not supported")
    if req.suffix:
        raise _unsupported("suffix", "not supported")
    if req.echo and req.logprobs is not None:
        raise _unsupported("echo", "echo together with logprobs is not supported")
    stop = check_stop(req.stop, "stop", limits)
    top_n = check_top_n(req.logprobs, "logprobs", limits)

    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = _encode(tokenizer, prompt, "prompt")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ApiError(422, f"prompt: token id {bad[0]} is out of range [0, {tokenizer.vocab_size})",
                           "validation")
        ids = list(prompt)
        text = tokenizer.decode(ids)
    elif prompt is None:
        raise ApiError(422, "prompt: is required", "validation")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(t, (str, list)) for t in prompt):
        raise ApiError(422, "prompt: only one prompt per request is supported", "validation")
    elif isinstance(prompt, list) and not prompt:
        raise ApiError(422, "prompt: must not be empty", "validation")
    else:
        raise ApiError(422, "prompt: must be a string, a list of one string, or a list of token ids", "validation")

    max_new = fit_context(len(ids), req.max_tokens if req.max_tokens is not None else None,
                          _openai_limits(limits), "prompt", "max_tokens")
    temperature = req.temperature if req.temperature is not None else 1.0
    top_k = req.top_k if req.top_k and req.top_k > 0 else 0
    params = SamplingParams(
        max_new_tokens=max_new, temperature=temperature, top_k=top_k,
        top_p=req.top_p if req.top_p is not None else 1.0,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed, stop=stop)
    return Plan(ids, text, params, sampling=temperature > 0, top_n=top_n, stream=bool(req.stream),
                details=req.logprobs is not None, return_full_text=bool(req.echo),
                include_usage=bool(req.stream_options and req.stream_options.include_usage), model=req.model)


def _openai_limits(limits: Limits) -> Limits:
    """OpenAI's max_tokens defaults to 16."""
    return Limits(**{**limits.__dict__, "default_max_new_tokens": min(16, limits.default_max_new_tokens)})
