"""The service behind the routes: the engine client, the model's limits, admission, drain, metrics hooks.

`lifespan` is the app's FastAPI lifespan. With GPT_ENGINE=process (the default) the engine core runs in its own
process (`engine.core_process`): `python -m app` and `app.main` start it before the server so a bad checkpoint
ends the process with one line; otherwise the lifespan starts it. This process then reads only the checkpoint's
config and tokenizer. With GPT_ENGINE=thread the model is loaded here and the same core loop runs on a thread.
Either way the warm-up runs in the core while /health answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from app.config import Settings
from app.errors import ApiError, outcome_labels, status_of
from app.metrics import Metrics
from app.responses import ResponseStore
from app.validation import Limits, Plan
from engine.build import CoreConfig, StartupError, build_core, load_model
from engine.client import EngineClient, EngineError, ProcessEngineClient, ThreadEngineClient
from engine.core_process import CoreProcess
from engine.output_processor import RequestState
from model.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from model.checkpoint_info import CheckpointError, read_checkpoint

log = logging.getLogger("app")

__all__ = ["CoreHandle", "Service", "StartupError", "get_service", "lifespan", "load_model", "start_engine"]


@dataclass
class CoreHandle:
    """A running engine core process to attach to: its address, pid and load info (`process` when this process
    started it and stops it at shutdown)."""

    address: str
    pid: int
    info: dict[str, Any]
    process: CoreProcess | None = None

    @classmethod
    def start(cls, settings: Settings, started: CoreProcess | None = None) -> CoreHandle:
        """(Blocking.) Start the core process (unless `started` already is) and wait until it has loaded the model;
        StartupError otherwise."""
        proc = started
        if proc is None:
            proc = CoreProcess(CoreConfig.from_settings(settings))
            proc.start()
        info = proc.wait_loaded()
        return cls(proc.address, proc.pid, info, proc)


def start_engine(settings: Settings, started: CoreProcess | None = None) -> tuple[Any, CoreHandle | None]:
    """(Blocking.) Before the port opens: the model loaded here (GPT_ENGINE=thread) or the engine core's process
    (`started` by the caller, or here) loaded, as (loaded, core) for `create_app`; StartupError with a one-line
    reason otherwise."""
    if settings.engine == "thread":
        return load_model(CoreConfig.from_settings(settings)), None
    return None, CoreHandle.start(settings, started)


class Service:
    """Everything the routes share: settings, the engine client, limits, metrics, the drain flag."""

    def __init__(self, settings: Settings, loaded=None, core: CoreHandle | None = None,
                 front_index: int = 0) -> None:
        self.settings = settings
        self.loaded = loaded  # thread mode: (checkpoint, device, dtype, seconds) already loaded by the caller
        self.core = core
        self.front_index = front_index
        self.metrics = Metrics()
        self.engine: EngineClient | None = None
        self.limits: Limits | None = None
        self.chat_template: ChatTemplate | None = None
        self.tokenizer = None
        self.config = None
        self.metadata: dict[str, Any] = {}
        self.checkpoint_path = settings.checkpoint
        self.draining = False
        self.started_at = time.time()
        self.api_key = settings.api_key.get_secret_value() if settings.api_key else None
        self.on_engine_dead: Callable[[str], None] | None = None  # set by the launchers: exit non-zero
        self.responses = ResponseStore(settings.responses_store)  # for previous_response_id
        self.metrics.bind_engine(lambda: self.engine.stats if self.engine else {})

    # ---- lifecycle
    async def startup(self) -> None:
        s = self.settings
        capacity_of = lambda slots: -(-(slots + s.max_queue) // max(1, s.api_servers))  # noqa: E731
        hooks = dict(on_token=self._on_token, on_end=self._on_end, on_dead=self._on_dead, name=str(self.front_index))
        if s.engine == "thread":
            if self.loaded is None:
                log.info("loading checkpoint %s", s.checkpoint)
                self.loaded = await asyncio.to_thread(load_model, CoreConfig.from_settings(s))
            ckpt = self.loaded[0]
            self.tokenizer, self.config, self.metadata, self.checkpoint_path = (ckpt.tokenizer, ckpt.config,
                                                                                ckpt.metadata, ckpt.path)
            core, info, classify = build_core(CoreConfig.from_settings(s), self.loaded)
            self.engine = ThreadEngineClient(core, self.tokenizer, info=info, classify=classify, warmup=s.warmup,
                                             stream_interval_s=s.stream_interval_ms / 1000,
                                             capacity=capacity_of(info["max_batch_size"]), **hooks)
        else:
            try:
                self.config, self.tokenizer, self.metadata = read_checkpoint(s.checkpoint)
            except CheckpointError as e:
                raise StartupError(f"cannot load checkpoint: {e}") from None
            if self.core is None:
                log.info("starting the engine core process for %s", s.checkpoint)
                self.core = await asyncio.to_thread(CoreHandle.start, s)
            info = self.core.info
            self.engine = ProcessEngineClient(self.core.address, self.core.pid, self.tokenizer,
                                              capacity=capacity_of(info["max_batch_size"]), **hooks)
        self.engine.info = info
        try:
            self.chat_template = load_chat_template(self.checkpoint_path, self.eos_text(), s.chat_template)
        except ChatTemplateError as e:
            raise StartupError(str(e)) from None
        block = self.config.block_size
        slots = info["max_batch_size"]
        s.max_batch_size = slots
        self.limits = Limits(
            block_size=block,
            max_prompt_tokens=min(s.max_prompt_tokens or block - 1, block - 1),
            max_new_tokens=min(s.max_new_tokens or block - 1, block - 1),
            default_max_new_tokens=s.default_max_new_tokens,
            max_stop_sequences=s.max_stop_sequences, max_stop_length=s.max_stop_length,
            max_top_n_tokens=s.max_top_n_tokens, vocab_size=self.tokenizer.vocab_size,
            max_choices=slots + s.max_queue)
        await self.engine.start()
        kv = info.get("kv_cache") or {}
        draft_kv = f" + the draft model's {kv['draft_bytes'] / 1e6:.1f} MB" if kv.get("draft_bytes") else ""
        log.info("serving %s (%s parameters, context %d) on %s/%s, weights %s (%.1f MB), %d slots (KV cache %.1f MB "
                 "%s%s of a %.1f MB budget), engine in a %s, chat template: %s",
                 self.checkpoint_path, f"{info['n_params']:,}", block, info["device"], info["dtype"],
                 info.get("weights"), (info.get("weight_bytes") or 0) / 1e6, slots, kv.get("bytes", 0) / 1e6,
                 kv.get("dtype"), draft_kv, kv.get("budget", 0) / 1e6,
                 "thread" if s.engine == "thread" else f"process (pid {self.core.pid})", self.chat_template.origin)
        if info.get("cpu_note"):
            log.warning("%s", info["cpu_note"])

    def eos_text(self) -> str:
        tok = self.tokenizer
        try:
            return tok.decode([tok.eot_id]) if tok.eot_id is not None else ""
        except (KeyError, ValueError):
            return ""

    def begin_drain(self) -> None:
        if not self.draining:
            log.info("draining: refusing new requests, finishing %d in flight",
                     self.engine.n_in_flight if self.engine else 0)
        self.draining = True
        if self.engine:
            self.engine.accepting = False

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the requests in flight; past it, end them: each open stream gets a final
        error event. True when everything finished in time."""
        self.begin_drain()
        if self.engine is None or await self.engine.wait_idle(timeout_s):
            return True
        log.warning("drain timed out after %.0f s; ending %d requests with an error", timeout_s,
                    self.engine.n_in_flight)
        await self.stop_engine()
        return False

    async def stop_engine(self) -> None:
        """Stop the engine: requests still in it end with a 503 'the server shut down' item."""
        if self.engine is None:
            return
        if isinstance(self.engine, ProcessEngineClient):
            own = self.core is not None and self.core.process is not None
            await self.engine.close(stop_core=own)
            if own:
                await asyncio.to_thread(self.core.process.stop)
        else:
            await self.engine.close()

    async def shutdown(self) -> None:
        await self.drain(self.settings.shutdown_timeout_s)
        await self.stop_engine()

    def _on_dead(self, reason: str) -> None:
        if self.on_engine_dead is not None:
            self.on_engine_dead(reason)

    # ---- metrics hooks (the engine layer knows nothing of HTTP statuses)
    def _on_token(self, st: RequestState, first: bool, now: float, queue_s: float | None) -> None:
        m = self.metrics
        if first:
            m.ttft.observe(now - st.arrival)
            if queue_s is not None:
                m.queue_time.observe(queue_s)
        else:
            m.itl.observe(now - st.last_token_at)

    def _on_end(self, st: RequestState, outcome) -> None:
        status, reason = outcome_labels(outcome)
        self.metrics.count_request(status, reason)
        self.metrics.latency.observe(time.monotonic() - st.arrival)

    # ---- state
    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.engine is not None and not self.engine.alive:
            return "failed"
        if self.engine is None or not self.engine.ready.is_set():
            return "loading"
        if self.engine.info.get("warmup_error"):
            return "failed"
        return "ready"

    @property
    def task(self) -> dict | None:
        """The checkpoint's fine-tuned task head ({kind, labels}), when it has one."""
        return self.engine.info.get("task") if self.engine else None

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

    def submit(self, plan: Plan) -> list[tuple[int, RequestState]]:
        """Admit every choice of the plan, or none: (choice index, request) pairs."""
        reqs: list[tuple[int, RequestState]] = []
        choices = plan.choices()
        try:
            self.engine.check_room(len(choices))
            for index, prompt, params in choices:
                st = self.engine.add(prompt.ids, params, top_n=plan.top_n,
                                     timeout_s=self.settings.request_timeout_s,
                                     prompt_logprobs=plan.prompt_logprobs, structured=plan.structured)
                reqs.append((index, st))
        except EngineError as e:
            for _, r in reqs:
                r.cancel()
            raise engine_error(e) from None
        return reqs


def engine_error(e: EngineError) -> ApiError:
    status = status_of(e.kind)
    return ApiError(status, e.message, headers={"Retry-After": "1"} if status == 429 else None)


async def get_service(request: Request) -> Service:
    """Dependency: the app's service (async: no thread-pool hop, app.guards.json_only)."""
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
