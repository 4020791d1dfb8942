"""The KV cache's pages made resident in the background, once the engine has started on a lazily allocated cache.

A CPU server allocates its cache on untouched zero pages (model.zero_pages): writing GPT-2 124M's 2.4 GB of zeros
was 0.7-0.85 s of its start. This thread faults them in afterwards at idle priority (CPU time that loading and
serving leave), without writing anything a step has written meanwhile; the engine serves from the first moment,
reads of pages not yet resident go through the kernel's zero page. A kernel that refuses leaves the cache lazy
(correct, slower to decode), with one log line.
"""

from __future__ import annotations

import logging

from engine.idle_job import IdleJob
from model.kv_cache import KVCache

log = logging.getLogger(__name__)


class ResidentFill(IdleJob):
    """One background `KVCache.make_resident`: `seconds` once done, else `error` (and a warning)."""

    name = "kv-cache-pages"
    errors = (OSError,)

    def __init__(self, cache: KVCache) -> None:
        super().__init__()
        self.cache = cache

    def work(self) -> None:
        self.cache.make_resident()

    def failed(self) -> None:
        log.warning("the KV cache stays lazily allocated (decodes slower): %s", self.error)
