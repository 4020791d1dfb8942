"""Whether a compiled decode step pays on this machine (GPT_COMPILE=auto): its one-row step timed against the eager
one when it is installed, and whether its compile fits in memory before it starts.

    check_compile_memory(fp32_bytes, device, pending)  # before a compile (not a load): MemoryError if it won't fit
    timing = time_one_row(model, compiled, cache)     # interleaved, on a scratch one-slot cache
    timing.pays                                       # compiled <= KEEP_AT x eager: engine.runner keeps it

The compiled step is faster where a token's cost is PyTorch's per-op overhead (the bundled model: 2.3x in-process)
and on GPT-2 124M at 2 threads on an AVX-512 host (1.2-1.3x), not on an AVX2 host at 1 thread (docs/performance.md):
a rule by model size cannot tell those apart, a timing on the machine can. Both steps return logits (the compiled
draws are no slower than that), over the same keys, at the same length.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from engine.cuda_graphs import step_key
from engine.sizing import available_memory, gib
from model.gpt import GPT
from model.kv_cache import KVCache

# the compiled steps are kept when a one-row step takes at most this share of the eager one's time: below the
# timing's spread on a quiet 2-vCPU host (2-3%), and worth their memory (GPT-2 124M: +0.7 GB idle PSS)
KEEP_AT = 0.95
LENGTH = 200  # keys in the row when timed: a chat turn's context (the smallest context bucket, 256, holds it)
# a compile's memory beyond the serving process's own, by the model's weights in fp32: export, inductor's frozen
# and packed copies of them, its C++ compilers. Measured peaks of the server's processes over their resident
# memory before the compile: GPT-2 124M (0.5 GB of weights) +2.5 GB, the bundled model (21 MB) +0.85 GB
# (docs/performance.md); this bound: 3.0 and 1.1 GB
COMPILE_BASE = 1_000_000_000
COMPILE_PER_WEIGHT_BYTE = 4


class CompileMemoryError(MemoryError):
    """A compile that would not fit in the memory available (the engine then decodes eagerly, one log line)."""


def compile_memory(fp32_bytes: int) -> int:
    """Bytes a compile of a model with `fp32_bytes` of fp32 weights needs beyond the serving process."""
    return COMPILE_BASE + COMPILE_PER_WEIGHT_BYTE * fp32_bytes


def check_compile_memory(fp32_bytes: int, device: torch.device, pending: int = 0) -> None:
    """Raise CompileMemoryError where the compile would not fit: the memory available (a container's limit too:
    engine.sizing.available_memory) less `pending` bytes the process has taken but not yet touched (a KV cache
    made resident in the background) against `compile_memory`. A compile that runs out is killed with its server."""
    have, need = available_memory(device) - pending, compile_memory(fp32_bytes)
    if have < need:
        raise CompileMemoryError(f"its compile needs about {gib(need)}, {gib(max(have, 0))} available")


@dataclass(frozen=True)
class StepTiming:
    """Median milliseconds of one row's decode step, compiled and eager, timed interleaved at `length` keys."""

    compiled_ms: float
    eager_ms: float
    length: int

    @property
    def pays(self) -> bool:
        return self.compiled_ms <= KEEP_AT * self.eager_ms

    def as_dict(self) -> dict:
        return {**asdict(self), "kept": self.pays}


@torch.inference_mode()
def time_one_row(model: GPT, compiled, cache: KVCache, *, rounds: int = 5, steps: int = 4,
                 length: int = LENGTH) -> StepTiming:
    """Time `compiled` (engine.compiled_decode.CompiledDecode, its steps made) against `model.forward_cached` on a
    scratch one-slot cache shaped as `cache` (its decode attention too), `rounds` x `steps` steps each, alternating
    every `steps`; the live cache is not touched."""
    with torch.inference_mode(False):  # plain tensors, as the live cache's: the compiled decode attention is
        # specialised to them (an inference tensor compiled it again, at serve time)
        scratch = KVCache(model.config, 1, cache.max_len, dtype=cache.k[0].dtype, device=cache.device)
    scratch.decode_attention = cache.decode_attention
    length = min(length, cache.max_len - 1)
    scratch.advance([0], length)
    _, ctx = step_key(scratch, 1, compiled.buckets, compiled.contexts)
    fn = compiled.steps[1, ctx, None]
    token = torch.zeros(1, 1, dtype=torch.long, device=cache.device)
    # Step's inputs (engine.compiled_decode.Step): tokens, lengths, the draw's six (unread by a logits step: the live
    # sampler's, as replay passes them), then every layer's keys and values
    args = (token, scratch.lengths_t, *compiled.inputs(1)[2:8], *scratch.k, *scratch.v)

    def eager() -> None:
        model.forward_cached(token, scratch, range(1))
        scratch.truncate(0, length)

    def replay() -> None:
        fn(*args)  # writes the row's next keys, where the eager step wrote them; advances nothing

    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    eager(), replay()  # first calls: allocations, page faults
    for _ in range(rounds):
        for name, run in (("eager", eager), ("compiled", replay)):
            for _ in range(steps):
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    return StepTiming(round(statistics.median(times["compiled"]) * 1e3, 3),
                      round(statistics.median(times["eager"]) * 1e3, 3), length)
