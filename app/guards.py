"""What a request must be before a route sees it: JSON by content type, not too large, not nested too
deeply, valid Unicode; and CORS refusals in the API's JSON error shape.

- `StrictJSONRoute`: the routers' route class. Parses bodies with `parse_json` (400 for bad JSON or deep
  nesting, lone UTF-16 surrogates replaced by U+FFFD) before FastAPI validates them into request models.
- `json_only`: a dependency of every route with a body: 415 unless `Content-Type: application/json`.
  (A text/plain POST needs no CORS preflight, so without this any web page could spend the server's compute.)
- `BodySizeLimit`: a pure ASGI middleware: 413 for a body over the limit (from Content-Length at once, or
  while it streams). It wraps only `receive`, so streamed responses pay nothing per token.
- `JSONCORSMiddleware`: Starlette's CORS, refusing a disallowed preflight with a JSON error instead of text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ApiError, error_response

MAX_DEPTH = 32  # arrays / objects inside one another; real requests use 3 (chat content parts)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _number(text: str) -> int | float:
    """JSON has one number type: 5.0 is the integer 5 (as JSON Schema says), so an integer field takes it; a
    float field takes an int anyway. A string "5" stays refused."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2**63 else value


def parse_json(body: bytes) -> Any:
    """Bytes → JSON value; ApiError(400) naming the problem. NaN / Infinity are refused (not JSON)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (invalid byte at offset {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_number)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") \
            from None
    except RecursionError:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    return clean(data)


def clean(data: Any) -> Any:
    """Check the nesting depth and replace lone surrogates (legal JSON escapes, not Unicode text), without
    recursion: an iterative walk, so no body can exhaust the stack here or later."""
    if isinstance(data, str):
        return _fix(data)
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str):
                    if _SURROGATE.search(v):
                        node[i] = _fix(v)
                elif isinstance(v, (list, dict)):
                    stack.append((v, depth + 1))
        elif isinstance(node, dict):
            if any(_SURROGATE.search(k) for k in node):
                fixed = {_fix(k): v for k, v in node.items()}
                node.clear()
                node.update(fixed)
            for k, v in node.items():
                if isinstance(v, str):
                    if _SURROGATE.search(v):
                        node[k] = _fix(v)
                elif isinstance(v, (list, dict)):
                    stack.append((v, depth + 1))
    return data


def _fix(s: str) -> str:
    return _SURROGATE.sub("\ufffd", s) if _SURROGATE.search(s) else s


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """FastAPI's documented hook for a custom Request class: bodies parse through `parse_json`."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict


async def json_only(request: Request) -> None:
    """Dependency: the body must be declared JSON (415 otherwise; FastAPI would call it a missing body). The
    dependencies of a request are `async def` though they never await: FastAPI runs a plain `def` dependency in
    its thread pool, a hop each, ~0.4 ms of a one-token request's 3.5-3.9 (docs/performance.md, 2026-12-06)."""
    value = request.headers.get("content-type", "")
    media = value.split(";", 1)[0].strip().lower()
    if not (media == "application/json" or (media.startswith("application/") and media.endswith("+json"))):
        got = f"'{value}'" if value else "none"
        raise ApiError(415, f"Content-Type must be application/json (got {got})", "unsupported_media_type")


class _TooLarge(ApiError):
    def __init__(self, limit: int, size: int | None = None) -> None:
        what = f"the request body is {size} bytes" if size is not None else "the request body exceeds the limit"
        super().__init__(413, f"{what}; the limit is {limit} bytes", "payload_too_large")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int,
                 on_refusal: Callable[[str, str, int], None] | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.on_refusal = on_refusal  # (method, path, status) of a request answered here (errors.refusal_counter)

    def _refuse(self, scope: Scope, status: int, message: str, error_type: str | None = None):
        if self.on_refusal is not None:
            self.on_refusal(scope.get("method", ""), scope["path"], status)
        return error_response(scope["path"], status, message, error_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                await self._refuse(scope, 400, f"invalid Content-Length header {length!r}")(scope, receive, send)
                return
            if n > self.max_bytes:
                e = _TooLarge(self.max_bytes, n)
                await self._refuse(scope, 413, e.message, e.error_type)(scope, receive, send)
                return
        seen = 0
        limit = self.max_bytes

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)  # raised inside request.body(): FastAPI hands it to the handlers
            return message

        await self.app(scope, counted, send)


class JSONCORSMiddleware(CORSMiddleware):
    _path = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._path = scope.get("path", "")  # read synchronously by preflight_response below (no await between)
        await super().__call__(scope, receive, send)

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-type", "content-length")}
        message = response.body.decode() + f" (origin {request_headers.get('origin')!r})"
        return error_response(self._path, 400, message, "cors", headers=headers)
