"""The compiled decode attention of a CPU's KV cache (model.decode_attention: a 16-bit cache at every batch, an fp32
one from two rows), built in the background.

`torch.compile` of the attention takes seconds (a restart ~1-2 s from inductor's cache on disk), so, like the
compiled decode steps (engine.compiled_decode), it runs in a thread at idle priority while the engine serves with
its per-row SDPA calls, and the engine hands the result to its cache at a step boundary (ModelRunner.poll_compiled).
A compile that fails leaves SDPA in place, with one log line.
"""

from __future__ import annotations

import threading
import time

from engine.compiled_decode import COMPILE_LOCK, idle_priority, one_line
from model import decode_attention
from model.kv_cache import KVCache


def wanted(cache: KVCache, mode: str) -> bool:
    """Whether this cache's decode attention is compiled: a cache on a CPU in 16 bits or fp32 (KVCache.plan uses it
    for fp32 from two rows), unless compiling is off."""
    return mode != "off" and cache.device.type == "cpu" and cache.k[0].element_size() in (2, 4)


class AttentionBuild:
    """One background compile of `model.decode_attention` for `cache`: `fn` once done, else `error`."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.fn = None
        self.error: str | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name="compile-attention", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        idle_priority()
        with COMPILE_LOCK:  # after the decode steps' compile, if one runs (dynamo traces one thing at a time)
            t0 = time.perf_counter()
            try:
                self.fn = decode_attention.build(self.cache.k[0])
            except Exception as e:  # noqa: BLE001 - a failed compile costs speed, never the engine
                self.error = one_line(e)
            self.seconds = round(time.perf_counter() - t0, 2)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive() and self._thread.ident is not None

    def wait(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return self.done
