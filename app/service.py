"""The service behind the routes: load the checkpoint, run the engine, admit validated plans, drain.

`lifespan` is the app's FastAPI lifespan: it loads the model (unless it was passed in already loaded, as
`python -m app` and `app.main` do, so that a bad checkpoint ends the process with one line before the server
starts) and starts the engine; the warm-up runs on the engine thread while /health answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request

from app.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from app.config import DTYPE_NAMES, Settings, SettingsError, default_max_batch_size, resolve_device, resolve_dtype
from app.engine import Engine, EngineError, GenerationRequest, QueueFullError
from app.errors import ApiError
from app.metrics import Metrics
from app.validation import Limits, Plan
from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.task_head import Task, TaskError, load_task

log = logging.getLogger("app")


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
        self.chat_template: ChatTemplate | None = None
        self.task: Task | None = None  # the fine-tuned task head (/classify), when the checkpoint has one
        self.draining = False
        self.started_at = time.time()
        self.api_key = settings.api_key.get_secret_value() if settings.api_key else None
        self.metrics.bind_engine(lambda: self.engine.n_queued if self.engine else 0,
                                 lambda: self.engine.n_running if self.engine else 0)

    # ---- lifecycle
    async def startup(self) -> None:
        if self.loaded is None:
            log.info("loading checkpoint %s", self.settings.checkpoint)
            self.loaded = await asyncio.to_thread(load_model, self.settings)
        ckpt, s = self.loaded.checkpoint, self.settings
        try:
            self.chat_template = load_chat_template(ckpt.path, self._eos_text(), s.chat_template)
        except ChatTemplateError as e:
            raise StartupError(str(e)) from None
        try:
            self.task = load_task(ckpt.path, ckpt.model, self.loaded.device)
        except TaskError as e:
            raise StartupError(f"cannot load the task head: {e}") from None
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
            max_top_n_tokens=s.max_top_n_tokens, vocab_size=ckpt.tokenizer.vocab_size,
            max_choices=s.max_batch_size + s.max_queue)
        try:
            self.engine = Engine(ckpt.model, ckpt.tokenizer, max_batch_size=s.max_batch_size, max_queue=s.max_queue,
                                 prefill_chunk=s.prefill_chunk, metrics=self.metrics, warmup=s.warmup,
                                 cuda_graphs=s.cuda_graphs)
        except (RuntimeError, ValueError) as e:  # e.g. the KV cache does not fit in memory
            raise StartupError(f"cannot allocate the KV cache ({s.max_batch_size} slots x {block} tokens): "
                               f"{type(e).__name__}: {e}") from None
        self.engine.start()
        log.info("serving %s (%s parameters, context %d) on %s/%s, %d slots, chat template: %s; loaded in %.1f s",
                 ckpt.path, f"{ckpt.model.num_params():,}", block, self.loaded.device,
                 DTYPE_NAMES.get(self.loaded.dtype, str(self.loaded.dtype)), s.max_batch_size,
                 self.chat_template.origin, self.loaded.seconds)

    def _eos_text(self) -> str:
        tok = self.loaded.checkpoint.tokenizer
        try:
            return tok.decode([tok.eot_id]) if tok.eot_id is not None else ""
        except (KeyError, ValueError):
            return ""

    def begin_drain(self) -> None:
        if not self.draining:
            log.info("draining: refusing new requests, finishing %d running and %d queued",
                     self.engine.n_running if self.engine else 0, self.engine.n_queued if self.engine else 0)
        self.draining = True
        if self.engine:
            self.engine.begin_drain()

    def drain(self, timeout_s: float) -> bool:
        """(Blocking.) Wait up to `timeout_s` for running requests; past it, end them: each open stream gets a
        final error event. True when everything finished in time."""
        self.begin_drain()
        if self.engine is None:
            return True
        if self.engine.wait_idle(timeout_s):
            return True
        log.warning("drain timed out after %.0f s; ending %d running and %d queued requests with an error",
                    timeout_s, self.engine.n_running, self.engine.n_queued)
        self.engine.stop()  # sends every remaining request a 503 'the server shut down' item
        return False

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.drain, self.settings.shutdown_timeout_s)
        if self.engine:
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

    # ---- requests
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_open(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down and accepts no new requests")
        if self.engine is None or self.limits is None:
            raise ApiError(503, "the model is loading")

    def submit(self, plan: Plan) -> list[tuple[int, GenerationRequest]]:
        """Admit every choice of the plan, or none: (choice index, request) pairs."""
        reqs: list[tuple[int, GenerationRequest]] = []
        try:
            for index, prompt, params in plan.choices():
                try:
                    req = GenerationRequest(prompt.ids, params, self.tokenizer,
                                            timeout_s=self.settings.request_timeout_s, top_n=plan.top_n)
                except ValueError as e:  # SamplingParams' own check; validation should have caught it first
                    raise ApiError(422, f"parameters: {e}", "validation", param="parameters") from None
                try:
                    self.engine.submit(req)
                except QueueFullError as e:
                    raise ApiError(429, str(e), "overloaded", headers={"Retry-After": "1"}) from None
                except EngineError as e:
                    raise ApiError(e.status, str(e), e.error_type) from None
                reqs.append((index, req))
        except ApiError:
            for _, r in reqs:
                r.cancel()
            raise
        return reqs


def get_service(request: Request) -> Service:
    """Dependency: the app's service."""
    return request.app.state.service


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    service: Service = app.state.service
    try:
        await service.startup()
    except StartupError as e:  # uvicorn then exits non-zero; `python -m app` and app.main load (and refuse) first
        log.error("%s", e)
        raise
    yield
    await service.shutdown()
