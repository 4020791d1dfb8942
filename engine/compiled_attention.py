"""The compiled decode attention of a CPU's KV cache (model.decode_attention: one token a row, at every batch), built
in the background.

`torch.compile` of the attention takes seconds (a restart ~1-2 s from inductor's cache on disk), so, like the
compiled decode steps (engine.compiled_decode), it runs in a thread at idle priority while the engine serves with
its per-row SDPA calls, and the engine hands the result to its cache at a step boundary (ModelRunner.poll_compiled).
A compile that fails leaves SDPA in place, with one log line.
"""

from __future__ import annotations

import torch

from engine.compiled_decode import COMPILE_LOCK
from engine.idle_job import IdleJob
from model import decode_attention
from model.kv_cache import KVCache


def wanted(cache: KVCache, mode: str) -> bool:
    """Whether this cache's decode attention is compiled: a cache on a CPU in 16 bits or fp32, unless compiling is
    off."""
    return mode != "off" and cache.device.type == "cpu" and cache.k[0].element_size() in (2, 4)


class AttentionBuild(IdleJob):
    """One background compile of `model.decode_attention` for `cache`, after the decode steps' compile if one runs
    (COMPILE_LOCK: dynamo traces one thing at a time): `fn` once done, else `error`."""

    name = "compile-attention"

    def __init__(self, cache: KVCache, q_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(lock=COMPILE_LOCK)
        self.cache, self.q_dtype = cache, q_dtype  # the model's: its queries' dtype (the loops are built for it)

    def work(self):
        return decode_attention.build(self.cache.k[0], self.q_dtype)

    @property
    def fn(self):
        return self.result
