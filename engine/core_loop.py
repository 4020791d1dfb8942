"""The engine core's busy loop, the same whether it runs in its own process or in a thread of the server
(vLLM V1's `EngineCoreProc.run_busy_loop`): take every message waiting (add, abort, classify, ...), run one
`EngineCore.step`, send each front the step's outputs for its requests in one message (held and merged with the
next steps' for up to the stream interval, engine/stream_interval.py); block on the transport only while there is
nothing to compute.

A transport has `recv(timeout) -> [(client, message)]` and `send(client, message)`; `engine/client.py`
has the in-process one (a queue and the event loop's call_soon_threadsafe), `engine/core_process.py`
the ZMQ one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine.core import EngineCore
from engine.request import ErrorKind, RequestOutput
from engine.stream_interval import DEFAULT_MS, StreamInterval
from engine.wire import Abort, Add, Classified, Classify, Hello, Outputs, Pause, Ready, Shutdown

log = logging.getLogger("engine")

IDLE_WAIT_S = 1.0  # nothing to compute: block on the transport this long at most (deadlines are checked after)
PAUSED_WAIT_S = 0.02


class DeviceFailed(RuntimeError):
    """The device failed for good in a step (engine.core.is_fatal_device_error): the loop ends with it, after
    sending that step's outputs, so the process exits and its fronts fail what is still open."""


class CoreLoop:
    def __init__(self, core: EngineCore, transport, *, info: dict[str, Any] | None = None,
                 classify: Callable[[list], list[dict[str, float]]] | None = None, warmup: bool = True,
                 stream_interval_s: float = DEFAULT_MS / 1000) -> None:
        self.core, self.transport = core, transport
        self.interval = StreamInterval(stream_interval_s)  # running requests' tokens: sent at most this often
        self.info = dict(info or {})
        self.classify = classify
        self.warmup = warmup
        self.owners: dict[str, Any] = {}  # request id → the client (front) that sent it
        self.clients: set = set()
        self.seen: dict[Any, tuple] = {}  # client → the (running, queued) counts its last message carried
        self.warm = False
        self.paused = False
        self.stopping = False

    def run(self) -> None:
        if self.warmup:
            self.core.warmup()
        self.info.update(warmup_error=self.core.warmup_error, **self.core.stats())
        self.warm = True
        for c in self.clients:
            self.transport.send(c, Ready(self.info))
        core = self.core
        while not self.stopping:
            busy = core.has_work() and not self.paused
            msgs = self.transport.recv(0.0 if busy else (PAUSED_WAIT_S if self.paused else IDLE_WAIT_S))
            for client, msg in msgs:
                self.handle(client, msg)
            if self.stopping:
                break
            if core.has_work() and not self.paused:
                outputs = core.step()
                self.deliver(self.interval.take(outputs, flush=not core.has_work() or core.fatal_error is not None))
                if core.fatal_error is not None:
                    raise DeviceFailed(core.fatal_error)
            elif msgs or core.has_work():  # aborts changed the counts, or deadlines passed while paused
                self.deliver(self.interval.take(core.expire(), flush=True), always=True)
            elif core.poll_compiled():  # the compile finished while idle: /info says so now, not at the next request
                self.deliver([], always=True)
        self.deliver(self.interval.take(core.shutdown(), flush=True), always=True)

    def handle(self, client, msg) -> None:
        if isinstance(msg, Add):
            try:
                self.core.add(msg.request)
            except ValueError as e:
                self.transport.send(client, Outputs([RequestOutput(msg.request.request_id, [], [],
                                                                    error=ErrorKind.INVALID, message=str(e))],
                                                    self.core.stats()))
                return
            self.owners[msg.request.request_id] = client
        elif isinstance(msg, Abort):
            self.core.abort(msg.request_ids)
            self.interval.drop(msg.request_ids)
            for rid in msg.request_ids:
                self.owners.pop(rid, None)
        elif isinstance(msg, Hello):
            self.clients.add(client)
            if self.warm:
                self.transport.send(client, Ready(self.info))
        elif isinstance(msg, Classify):
            self.transport.send(client, self._classify(msg))
        elif isinstance(msg, Pause):
            self.paused = msg.paused
        elif isinstance(msg, Shutdown):
            self.stopping = True

    def deliver(self, outputs: list[RequestOutput], always: bool = False) -> None:
        """One message per front: its requests' outputs and the core's stats. A front with no outputs this step
        still gets the stats when the running / queued counts moved since its last message: its /info and
        /metrics (gpt_batch_size, gpt_queue_size) read them, and with several fronts the step that empties the
        batch may carry outputs for another front only."""
        by_client: dict[Any, list[RequestOutput]] = {}
        for out in outputs:
            client = self.owners.get(out.request_id)
            if client is None:
                continue
            by_client.setdefault(client, []).append(out)
            if out.done:
                del self.owners[out.request_id]
        stats = self.core.stats()
        counts = (stats.get("running"), stats.get("queued"))
        for client in self.clients | by_client.keys():
            if client in by_client or always or self.seen.get(client) != counts:
                self.transport.send(client, Outputs(by_client.get(client, []), stats))
                self.seen[client] = counts

    def _classify(self, msg: Classify) -> Classified:
        if self.classify is None:
            return Classified(msg.call_id, error="this checkpoint has no task head", error_kind="invalid")
        try:
            return Classified(msg.call_id, result=self.classify(msg.items))
        except ValueError as e:  # TaskError: a bad item
            return Classified(msg.call_id, error=str(e), error_kind="invalid")
        except Exception as e:  # noqa: BLE001 - a failing forward must not end the core
            log.exception("classify failed")
            return Classified(msg.call_id, error=f"classification failed: {type(e).__name__}: {e}", error_kind="failed")
