"""The FastAPI application: TGI routes (/generate, /generate_stream, POST /), OpenAI completions,
health / info / metrics, and the playground page.

`create_app(settings)` builds an app whose lifespan loads the checkpoint (unless one is passed in
already loaded, as `python -m app` does after validating it) and starts the engine; the warm-up
runs on the engine thread while /health answers 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from app import __version__
from app.config import (
    DTYPE_NAMES,
    Settings,
    SettingsError,
    default_max_batch_size,
    load_settings,
    resolve_device,
    resolve_dtype,
)
from app.engine import Engine, EngineError, Failed, GenerationRequest, QueueFullError, TokenOut
from app.errors import ApiError, error_body, install_error_handlers
from app.metrics import Metrics
from app.schemas import CompletionRequest, Limits, Plan, TGIRequest, parse_json_body, plan_completion, plan_tgi
from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.stopping import FinishReason

log = logging.getLogger("app")
STATIC_DIR = Path(__file__).resolve().parent / "static"


class StartupError(RuntimeError):
    """The server cannot start; the message is one line."""


@dataclass
class Loaded:
    checkpoint: Checkpoint
    device: torch.device
    dtype: torch.dtype
    seconds: float


def load_model(settings: Settings) -> Loaded:
    """Resolve device and dtype and load the checkpoint; StartupError with a one-line reason on failure."""
    t0 = time.perf_counter()
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    try:
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
    except SettingsError as e:
        raise StartupError(str(e)) from None
    try:
        ckpt = load_checkpoint(settings.checkpoint, device=device, dtype=dtype)
    except CheckpointError as e:
        raise StartupError(f"cannot load checkpoint: {e}") from None
    except (OSError, RuntimeError, ValueError) as e:  # e.g. out of GPU memory
        raise StartupError(f"cannot load checkpoint {settings.checkpoint}: {type(e).__name__}: {e}") from None
    return Loaded(ckpt, device, dtype, time.perf_counter() - t0)


class Service:
    """Everything the routes share: settings, the loaded model, the engine, metrics, the drain flag."""

    def __init__(self, settings: Settings, loaded: Loaded | None = None) -> None:
        self.settings = settings
        self.loaded = loaded
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.limits: Limits | None = None
        self.draining = False
        self.started_at = time.time()
        self.metrics.bind_engine(lambda: self.engine.n_queued if self.engine else 0,
                                 lambda: self.engine.n_running if self.engine else 0)

    # ---- lifecycle
    async def startup(self) -> None:
        if self.loaded is None:
            log.info("loading checkpoint %s", self.settings.checkpoint)
            self.loaded = await asyncio.to_thread(load_model, self.settings)
        ckpt, s = self.loaded.checkpoint, self.settings
        block = ckpt.config.block_size
        if s.max_batch_size is None:
            s.max_batch_size = default_max_batch_size(ckpt.config.n_layer, ckpt.config.n_embd, block,
                                                      self.loaded.device, self.loaded.dtype,
                                                      s.kv_cache_memory_fraction)
        self.limits = Limits(
            block_size=block,
            max_prompt_tokens=min(s.max_prompt_tokens or block - 1, block - 1),
            max_new_tokens=min(s.max_new_tokens or block - 1, block - 1),
            default_max_new_tokens=s.default_max_new_tokens,
            max_stop_sequences=s.max_stop_sequences, max_stop_length=s.max_stop_length,
            max_top_n_tokens=s.max_top_n_tokens)
        try:
            self.engine = Engine(ckpt.model, ckpt.tokenizer, max_batch_size=s.max_batch_size, max_queue=s.max_queue,
                                 prefill_chunk=s.prefill_chunk, metrics=self.metrics, warmup=s.warmup,
                                 cuda_graphs=s.cuda_graphs)
        except (RuntimeError, ValueError) as e:  # e.g. the KV cache does not fit in memory
            raise StartupError(f"cannot allocate the KV cache ({s.max_batch_size} slots x {block} tokens): "
                               f"{type(e).__name__}: {e}") from None
        self.engine.start()
        log.info("serving %s (%s parameters, context %d) on %s/%s, %d slots; loaded in %.1f s",
                 ckpt.path, f"{ckpt.model.num_params():,}", block, self.loaded.device,
                 DTYPE_NAMES.get(self.loaded.dtype, str(self.loaded.dtype)), s.max_batch_size, self.loaded.seconds)

    def begin_drain(self) -> None:
        if not self.draining:
            log.info("draining: refusing new requests, finishing %d running and %d queued",
                     self.engine.n_running if self.engine else 0, self.engine.n_queued if self.engine else 0)
        self.draining = True
        if self.engine:
            self.engine.begin_drain()

    async def shutdown(self) -> None:
        self.begin_drain()
        if self.engine:
            if not await asyncio.to_thread(self.engine.wait_idle, self.settings.shutdown_timeout_s):
                log.warning("shutdown: requests still running after %.0f s; ending them",
                            self.settings.shutdown_timeout_s)
            await asyncio.to_thread(self.engine.stop)

    # ---- state
    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.engine is None or not self.engine.ready.is_set():
            return "loading"
        if self.engine.warmup_error or not self.engine.alive:
            return "failed"
        return "ready"

    @property
    def tokenizer(self):
        return self.loaded.checkpoint.tokenizer

    def model_name(self) -> str:
        return self.settings.served_model_name()


class GPTApp(FastAPI):
    """FastAPI with its own lifespan handling, so a failed start-up is one logged line, not a traceback."""

    service: Service

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await super().__call__(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        await receive()  # lifespan.startup
        try:
            await self.service.startup()
        except StartupError as e:
            await send({"type": "lifespan.startup.failed", "message": str(e)})
            return
        except BaseException:
            await send({"type": "lifespan.startup.failed", "message": traceback.format_exc()})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        try:
            await self.service.shutdown()
        except BaseException:
            await send({"type": "lifespan.shutdown.failed", "message": traceback.format_exc()})
            return
        await send({"type": "lifespan.shutdown.complete"})


# ------------------------------------------------------------------------------------------------ helpers
async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        try:
            n = int(length)
        except ValueError:
            raise ApiError(400, f"invalid Content-Length header {length!r}") from None
        if n > limit:
            raise ApiError(413, f"the request body is {n} bytes; the limit is {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the request body") from None
    return b"".join(chunks)


async def watch_disconnect(receive: Callable, req: GenerationRequest) -> None:
    """Wait for the client to go away, then cancel its request (the worker frees the slot next step)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not req.closed:
                req.disconnect()
            return


def token_json(t: TokenOut) -> dict:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def top_json(t: TokenOut) -> list[dict]:
    return [{"id": i, "text": s, "logprob": lp, "special": False} for i, s, lp in (t.top or [])]


def sse(data: dict | str, prefix: str = "data:") -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"{prefix}{payload}\n\n".encode()


class EventStream(StreamingResponse):
    """Server-sent events from an async iterator; a client disconnect cancels the request at once."""

    def __init__(self, events: AsyncIterator[bytes], req: GenerationRequest) -> None:
        super().__init__(events, status_code=200, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events, self.req = events, req

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        watcher = asyncio.create_task(watch_disconnect(receive, self.req))
        try:
            async for chunk in self.events:
                if self.req.disconnected:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not self.req.disconnected:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the connection broke while sending
            self.req.disconnect()
        finally:
            watcher.cancel()
            if not self.req.closed:
                self.req.cancel()
            await self.events.aclose()


class ClientGone(Exception):
    pass


def openai_finish(reason: FinishReason) -> str:
    return "length" if reason == FinishReason.LENGTH else "stop"


# ------------------------------------------------------------------------------------------------ app
def create_app(settings: Settings | None = None, *, loaded: Loaded | None = None) -> GPTApp:
    settings = settings or load_settings()
    _configure_logging(settings)
    service = Service(settings, loaded)
    app = GPTApp(title="gpt-serve", version=__version__,
                 description="GPT text generation with continuous batching; TGI- and OpenAI-compatible routes.")
    app.service = service
    app.state.service = service
    install_error_handlers(app)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)

    api_key = settings.api_key.get_secret_value() if settings.api_key else None

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           headers={"WWW-Authenticate": "Bearer"})

    async def start(request: Request, planner: Callable[[dict], Plan]) -> tuple[Plan, GenerationRequest]:
        """Auth, body, validation, admission. Every refusal is counted in gpt_requests_total."""
        try:
            check_auth(request)
            if service.draining:
                raise ApiError(503, "the server is shutting down and accepts no new requests")
            if service.engine is None:
                raise ApiError(503, "the model is loading")
            body = await read_body(request, settings.max_body_bytes)
            data = parse_json_body(body)
            plan = planner(data) if len(body) < 65536 else await run_in_threadpool(planner, data)
            try:
                req = GenerationRequest(plan.prompt_ids, plan.params, service.tokenizer,
                                        timeout_s=settings.request_timeout_s, top_n=plan.top_n)
            except ValueError as e:  # SamplingParams' own check; the schemas should have caught it first
                raise ApiError(422, f"parameters: {e}", "validation") from None
            try:
                service.engine.submit(req)
            except QueueFullError as e:
                raise ApiError(429, str(e), "overloaded", headers={"Retry-After": "1"}) from None
            except EngineError as e:
                raise ApiError(e.status, str(e), e.error_type) from None
            return plan, req
        except ApiError as e:
            service.metrics.count_request(e.status, "rejected")
            raise

    async def collect(request: Request, req: GenerationRequest) -> list[TokenOut]:
        """Wait for a whole generation; a client that disconnects cancels it."""
        watcher = asyncio.create_task(watch_disconnect(request.receive, req))
        tokens: list[TokenOut] = []
        try:
            async for item in req.events():
                if isinstance(item, Failed):
                    raise ApiError(item.status, item.message, item.error_type)
                tokens.append(item)
            if not tokens or tokens[-1].finished is None:
                raise ClientGone()
            return tokens
        finally:
            watcher.cancel()
            if not req.closed:
                req.cancel()

    # ---------------------------------------------------------------------------------------- TGI
    def tgi_details(plan: Plan, tokens: list[TokenOut], stream: bool) -> dict:
        fin = tokens[-1].finished
        d = {"finish_reason": fin.finish_reason.value, "generated_tokens": fin.generated_tokens,
             "seed": fin.seed if plan.sampling else None, "input_length": fin.prompt_tokens,
             "prompt_tokens": fin.prompt_tokens}
        if not stream:
            d["prefill"] = []
            d["tokens"] = [token_json(t) for t in tokens]
            if plan.top_n:
                d["top_tokens"] = [top_json(t) for t in tokens]
            d["best_of_sequences"] = None
        return d

    async def tgi(request: Request, stream: bool | None) -> Response:
        tok = service.tokenizer
        plan, req = await start(request, lambda data: plan_tgi(data, tok, service.limits, stream))
        prefix = plan.prompt_text if plan.return_full_text else ""
        if plan.stream:
            return EventStream(tgi_events(plan, req, prefix), req)
        try:
            tokens = await collect(request, req)
        except ClientGone:
            return Response(status_code=499)
        body = {"generated_text": prefix + tokens[-1].finished.text}
        if plan.details:
            body["details"] = tgi_details(plan, tokens, stream=False)
        return JSONResponse(body)

    async def tgi_events(plan: Plan, req: GenerationRequest, prefix: str) -> AsyncIterator[bytes]:
        tokens: list[TokenOut] = []
        async for item in req.events():
            if isinstance(item, Failed):
                yield sse(error_body(item.message, item.error_type))
                return
            tokens.append(item)
            event = {"index": item.index, "token": token_json(item), "generated_text": None, "details": None}
            if plan.top_n:
                event["top_tokens"] = top_json(item)
            if item.finished is not None:
                event["generated_text"] = prefix + item.finished.text
                if plan.details:
                    event["details"] = tgi_details(plan, tokens, stream=True)
            yield sse(event)

    @app.post("/generate", summary="Generate text (TGI); SSE when the body has \"stream\": true")
    async def generate(request: Request):
        return await tgi(request, None)

    @app.post("/generate_stream", summary="Generate text as server-sent events, one per token (TGI)")
    async def generate_stream(request: Request):
        return await tgi(request, True)

    @app.post("/", summary="TGI's compatibility route (huggingface_hub InferenceClient.text_generation)")
    async def compat_generate(request: Request):
        return await tgi(request, None)

    # ------------------------------------------------------------------------------------- OpenAI
    def completion_logprobs(tokens: list[TokenOut], offset: int) -> dict:
        lp = {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}
        for t in tokens:
            lp["tokens"].append(t.text)
            lp["token_logprobs"].append(t.logprob)
            lp["text_offset"].append(offset)
            offset += len(t.text) if not t.special else 0
            if t.top:
                top: dict[str, float] = {}
                for _, s, v in t.top:
                    top[s] = max(v, top.get(s, float("-inf")))
                lp["top_logprobs"].append(top)
            else:
                lp["top_logprobs"].append(None)
        return lp

    def usage(n_prompt: int, n_new: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}

    @app.post("/v1/completions", summary="OpenAI-compatible text completion")
    async def completions(request: Request):
        tok = service.tokenizer
        plan, req = await start(request, lambda data: plan_completion(data, tok, service.limits))
        cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), service.model_name()
        if plan.stream:
            return EventStream(openai_events(plan, req, cid, created, model), req)
        try:
            tokens = await collect(request, req)
        except ClientGone:
            return Response(status_code=499)
        fin = tokens[-1].finished
        prefix = plan.prompt_text if plan.return_full_text else ""
        choice = {"index": 0, "text": prefix + fin.text,
                  "logprobs": completion_logprobs(tokens, 0) if plan.details else None,
                  "finish_reason": openai_finish(fin.finish_reason)}
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "system_fingerprint": None, "choices": [choice],
                             "usage": usage(fin.prompt_tokens, fin.generated_tokens)})

    async def openai_events(plan: Plan, req: GenerationRequest, cid: str, created: int,
                            model: str) -> AsyncIterator[bytes]:
        def chunk(text: str, logprobs, finish: str | None) -> bytes:
            body = {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "system_fingerprint": None,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
            if plan.include_usage:
                body["usage"] = None
            return sse(body, "data: ")

        offset = 0
        if plan.return_full_text:
            yield chunk(plan.prompt_text, None, None)
        async for item in req.events():
            if isinstance(item, Failed):
                yield sse(error_body(item.message, item.error_type), "data: ")
                return
            fin = item.finished
            lp = None
            if plan.details:
                lp = completion_logprobs([item], offset)
                offset += len(item.text)
            yield chunk(item.text, lp, openai_finish(fin.finish_reason) if fin else None)
            if fin is not None:
                if plan.include_usage:
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": usage(fin.prompt_tokens, fin.generated_tokens)}, "data: ")
                yield b"data: [DONE]\n\n"

    @app.get("/v1/models", summary="The served model (OpenAI)")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [
            {"id": service.model_name(), "object": "model", "created": int(service.started_at),
             "owned_by": "gpt-serve", "max_model_len": service.limits.block_size if service.limits else None}]}

    # -------------------------------------------------------------------------------- operations
    @app.get("/health", summary="200 when ready; 503 while loading, warming up or draining")
    async def health():
        status = service.status
        if status == "ready":
            return {"status": "ready"}
        messages = {"loading": "the model is loading", "draining": "the server is shutting down",
                    "failed": f"the model is not usable: {service.engine.warmup_error if service.engine else ''}"}
        return JSONResponse({**error_body(messages[status], "unavailable"), "status": status}, status_code=503)

    @app.get("/live", summary="Liveness: 200 while the engine thread runs (also loading/draining); 503 when it died")
    async def live():
        # Readiness (/health) says "send me traffic"; liveness only says "restart me": it fails only when the
        # engine thread has died, which nothing short of a restart fixes. While the model loads (no engine yet)
        # or the server drains, the process is healthy, so this stays 200.
        engine = service.engine
        if engine is not None and not engine.alive:  # (the engine starts right where it is created)
            return JSONResponse({**error_body("the generation engine thread has stopped; restart the server",
                                              "unavailable"), "status": "dead"}, status_code=503)
        return {"status": "alive"}

    @app.get("/info", summary="Model, checkpoint, device and limits")
    async def info():
        s = settings
        body = {"model_id": service.model_name(), "version": __version__, "status": service.status,
                "checkpoint": str(s.checkpoint)}
        if service.loaded is not None:
            ckpt = service.loaded.checkpoint
            dtype = DTYPE_NAMES.get(service.loaded.dtype, str(service.loaded.dtype))
            body.update({
                "checkpoint": str(ckpt.path), "metadata": ckpt.metadata, "config": ckpt.config.to_dict(),
                "n_params": ckpt.model.num_params(), "tokenizer": ckpt.tokenizer.spec,
                "vocab_size": ckpt.tokenizer.vocab_size, "eos_token_id": ckpt.tokenizer.eot_id,
                "device": str(service.loaded.device), "dtype": dtype,
                "model_device_type": service.loaded.device.type, "model_dtype": dtype})
        if service.limits is not None:
            lim = service.limits
            body.update({
                "max_total_tokens": lim.block_size, "max_input_tokens": lim.max_prompt_tokens,
                "max_prompt_tokens": lim.max_prompt_tokens, "max_new_tokens": lim.max_new_tokens,
                "default_max_new_tokens": lim.default_max_new_tokens,
                "max_stop_sequences": lim.max_stop_sequences, "max_stop_length": lim.max_stop_length,
                "max_top_n_tokens": lim.max_top_n_tokens})
        body.update({"max_batch_size": s.max_batch_size, "max_concurrent_requests": s.max_batch_size + s.max_queue,
                     "max_queue": s.max_queue, "prefill_chunk": s.prefill_chunk,
                     "request_timeout_s": s.request_timeout_s, "max_body_bytes": s.max_body_bytes,
                     "api_key_required": api_key is not None,
                     "engine": service.engine.stats() if service.engine else None})
        return body

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    @app.get("/", include_in_schema=False)
    async def index():
        page = STATIC_DIR / "index.html"
        if page.is_file():
            return FileResponse(page, media_type="text/html")
        return HTMLResponse(_FALLBACK_PAGE.replace("{name}", service.model_name()))

    if STATIC_DIR.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    def openapi() -> dict:
        """The generation routes parse their bodies by hand (for precise errors); document them anyway."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in [("/generate", TGIRequest), ("/generate_stream", TGIRequest), ("/", TGIRequest),
                                ("/v1/completions", CompletionRequest)]:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


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


def _configure_logging(settings: Settings) -> None:
    logger = logging.getLogger("app")
    logger.setLevel(settings.log_level.upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
