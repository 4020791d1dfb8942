"""Decode steps replayed from CUDA graphs: the launch overhead of a small GPT's step disappears.

As in gpt-fast and vLLM, the model stays plain and this backend is swapped in at load time: each batch
bucket (1, 2, 4, 8, ... up to the cache's slots) gets one graph of `GPT.decode_static`, captured once
over static buffers (the input tokens, the KV cache, the cache's device lengths). A step copies its
tokens into the input buffer, replays the bucket's graph and advances the cache; rows past the live
ones compute garbage that nobody reads (their writes land where their slot's next token goes, and a
live or prefilling slot overwrites it before reading it).

`GraphedDecode.check` compares a replay with the eager step on the same state; the engine uses the graphs
only when they agree, and falls back to eager decoding otherwise.
"""

from __future__ import annotations

import torch

from model.gpt import GPT
from model.kv_cache import KVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


class GraphedDecode:
    def __init__(self, model: GPT, cache: KVCache, max_batch: int) -> None:
        if cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and its cache on a CUDA device")
        self.model, self.cache = model, cache
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.tokens = torch.zeros(max_batch, 1, dtype=torch.long, device=cache.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool = None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def capture_all(self) -> None:
        for b in reversed(self.buckets):  # largest first: the memory pool is sized once
            self._capture(b)

    def _capture(self, b: int) -> None:
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):  # warm-up runs allocate the workspaces the graph will reuse
            for _ in range(2):
                self.model.decode_static(self.tokens[:b], self.cache)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.outputs[b] = self.model.decode_static(self.tokens[:b], self.cache)
        self._pool = graph.pool()
        self.graphs[b] = graph

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, n: int) -> torch.Tensor:
        """Next-token logits (n, vocab) for slots 0..n-1 fed `tokens` (n,); advances the cache."""
        b = self.bucket(n)
        if b not in self.graphs:
            self._capture(b)
        self.tokens[:n, 0].copy_(tokens)
        self.graphs[b].replay()
        self.cache.advance(range(n), 1)
        return self.outputs[b][:n]

    @torch.inference_mode()
    def check(self, n: int, atol: float = 1e-2) -> bool:
        """A replay equals the eager step on the same cache state (the state is left as it was)."""
        b = self.bucket(n)
        eager = self.model.decode_static(self.tokens[:b], self.cache).float()
        if b not in self.graphs:
            self._capture(b)
        self.graphs[b].replay()
        return bool(torch.allclose(self.outputs[b].float(), eager, atol=atol, rtol=1e-2))
