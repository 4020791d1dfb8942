"""Decode steps replayed from CUDA graphs: the launch overhead of a small GPT's step disappears.

As in gpt-fast and vLLM, the model stays plain and this backend is swapped in at load time: each
(batch, context) bucket gets one graph of `GPT.decode_static`, captured once over static buffers (the
input tokens, the KV cache, the cache's device lengths). Batch buckets are 1, 2, 4, 8, ... up to the
cache's slots; context buckets are 256, 512, 1024, ... up to its max_len: a step replays the graph of the
smallest context that holds its longest row, so a batch of short sequences attends over 256 keys, not
the whole cache (a graph over `max_len` keys alone made a step at short contexts slower than an eager one,
which reads only the live keys). A step copies its tokens into the input buffer, replays the bucket's graph
and advances the cache; rows past the live ones compute garbage that nobody reads (their writes land where
their slot's next token goes, and a live or prefilling slot overwrites it before reading it; a full slot's
write is clamped to its last entry, which prefix reuse never reads: `KVCache.plan_static`).

Capturing is the one CUDA-only part, and it is injectable: `capture(step)` gets the step as a function of
nothing and returns its replay. `CudaGraphCapture` records the step into a CUDA graph; `eager_capture`
runs it eagerly, so the CPU test suite drives warm-up, capture of every bucket and replays through the
same code (tests/test_cuda_graphs.py).

`GraphedDecode.check` compares a replay with the eager step on the same state; the engine uses the graphs
only when they agree, and falls back to eager decoding otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.config import ContextLengthError
from model.gpt import GPT
from model.kv_cache import KVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
CONTEXT_BUCKETS = tuple(256 << i for i in range(10))  # 256 .. 128K keys; the cache's max_len is always one

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Replay], Replay]


class CudaGraphCapture:
    """Records a step into a CUDA graph (after two warm-up runs on a side stream, which allocate the workspaces
    the graph reuses); its replay returns the graph's static output. Graphs share one memory pool: captured
    largest first, the pool is sized once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None

    def __call__(self, step: Replay) -> Replay:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


def eager_capture(step: Replay) -> Replay:
    """The stand-in without CUDA: 'capturing' runs the step once (as CudaGraphCapture's warm-up runs do), a replay
    runs it again."""
    step()
    return step


def context_buckets(max_len: int, sizes=CONTEXT_BUCKETS) -> list[int]:
    return sorted({c for c in sizes if c < max_len} | {max_len})


def step_key(cache: KVCache, n: int, buckets: list[int], contexts: list[int]) -> tuple[int, int]:
    """The (batch, context) bucket of a static decode step over slots 0..n-1: the context holds the longest row's
    keys after this step's token. A row with no room is a caller's error (ContextLengthError), never an index past
    the cache (on CUDA a device-side assert that poisons the context)."""
    longest = max(cache.lengths[:n])  # host ints: no sync
    if longest >= cache.max_len:
        raise ContextLengthError(f"a decode step at position {longest} does not fit the cache's context length "
                                 f"{cache.max_len}")
    return next(b for b in buckets if b >= n), next(c for c in contexts if c >= longest + 1)


class GraphedDecode:
    def __init__(self, model: GPT, cache: KVCache, max_batch: int, *, capture: Capture | None = None,
                 contexts=CONTEXT_BUCKETS) -> None:
        if capture is None:
            if cache.device.type != "cuda":
                raise ValueError("CUDA graphs need the model and its cache on a CUDA device")
            capture = CudaGraphCapture(cache.device)
        self.model, self.cache, self.capture = model, cache, capture
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.max_batch = max_batch
        self.contexts = context_buckets(cache.max_len, contexts)
        self.tokens = torch.zeros(max_batch, 1, dtype=torch.long, device=cache.device)
        self.replays: dict[tuple[int, int], Replay] = {}

    def key(self, n: int) -> tuple[int, int]:
        return step_key(self.cache, n, self.buckets, self.contexts)

    @torch.inference_mode()
    def capture_all(self) -> None:
        for b in reversed(self.buckets):  # largest first: the memory pool is sized once
            for c in reversed(self.contexts):
                self._capture(b, c)

    def _step(self, b: int, c: int) -> Replay:
        return lambda: self.model.decode_static(self.tokens[:b], self.cache, kv_len=c)

    def _capture(self, b: int, c: int) -> Replay:
        replay = self.replays[b, c] = self.capture(self._step(b, c))
        return replay

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, n: int) -> torch.Tensor:
        """Next-token logits (n, vocab) for slots 0..n-1 fed `tokens` (n,); advances the cache."""
        key = self.key(n)
        replay = self.replays.get(key) or self._capture(*key)
        self.tokens[:n, 0].copy_(tokens)
        out = replay()
        self.cache.advance(range(n), 1)
        return out[:n]

    @torch.inference_mode()
    def check(self, n: int, atol: float = 1e-2) -> bool:
        """A replay equals the eager step on the same cache state (the state is left as it was)."""
        b, c = key = self.key(n)
        eager = self._step(b, c)().float()
        replay = self.replays.get(key) or self._capture(*key)
        return bool(torch.allclose(replay().float(), eager, atol=atol, rtol=1e-2))
