"""The front's handle on the engine core, wherever the core runs (vLLM V1's `core_client.py`).

- `ProcessEngineClient`: the core in its own process (`engine/core_process.py`), reached over a ZMQ DEALER
  socket; one MessagePack frame per engine step comes back. The server's default.
- `ThreadEngineClient`: the same core loop in a thread of this process (GPT_ENGINE=thread): for tests that reach
  into the model, and for debugging. Same core, same loop, same messages; only the transport differs.

Both do the front's part and nothing else: admission (a request beyond the slots plus the queue is refused with
`ErrorKind.OVERLOADED`), request ids, the output processor (detokenizing, stop strings → abort in the core), the
core's readiness and stats, and noticing that the core died (every open request then gets a final `Failed`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from engine.output_processor import OutputProcessor, RequestState
from engine.params import SamplingParams
from engine.request import EngineRequest, ErrorKind, StructuredSpec
from engine.stream_interval import DEFAULT_MS
from engine.wire import (
    Abort,
    Add,
    Classified,
    Classify,
    Hello,
    Outputs,
    Pause,
    Ready,
    Shutdown,
    decode_to_front,
    encode,
)
from model.tokenizer import Tokenizer

log = logging.getLogger("engine")


class EngineError(Exception):
    """A request the engine will not take, or a call it could not answer; `kind` decides the HTTP status."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


class EngineClient:
    def __init__(self, tokenizer: Tokenizer, *, capacity: int, name: str = "0",
                 on_token: Callable | None = None, on_end: Callable | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.processor = OutputProcessor(tokenizer, on_token, on_end)
        self.capacity = capacity  # requests this front holds at once: slots + queue (divided among the fronts)
        self.name = name
        self.accepting = True
        self.info: dict[str, Any] = {}  # the core's Ready: device, dtype, slots, warmup_error, ...
        self.ready = threading.Event()
        self.dead: str | None = None  # why the core is gone
        self.stats: dict[str, Any] = {}  # the core's, as of its last message
        self.on_dead = on_dead
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._idle: asyncio.Event | None = None

    # ------------------------------------------------------------------ requests
    def add(self, prompt: list[int], params: SamplingParams, *, top_n: int = 0,
            timeout_s: float = 300.0, prompt_logprobs: int | None = None,
            structured: StructuredSpec | None = None) -> RequestState:
        self.check_room(1)
        st = RequestState(f"{self.name}-{next(self._ids)}", prompt, params, self.processor.tokenizer,
                          top_n=top_n, timeout_s=timeout_s, abort=self.abort, prompt_logprobs=prompt_logprobs)
        self.processor.add(st)
        self._send(Add(EngineRequest(st.id, st.prompt, params, top_n=top_n, arrival=st.arrival, deadline=st.deadline,
                                     prompt_logprobs=prompt_logprobs, structured=structured)))
        return st

    def check_room(self, n: int) -> None:
        """Refuse (EngineError) unless `n` more requests can be added now. A request of several choices checks
        them all before adding any, so a refusal never admits (and then cancels, counted as cancelled) a part."""
        if self.dead is not None:
            raise EngineError(ErrorKind.UNAVAILABLE, f"the generation engine has stopped: {self.dead}")
        if not self.accepting:
            raise EngineError(ErrorKind.UNAVAILABLE, "the server is shutting down and accepts no new requests")
        if len(self.processor) + n > self.capacity:
            raise EngineError(ErrorKind.OVERLOADED, f"the server is overloaded: {len(self.processor)} requests are "
                                                    "running or waiting; retry later")

    def abort(self, request_id: str) -> None:
        if self.processor.drop(request_id) is not None and self.dead is None:
            self._send(Abort([request_id]))
        self._check_idle()

    async def classify(self, items: list) -> list[dict[str, float]]:
        """Label probabilities from the checkpoint's task head, computed by the core between two steps."""
        if self.dead is not None:
            raise EngineError(ErrorKind.UNAVAILABLE, f"the generation engine has stopped: {self.dead}")
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send(Classify(call_id, items))
        return await fut

    def pause(self, paused: bool = True) -> None:
        """Test hook: hold admission and decoding in the core (deadlines are still enforced)."""
        self._send(Pause(paused))

    def resume(self) -> None:
        self.pause(False)

    # ------------------------------------------------------------------ state
    @property
    def n_in_flight(self) -> int:
        return len(self.processor)

    @property
    def n_running(self) -> int:
        return self.stats.get("running", 0)

    @property
    def n_queued(self) -> int:
        return self.stats.get("queued", 0)

    @property
    def alive(self) -> bool:
        return self.dead is None

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until this front has no request in flight; False past `timeout`."""
        if not len(self.processor):
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._idle = None

    def _check_idle(self) -> None:
        if self._idle is not None and not len(self.processor):
            self._idle.set()

    # ------------------------------------------------------------------ from the core
    def _on_message(self, msg) -> None:
        if isinstance(msg, Outputs):
            self.stats = msg.stats
            stopped = self.processor.process(msg.outputs)
            if stopped:
                self._send(Abort(stopped))
            self._check_idle()
        elif isinstance(msg, Ready):
            self.info = msg.info
            self.stats = {k: msg.info[k] for k in ("running", "queued") if k in msg.info}
            self.ready.set()
        elif isinstance(msg, Classified):
            fut = self._calls.pop(msg.call_id, None)
            if fut is None or fut.done():
                return
            if msg.error is None:
                fut.set_result(msg.result)
            else:
                kind = ErrorKind.INVALID if msg.error_kind == "invalid" else ErrorKind.FAILED
                fut.set_exception(EngineError(kind, msg.error))

    def _core_gone(self, reason: str) -> None:
        """The core stopped for good: every open request and call gets its final error now."""
        if self.dead is not None:
            return
        self.dead = reason
        log.error("the engine core is gone: %s", reason)
        self.processor.fail_all(ErrorKind.UNAVAILABLE, f"the generation engine stopped: {reason}")
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineError(ErrorKind.UNAVAILABLE, f"the generation engine stopped: {reason}"))
        self._calls.clear()
        self._check_idle()
        if self.on_dead is not None:
            self.on_dead(reason)

    # ------------------------------------------------------------------ transport
    def _send(self, msg) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self, timeout: float = 10.0) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------- in-process
class _ThreadTransport:
    """The core loop's transport when it runs in a thread: a queue in, the event loop's call_soon_threadsafe out
    (one wake-up of the event loop per step)."""

    def __init__(self, inbox: queue.Queue, loop: asyncio.AbstractEventLoop, deliver: Callable) -> None:
        self.inbox, self.loop, self.deliver = inbox, loop, deliver

    def recv(self, timeout: float) -> list:
        msgs = []
        try:
            msgs.append(self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait())
        except queue.Empty:
            return msgs
        while True:
            try:
                msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                return msgs

    def send(self, client, msg) -> None:
        try:
            self.loop.call_soon_threadsafe(self.deliver, msg)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class ThreadEngineClient(EngineClient):
    """The core loop on a thread of this process (`core`, `info`, `classify` from engine.build.build_core)."""

    def __init__(self, core, tokenizer: Tokenizer, *, info: dict | None = None, classify=None, warmup: bool = True,
                 stream_interval_s: float = DEFAULT_MS / 1000, **kw) -> None:
        super().__init__(tokenizer, **kw)
        self.core = core
        self._inbox: queue.Queue = queue.Queue()
        self._loop_args = dict(info=info, classify=classify, warmup=warmup, stream_interval_s=stream_interval_s)
        self._thread: threading.Thread | None = None
        self._closing = False

    @property
    def model(self):
        return self.core.model

    def _send(self, msg) -> None:
        self._inbox.put((0, msg))

    async def start(self) -> None:
        from engine.core_loop import CoreLoop  # here: a front whose core is another process never loads torch

        loop = asyncio.get_running_loop()
        self.core_loop = CoreLoop(self.core, _ThreadTransport(self._inbox, loop, self._on_message), **self._loop_args)
        self._send(Hello())
        self._thread = threading.Thread(target=self._run, args=(loop,), name="gpt-engine", daemon=True)
        self._thread.start()

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        reason = "the engine thread exited"
        try:
            self.core_loop.run()
        except BaseException as e:  # noqa: BLE001
            log.exception("the engine thread failed")
            reason = f"the engine thread failed: {type(e).__name__}: {e}"
        if not self._closing:
            try:
                loop.call_soon_threadsafe(self._core_gone, reason)
            except RuntimeError:
                pass

    async def close(self, timeout: float = 10.0) -> None:
        """Stop the core loop; requests still in it end with a SHUTDOWN error."""
        self._closing = True
        self.accepting = False
        self._send(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        await asyncio.sleep(0)  # deliver the loop's last message
        self.processor.fail_all(ErrorKind.SHUTDOWN, "the server shut down before the request finished")


# ---------------------------------------------------------------------------------------------- core process
class ProcessEngineClient(EngineClient):
    """A front of the core process: a DEALER socket to its ROUTER, and the core's pid to notice its death."""

    def __init__(self, address: str, core_pid: int, tokenizer: Tokenizer, **kw) -> None:
        super().__init__(tokenizer, **kw)
        self.address, self.core_pid = address, core_pid
        self._sock = None
        self._ctx = None
        self._reader: asyncio.Task | None = None
        self._pidfd: int | None = None
        self._closing = False

    def _send(self, msg) -> None:
        if self._sock is not None:
            self._sock.send(encode(msg))  # a DEALER never blocks below its high-water mark; returns a done future

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IDENTITY, f"front-{self.name}-{os.getpid()}".encode())
        self._sock.connect(self.address)
        self._reader = asyncio.create_task(self._read())
        loop = asyncio.get_running_loop()
        try:  # readable when the core process exits, whoever its parent is (Linux ≥ 5.3)
            self._pidfd = os.pidfd_open(self.core_pid)
            loop.add_reader(self._pidfd, self._on_core_exit)
        except (AttributeError, OSError):
            self._pidfd = None
            asyncio.create_task(self._poll_core())
        self._send(Hello())

    async def _read(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                msg = decode_to_front(frame)
            except Exception as e:  # noqa: BLE001
                log.error("dropped a malformed message from the engine core: %s", e)
                continue
            self._on_message(msg)

    def _on_core_exit(self) -> None:
        loop = asyncio.get_running_loop()
        if self._pidfd is not None:
            loop.remove_reader(self._pidfd)
        if not self._closing:
            loop.call_later(0.02, self._core_gone_now)  # let frames already in the socket arrive first

    def _core_gone_now(self) -> None:
        if not self._closing:
            self._core_gone(f"the engine core process (pid {self.core_pid}) exited")

    async def _poll_core(self) -> None:
        while not self._closing:
            try:
                os.kill(self.core_pid, 0)
            except ProcessLookupError:
                self._on_core_exit()
                return
            await asyncio.sleep(0.2)

    async def close(self, timeout: float = 10.0, stop_core: bool = False) -> None:
        """Disconnect (and with `stop_core`, tell the core to end its requests and exit)."""
        self._closing = True
        self.accepting = False
        if stop_core:
            self._send(Shutdown())
            await asyncio.sleep(0.05)
        if self._reader is not None:
            self._reader.cancel()
        if self._pidfd is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._pidfd)
            except (RuntimeError, ValueError):
                pass
            os.close(self._pidfd)
            self._pidfd = None
        self.processor.fail_all(ErrorKind.SHUTDOWN, "the server shut down before the request finished")
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
