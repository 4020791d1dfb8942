"""One piece of start-up work in a background thread at idle priority (engine.compiled_decode.idle_priority): the
engine serves meanwhile and picks the result up at a step boundary. The compiled decode attention
(engine/compiled_attention.py) and the KV cache's pages (engine/cache_pages.py) are such jobs."""

from __future__ import annotations

import contextlib
import threading
import time

from engine.compiled_decode import idle_priority, one_line


class IdleJob:
    """`work()` run once in a daemon thread at idle priority, under `lock` if given: its return value in `result`
    and how long it took in `seconds` once `done`; an exception of the kinds in `errors` becomes `error`, one line
    (a failed job costs speed, never the engine)."""

    name = "idle-job"
    errors: tuple[type[BaseException], ...] = (Exception,)

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.lock = lock
        self.result = None
        self.error: str | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def work(self):
        raise NotImplementedError

    def failed(self) -> None:
        """Called in the thread after `error` is set (a subclass's log line)."""

    def start(self):
        self._thread.start()
        return self

    def _run(self) -> None:
        idle_priority()
        with self.lock or contextlib.nullcontext():
            t0 = time.perf_counter()
            try:
                self.result = self.work()
            except self.errors as e:
                self.error = one_line(e)
                self.failed()
            self.seconds = round(time.perf_counter() - t0, 2)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive() and self._thread.ident is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the job has ended (done or failed) within `timeout`."""
        self._thread.join(timeout)
        return self.done
