"""`create_app(settings)`: the FastAPI application — routers, error handlers, request guards, lifespan.

The pieces: `app.service` (loading, engine, lifecycle), `app.routes.*` (thin typed routes),
`app.protocol.*` (request / response models), `app.validation` (request → plan), `app.streaming`
(server-sent events), `app.guards` (content type, body size, JSON depth, CORS), `app.errors`.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from app import __version__
from app.config import Settings, load_settings
from app.errors import install_error_handlers, refusal_counter
from app.guards import BodySizeLimit, JSONCORSMiddleware
from app.openapi import limits_in_openapi
from app.routes import classify, openai, ops, responses, tgi
from app.service import CoreHandle, Service, lifespan

DESCRIPTION = ("GPT text generation with continuous batching. TGI routes (/generate, /generate_stream, POST /), "
               "OpenAI routes (/v1/completions, /v1/chat/completions, /v1/responses, /v1/models) and vLLM's /tokenize. "
               "Bodies must be `Content-Type: application/json`.")


def create_app(settings: Settings | None = None, *, loaded=None, core: CoreHandle | None = None,
               front_index: int = 0) -> FastAPI:
    """`loaded`: a checkpoint already loaded for GPT_ENGINE=thread; `core`: an engine core process already started
    (otherwise the lifespan loads or starts it)."""
    settings = settings or load_settings()
    _configure_logging(settings)
    app = FastAPI(title="gpt-serve", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # served by app.routes.ops from local assets
    app.state.service = service = Service(settings, loaded, core, front_index)
    def on_refusal(status: int) -> None:
        service.metrics.count_request(status, "rejected")

    install_error_handlers(app, on_refusal=on_refusal)
    app.include_router(ops.router)
    app.include_router(tgi.router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(classify.router)
    ops.mount_static(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes, on_refusal=refusal_counter(on_refusal))
    if settings.cors_origins:
        app.add_middleware(JSONCORSMiddleware, allow_origins=settings.cors_origins,
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    limits_in_openapi(app)
    return app


def _configure_logging(settings: Settings) -> None:
    logger = logging.getLogger("app")
    logger.setLevel(settings.log_level.upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
