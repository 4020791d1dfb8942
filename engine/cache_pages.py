"""The KV cache's pages made resident in the background, once the engine has started on a lazily allocated cache.

A CPU server allocates its cache on untouched zero pages (model.zero_pages): writing GPT-2 124M's 2.4 GB of zeros
was 0.7-0.85 s of its start. This thread faults them in afterwards at idle priority (CPU time that loading and
serving leave), without writing anything a step has written meanwhile; the engine serves from the first moment,
reads of pages not yet resident go through the kernel's zero page. A kernel that refuses leaves the cache lazy
(correct, slower to decode), with one log line.
"""

from __future__ import annotations

import logging
import threading
import time

from engine.compiled_decode import idle_priority, one_line
from model.kv_cache import KVCache

log = logging.getLogger(__name__)


class ResidentFill:
    """One background `KVCache.make_resident`: `seconds` once done, else `error`."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.seconds: float | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="kv-cache-pages", daemon=True)

    def start(self) -> ResidentFill:
        self._thread.start()
        return self

    def _run(self) -> None:
        idle_priority()
        t0 = time.perf_counter()
        try:
            self.cache.make_resident()
        except OSError as e:
            self.error = one_line(e)
            log.warning("the KV cache stays lazily allocated (decodes slower): %s", self.error)
        self.seconds = round(time.perf_counter() - t0, 2)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the fill has ended (done or failed) within `timeout`."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
