"""Errors: one exception (`ApiError`), two wire shapes, chosen by the route's API.

- TGI routes (/generate, /generate_stream, POST /, /classify, operations):
  `{"error": "<what went wrong>", "error_type": "<kind>"}`. error_type follows TGI where TGI has one
  (huggingface_hub maps them to exceptions): validation (422), overloaded (429), generation (500); and for
  the rest: bad_request (400), unauthorized (401), not_found (404), method_not_allowed (405),
  payload_too_large (413), unsupported_media_type (415), unavailable (503), timeout (504), internal (500).
- OpenAI routes (/v1/*, /tokenize, /detokenize):
  `{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`, so the openai SDK's exceptions
  carry the message and the parameter (`e.message`, `e.param`). As OpenAI does, a bad parameter is a 400
  (`invalid_request_error`); `code` is the TGI kind above.

Every message names the field it is about (`temperature: must be >= 0`); `param` is that field.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("app")

STATUS_TYPES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                405: "method_not_allowed", 408: "timeout", 413: "payload_too_large", 415: "unsupported_media_type",
                422: "validation", 429: "overloaded", 500: "internal", 503: "unavailable", 504: "timeout"}
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error", 504: "timeout_error"}
OPENAI_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


# The engine's error kinds (engine/request.py) as HTTP statuses: the one place they are mapped.
KIND_STATUS = {"overloaded": 429, "unavailable": 503, "shutdown": 503, "timeout": 504, "failed": 500, "invalid": 422}
KIND_TYPES = {"overloaded": "overloaded", "unavailable": "unavailable", "shutdown": "unavailable",
              "timeout": "timeout", "failed": "generation", "invalid": "validation"}


def status_of(kind) -> int:
    """HTTP status of an engine ErrorKind."""
    return KIND_STATUS.get(str(kind), 500)


def error_type_of(kind) -> str:
    """The API's error_type of an engine ErrorKind (TGI's names: overloaded, generation, ...)."""
    return KIND_TYPES.get(str(kind), "generation")


def outcome_labels(outcome) -> tuple[int, str]:
    """(status, finish_reason) labels of a finished request for gpt_requests_total: a FinishReason (200), an
    ErrorKind, or "cancelled" (the client went away: 499, nginx's code)."""
    if outcome == "cancelled":
        return 499, "cancelled"
    if isinstance(outcome, Enum) and str(outcome) in KIND_STATUS:
        kind = str(outcome)
        return status_of(kind), {"failed": "error", "invalid": "error"}.get(kind, kind)
    return 200, str(outcome)


class ApiError(StarletteHTTPException):
    """A refusal with its HTTP status. An HTTPException, so FastAPI passes it through body parsing untouched."""

    def __init__(self, status: int, message: str, error_type: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None, started: bool = False) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.status = status
        self.message = message
        self.error_type = error_type or STATUS_TYPES.get(status, "error")
        self.param = param  # the request field at fault (OpenAI's `param`); `invalid()` sets it
        # True when the request reached the engine and ended there (time limit, failure, drain): the engine's
        # end hook has counted it in gpt_requests_total already, so it is not a refusal
        self.started = started

    def __str__(self) -> str:
        return self.message


def invalid(field: str, problem: str) -> ApiError:
    """A request field the server refuses: 422 naming the field (400 on the OpenAI routes)."""
    return ApiError(422, f"{field}: {problem}", "validation", param=field)


# ---------------------------------------------------------------------------------------- wire shapes
class TGIError(BaseModel):
    """TGI's error body."""

    error: str = Field(description="what went wrong, naming the field when a field is at fault")
    error_type: str = Field(description="validation | overloaded | generation | bad_request | unauthorized | "
                                        "payload_too_large | unsupported_media_type | unavailable | timeout | ...")


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error | authentication_error | not_found_error | "
                                  "rate_limit_error | server_error | timeout_error")
    param: str | None = Field(None, description="the request field at fault, when one is")
    code: str | None = Field(None, description="the TGI error kind (validation, overloaded, ...)")


class OpenAIError(BaseModel):
    """OpenAI's error body."""

    error: OpenAIErrorDetail


def error_body(message: str, error_type: str) -> dict:
    return {"error": message, "error_type": error_type}


def openai_error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict:
    kind = OPENAI_TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": error_type}}


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PREFIXES)


def answered_status(path: str, status: int) -> int:
    """The status a refusal is answered with on this path: OpenAI answers a bad parameter with 400."""
    return 400 if status == 422 and is_openai_path(path) else status


def error_response(path: str, status: int, message: str, error_type: str | None = None,
                   headers: dict[str, str] | None = None, param: str | None = None) -> JSONResponse:
    error_type = error_type or STATUS_TYPES.get(status, "error")
    status = answered_status(path, status)
    if is_openai_path(path):
        return JSONResponse(openai_error_body(message, error_type, status, param), status_code=status,
                            headers=headers)
    return JSONResponse(error_body(message, error_type), status_code=status, headers=headers)


def stream_error_event(path: str, status: int, message: str, error_type: str) -> dict:
    """The last event of a stream that fails part-way, in the route's API shape."""
    if is_openai_path(path):
        return openai_error_body(message, error_type, status)
    return error_body(message, error_type)


def error_responses(*statuses: int, openai: bool = False) -> dict[int | str, dict]:
    """`responses=` for a route: each status with its error model (OpenAPI documents every refusal)."""
    model = OpenAIError if openai else TGIError
    reasons = {400: "malformed body (not JSON, nested too deeply)" + (" or an invalid parameter" if openai else ""),
               401: "missing or invalid API key", 404: "not found", 413: "request body too large",
               415: "the body is not application/json", 422: "a parameter is invalid (the message names it)",
               429: "the queue is full; retry later", 500: "generation failed", 503: "loading or shutting down",
               504: "the request exceeded its time limit"}
    return {s: {"model": model, "description": reasons.get(s, "error")} for s in statuses}


# ---------------------------------------------------------------------------------------- validation text
def validation_message(errors) -> tuple[str, str | None]:
    """Pydantic errors as ('field.path: problem; ...', first field). Errors from the branches of a union are
    merged: the deepest location wins ('stop.0: must be a string' for ["a", 1]), and alternatives at one
    location are joined ('stop: must be a string or a list')."""
    found: dict[str, list[str]] = {}
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {(err.get('ctx') or {}).get('error', 'decode error')}", None
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not _is_union_tag(p)) or "body"
        text = describe(err)
        if text not in found.setdefault(loc, []):
            found[loc].append(text)
    locs = [loc for loc in found if not any(o != loc and o.startswith(loc + ".") for o in found)]
    parts = []
    for loc in locs:
        texts = found[loc]
        joined = texts[0] + "".join(" or " + t.removeprefix("must be ") for t in texts[1:])
        parts.append(f"{loc}: {joined}")
    first = next((loc for loc in locs if loc != "body"), None)
    return "; ".join(parts[:4]) + (f" (and {len(parts) - 4} more)" if len(parts) > 4 else ""), first


def _is_union_tag(p) -> bool:
    """Pydantic names each union member tried ('str', 'list[int]', 'function-after[...]'): not a field."""
    return isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool", "list", "dict", "none")
                                   or p.startswith("constrained-"))


def _num(v) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def describe(err: dict) -> str:
    t, ctx = err.get("type", ""), err.get("ctx") or {}
    simple = {
        "missing": "is required",
        "int_type": "must be an integer", "int_parsing": "must be an integer", "int_from_float": "must be an integer",
        "float_type": "must be a number", "float_parsing": "must be a number",
        "bool_type": "must be a boolean (true or false)", "bool_parsing": "must be a boolean (true or false)",
        "string_type": "must be a string", "list_type": "must be a list",
        "dict_type": "must be a JSON object", "model_type": "must be a JSON object",
        "model_attributes_type": "must be a JSON object", "finite_number": "must be a finite number",
        "none_required": "must be null",
    }
    if t in simple:
        return simple[t]
    if t == "greater_than_equal":
        return f"must be >= {_num(ctx.get('ge'))}"
    if t == "greater_than":
        return f"must be > {_num(ctx.get('gt'))}"
    if t == "less_than_equal":
        return f"must be <= {_num(ctx.get('le'))}"
    if t == "less_than":
        return f"must be < {_num(ctx.get('lt'))}"
    if t == "too_long":
        return f"must have at most {ctx.get('max_length')} items"
    if t == "too_short":
        n = ctx.get("min_length")
        return "must not be empty" if n == 1 else f"must have at least {n} items"
    if t == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    if t == "string_too_short":
        n = ctx.get("min_length")
        return "must not be empty" if n == 1 else f"must be at least {n} characters"
    if t == "literal_error":
        return f"must be {ctx.get('expected')}"
    if t == "value_error":
        return str(ctx.get("error") or err.get("msg", "is invalid")).removeprefix("Value error, ")
    msg = str(err.get("msg", "is invalid")).removeprefix("Value error, ")
    return msg[:1].lower() + msg[1:]


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's own 405 names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.routes:
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(request.url.path):
            methods |= set(route_methods)
    methods.discard("HEAD")  # implied by GET
    return sorted(methods)


# ---------------------------------------------------------------------------------------- handlers
GENERATION_PATHS = frozenset({"/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions",
                              "/v1/responses"})


def refusal_counter(on_refusal: Callable[[int], None] | None) -> Callable[[str, str, int], None]:
    """(method, path, status) → `on_refusal(status)` for a refused generation request, with the status the client
    gets; the error handlers and the body-size middleware (which answers before any handler) share it."""

    def count(method: str, path: str, status: int) -> None:
        if on_refusal is not None and method == "POST" and path in GENERATION_PATHS:
            on_refusal(answered_status(path, status))

    return count


def install_error_handlers(app: FastAPI, on_refusal: Callable[[int], None] | None = None) -> None:
    """Every refusal in its route's shape; `on_refusal(status)` counts those of generation requests."""
    count = refusal_counter(on_refusal)

    def refused(request: Request, status: int) -> None:
        count(request.method, request.url.path, status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if not exc.started:
            refused(request, exc.status)
        return error_response(request.url.path, exc.status, exc.message, exc.error_type, exc.headers, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        message, param = validation_message(errors)
        status, kind = 422, "validation"
        if param is None and message.startswith("the request body is not valid JSON"):
            status, kind = 400, "bad_request"
        elif errors and errors[0].get("type") == "missing" and tuple(errors[0].get("loc", ())) == ("body",):
            status, kind, message = 400, "bad_request", "the request body is empty; expected a JSON object"
        refused(request, status)
        return error_response(request.url.path, status, message, kind, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            allowed = allowed_methods(request)
            message = f"method {request.method} is not allowed on {request.url.path} (allowed: {', '.join(allowed)})"
            return error_response(request.url.path, 405, message, headers={"Allow": ", ".join(allowed)})
        elif exc.status_code == 413:
            message = "the request body is too large"
        return error_response(request.url.path, exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request.url.path, 500, f"internal server error ({type(exc).__name__})", "internal")
