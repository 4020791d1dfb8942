"""One error shape for every failure: `{"error": "<what went wrong>", "error_type": "<kind>"}`.

error_type values follow TGI where TGI has one (huggingface_hub maps them to exceptions):
validation (422), overloaded (429), generation (500); and for the rest: bad_request (400),
unauthorized (401), not_found (404), method_not_allowed (405), payload_too_large (413),
unavailable (503), timeout (504), internal (500).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("app")

STATUS_TYPES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                405: "method_not_allowed", 408: "timeout", 413: "payload_too_large", 415: "bad_request",
                422: "validation", 429: "overloaded", 500: "internal", 503: "unavailable", 504: "timeout"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or STATUS_TYPES.get(status, "error")
        self.headers = headers


def error_body(message: str, error_type: str) -> dict:
    return {"error": message, "error_type": error_type}


def error_response(status: int, message: str, error_type: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type or STATUS_TYPES.get(status, "error")),
                        status_code=status, headers=headers)


def validation_message(errors) -> str:
    """Pydantic errors as 'field.path: problem; ...'."""
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",)) or "body"
        parts.append(f"{loc}: {describe(err)}")
    return "; ".join(parts)


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
        "json_invalid": "is not valid JSON",
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
        return f"must have at least {ctx.get('min_length')} items"
    if t == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    if t == "string_too_short":
        n = ctx.get("min_length")
        return "must not be empty" if n == 1 else f"must be at least {n} characters"
    msg = str(err.get("msg", "is invalid"))
    return msg[:1].lower() + msg[1:]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.error_type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(422, validation_message(exc.errors()), "validation")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error ({type(exc).__name__})", "internal")
