"""The OpenAPI document, with the limits of the loaded model filled in.

Request models are static; some bounds depend on the checkpoint and the settings (the context length,
GPT_MAX_NEW_TOKENS, GPT_MAX_STOP_SEQUENCES, GPT_MAX_TOP_N_TOKENS, the vocabulary size). Once the model is
loaded, the document states them (`maximum`, `maxItems`, `maxLength`), so a client — or schemathesis —
reading /openapi.json knows what the validation pass will accept. What no JSON schema can state (a prompt's
length in tokens, prompt + max_new_tokens within the context) stays a documented 422 / 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.errors import OpenAIError, TGIError
from app.protocol.openai import MAX_N, ChatCompletionChunk, CompletionResponse
from app.protocol.responses import ResponseEvent
from app.protocol.tgi import StreamResponse

# models that only SSE events reference: added to components by hand (FastAPI adds those of `responses=` models)
EVENT_MODELS = (StreamResponse, ChatCompletionChunk, CompletionResponse, ResponseEvent, TGIError, OpenAIError)


def sse_content(*models: str, done: bool = False) -> dict:
    """A `text/event-stream` response: each event's `data` is JSON of one of `models` (by component name), or
    `[DONE]` when `done` (OpenAI's end marker). OpenAPI 3.1 reads `schema` as one event."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{m}"} for m in models]}}
    data = {"anyOf": [{"const": "[DONE]"}, json_data]} if done else json_data
    event = {"type": "object", "required": ["data"],
             "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"}}}
    return {"text/event-stream": {"schema": event}}


def _narrow(prop: dict, **by_type: dict[str, Any]) -> None:
    """Tighten the keywords of each branch of `prop` whose JSON type is a key of `by_type`."""
    branches = prop.get("anyOf") or prop.get("oneOf") or [prop]
    for b in branches:
        for kw, value in by_type.get(b.get("type"), {}).items():
            if kw == "items":
                _narrow(b.setdefault("items", {}), **value)
            elif kw.startswith("max"):
                b[kw] = min(b.get(kw, value), value)
            else:
                b[kw] = value


def int_range_pattern(n: int) -> str:
    """A regular expression matching the decimal numbers 0..n written without leading zeros (logit_bias keys)."""
    s = str(n)
    alts = ["[0-9]"] if len(s) > 1 else [f"[0-{s}]"]
    alts += [f"[1-9][0-9]{{{d - 1}}}" for d in range(2, len(s))]  # every shorter length
    if len(s) > 1:
        for i, c in enumerate(s):  # same length: equal up to i, then a smaller digit, then anything
            low = "1" if i == 0 else "0"
            if c > low:
                alts.append(f"{s[:i]}[{low}-{int(c) - 1}][0-9]{{{len(s) - i - 1}}}")
        alts.append(s)
    return "^(" + "|".join(alts) + ")$"


def apply_limits(schema: dict, limits, max_choices: int) -> dict:
    comps = schema.get("components", {}).get("schemas", {})

    def prop(model: str, name: str) -> dict:
        return comps.get(model, {}).get("properties", {}).get(name, {})

    new_tokens = {"integer": {"maximum": limits.max_new_tokens}}
    top_n = {"integer": {"maximum": limits.max_top_n_tokens}}
    stop = {"string": {"maxLength": limits.max_stop_length},
            "array": {"maxItems": limits.max_stop_sequences,
                      "items": {"string": {"maxLength": limits.max_stop_length}}}}
    token_id = {"integer": {"maximum": max(0, limits.vocab_size - 1)}}
    _narrow(prop("TGIParameters", "max_new_tokens"), **new_tokens)
    _narrow(prop("TGIParameters", "top_n_tokens"), **top_n)
    _narrow(prop("TGIParameters", "stop"), **stop)
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        for name in ("max_tokens", "max_completion_tokens"):
            if name in comps.get(model, {}).get("properties", {}):
                _narrow(prop(model, name), **new_tokens)
        _narrow(prop(model, "stop"), **stop)
        _narrow(prop(model, "n"), integer={"maximum": max(1, min(MAX_N, max_choices))})
    _narrow(prop("CompletionRequest", "logprobs"), **top_n)
    _narrow(prop("CompletionRequest", "prompt_logprobs"), **top_n)
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        _narrow(prop(model, "stop_token_ids"), array={"items": token_id})
        _narrow(prop(model, "logit_bias"),
                object={"propertyNames": {"pattern": int_range_pattern(max(0, limits.vocab_size - 1))}})
    _narrow(prop("ChatCompletionRequest", "top_logprobs"), **top_n)
    for branch in prop("CompletionRequest", "prompt").get("anyOf", []):
        items = branch.get("items", {})
        if items.get("type") == "integer":
            _narrow(items, **token_id)
        elif items.get("type") == "array":
            _narrow(items.setdefault("items", {}), **token_id)
    _narrow(prop("DetokenizeRequest", "tokens"), array={"items": token_id})
    return schema


def limits_in_openapi(app: FastAPI) -> None:
    """app.openapi(): FastAPI's document, plus the loaded model's limits (cached once they are known)."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in EVENT_MODELS:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in js.pop("$defs", {}).items():
                comps.setdefault(name, sub)
            comps.setdefault(model.__name__, js)
        service = app.state.service
        if service.limits is None:
            return schema  # still loading: the static document, not cached
        app.openapi_schema = apply_limits(schema, service.limits, service.limits.max_choices)
        return app.openapi_schema

    app.openapi = openapi
