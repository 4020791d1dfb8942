"""Operations: readiness (/health), liveness (/live), /info, Prometheus /metrics, the playground page,
and the API docs (/docs, /redoc) served offline: Swagger UI's and ReDoc's assets come from the
fastapi-offline package (maintained, ships both), not a CDN."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import fastapi_offline
from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from app import __version__
from app.errors import TGIError, error_body
from app.routes import ServiceDep

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
DOCS_ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"
DOCS_ASSETS_URL = "/docs-assets"

router = APIRouter(tags=["Operations"])
UNAVAILABLE = {503: {"model": TGIError, "description": "loading, warming up, draining or failed"}}


class Status(BaseModel):
    status: Literal["ready", "alive"]


@router.get("/health", summary="Readiness: 200 when ready; 503 while loading, warming up or draining",
            response_model=Status, responses=UNAVAILABLE)
async def health(service: ServiceDep):
    status = service.status
    if status == "ready":
        return {"status": "ready"}
    engine = service.engine
    why = (engine.dead or engine.info.get("warmup_error")) if engine else ""
    messages = {"loading": "the model is loading", "draining": "the server is shutting down",
                "failed": f"the model is not usable: {why}"}
    return JSONResponse({**error_body(messages[status], "unavailable"), "status": status}, status_code=503)


@router.get("/live", summary="Liveness: 200 while the engine core runs (also loading/draining); 503 when it died",
            response_model=Status, responses=UNAVAILABLE)
async def live(service: ServiceDep):
    # Readiness (/health) says "send me traffic"; liveness only says "restart me": it fails only when the
    # engine core (its process, or its thread) has died, which nothing short of a restart fixes. While the model
    # loads or the server drains, the process is healthy, so this stays 200.
    engine = service.engine
    if engine is not None and not engine.alive:
        return JSONResponse({**error_body(f"the generation engine has stopped ({engine.dead}); restart the server",
                                          "unavailable"), "status": "dead"}, status_code=503)
    return {"status": "alive"}


@router.get("/info", summary="Model, checkpoint, device and limits", response_model=dict[str, Any])
async def info(service: ServiceDep) -> dict:
    s = service.settings
    body = {"model_id": service.model_name(), "version": __version__, "status": service.status,
            "checkpoint": str(s.checkpoint)}
    if service.tokenizer is not None and service.engine is not None:
        tok, info = service.tokenizer, service.engine.info
        body.update({
            "checkpoint": str(service.checkpoint_path), "metadata": service.metadata,
            "config": service.config.to_dict(), "n_params": info.get("n_params"), "tokenizer": tok.spec,
            "vocab_size": tok.vocab_size, "eos_token_id": tok.eot_id, "device": info.get("device"),
            "dtype": info.get("dtype"), "model_device_type": str(info.get("device", "")).split(":")[0],
            "model_dtype": info.get("dtype"), "engine_mode": service.settings.engine, "engine_pid": info.get("pid"),
            "torch_threads": info.get("torch_threads"),
            "malloc_keeps_freed_memory": info.get("malloc_keeps_freed_memory"),
            "load_seconds": info.get("load_seconds"), "startup_seconds": info.get("startup_seconds"),
            "weights": info.get("weights"), "weight_bytes": info.get("weight_bytes"),
            "kv_cache": info.get("kv_cache"), "kernels": info.get("kernels"),
            "dtype_choice": info.get("dtype_choice"), "thread_choice": info.get("thread_choice"),
            "cpu": info.get("cpu"), "cpu_note": info.get("cpu_note"),
            "speculative": info.get("speculative"),
            "api_servers": service.settings.api_servers})
    if service.limits is not None:
        lim = service.limits
        body.update({
            "max_total_tokens": lim.block_size, "max_input_tokens": lim.max_prompt_tokens,
            "max_prompt_tokens": lim.max_prompt_tokens, "max_new_tokens": lim.max_new_tokens,
            "default_max_new_tokens": lim.default_max_new_tokens,
            "max_stop_sequences": lim.max_stop_sequences, "max_stop_length": lim.max_stop_length,
            "max_top_n_tokens": lim.max_top_n_tokens})
    if service.chat_template is not None:
        body["chat_template"] = service.chat_template.origin
    body.update({"max_batch_size": s.max_batch_size,
                 "max_concurrent_requests": (s.max_batch_size or 0) + s.max_queue,
                 "max_queue": s.max_queue, "prefill_chunk": s.prefill_chunk,
                 "request_timeout_s": s.request_timeout_s, "max_body_bytes": s.max_body_bytes,
                 "api_key_required": service.api_key is not None,
                 "engine": service.engine.stats if service.engine else None})
    return body


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
async def metrics(service: ServiceDep) -> Response:
    return Response(service.metrics.render(), media_type=service.metrics.content_type)


@router.get("/", summary="The playground page (HTML)", response_class=HTMLResponse,
            responses={200: {"content": {"text/html": {}}}})
async def index(service: ServiceDep) -> Response:
    page = STATIC_DIR / "index.html"
    if page.is_file():
        return FileResponse(page, media_type="text/html")
    return HTMLResponse(_FALLBACK_PAGE.replace("{name}", service.model_name()))


# ------------------------------------------------------------------------------------------ docs
@router.get("/docs", include_in_schema=False)
async def swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    app = request.app
    return get_swagger_ui_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
                               oauth2_redirect_url=f"{root}/docs/oauth2-redirect",
                               swagger_js_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
                               swagger_css_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui.css",
                               swagger_favicon_url=f"{root}{DOCS_ASSETS_URL}/favicon.png")


@router.get("/docs/oauth2-redirect", include_in_schema=False)
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc", include_in_schema=False)
async def redoc(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    app = request.app
    return get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
                          redoc_js_url=f"{root}{DOCS_ASSETS_URL}/redoc.standalone.js",
                          redoc_favicon_url=f"{root}{DOCS_ASSETS_URL}/favicon.png", with_google_fonts=False)


def mount_static(app) -> None:
    app.mount(DOCS_ASSETS_URL, StaticFiles(directory=DOCS_ASSETS), name="docs-assets")
    if STATIC_DIR.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


_FALLBACK_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpt-serve</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 2em auto">
<h1>gpt-serve: {name}</h1>
<p>The playground page is not installed. The API is up: see <a href="/docs">/docs</a>,
<a href="/info">/info</a>, <a href="/health">/health</a> and <a href="/metrics">/metrics</a>.</p>
<pre>curl -s localhost:8000/generate -H 'Content-Type: application/json' \\
  -d '{"inputs": "To be, or not to be", "parameters": {"max_new_tokens": 40}}'</pre>
</body></html>
"""
