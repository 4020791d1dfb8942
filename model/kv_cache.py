"""A preallocated KV cache of independent sequence slots.

Every layer's keys and values live in one tensor allocated once, shaped
[n_slots, n_head, max_len, head_dim]. A slot holds one sequence; slots fill to
different lengths, so a server can add a sequence to a free slot (prefill) or
drop one (reset) between decode steps without touching the others. Nothing is
concatenated or reallocated per step: new keys/values are written in place at
each slot's current length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import GPTConfig


class ContextLengthError(ValueError):
    """A sequence would grow past the cache's (or the model's) context length."""


class KVCache:
    def __init__(
        self,
        config: GPTConfig,
        n_slots: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        max_len = config.block_size if max_len is None else max_len
        if not 0 < max_len <= config.block_size:
            raise ContextLengthError(f"cache max_len {max_len} must be in 1..block_size ({config.block_size})")
        if n_slots <= 0:
            raise ValueError(f"n_slots must be positive, got {n_slots}")
        self.n_slots, self.max_len = n_slots, max_len
        shape = (n_slots, config.n_head, max_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        # Tokens held per slot. Plain ints: the scheduler reads them every step and
        # they must not force a device sync.
        self.lengths = [0] * n_slots

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self, slot: int) -> None:
        """Free a slot. Old keys stay in memory but are masked out by the length."""
        self.lengths[slot] = 0

    def check_room(self, slot: int, n_new: int) -> None:
        if self.lengths[slot] + n_new > self.max_len:
            raise ContextLengthError(
                f"slot {slot} holds {self.lengths[slot]} tokens; {n_new} more exceed the context length {self.max_len}"
            )

    def plan(self, slots: list[int], n_tokens: int) -> CacheStep:
        """Index tensors for writing `n_tokens` new tokens into each of `slots` and attending over them."""
        for s in slots:
            self.check_room(s, n_tokens)
        device = self.device
        starts = torch.tensor([self.lengths[s] for s in slots], dtype=torch.long)
        positions = starts[:, None] + torch.arange(n_tokens)[None, :]  # (B, T)
        kv_len = max(self.lengths[s] for s in slots) + n_tokens
        # key j is visible to the query at position p iff j <= p (causal, and masks stale/unused entries)
        mask = torch.arange(kv_len)[None, None, :] <= positions[:, :, None]  # (B, T, S)
        first = slots[0]
        contiguous = slots == list(range(first, first + len(slots)))
        return CacheStep(
            slot_index=torch.tensor(slots, dtype=torch.long, device=device),
            # contiguous slots are read as a view; others need a gather (a copy)
            slot_range=slice(first, first + len(slots)) if contiguous else None,
            positions=positions.to(device),
            mask=mask[:, None].to(device),  # (B, 1, T, S) broadcast over heads
            kv_len=kv_len,
        )

    def advance(self, slots: list[int], n_tokens: int) -> None:
        for s in slots:
            self.lengths[s] += n_tokens


@dataclass
class CacheStep:
    """Where one forward pass writes and reads in the cache (shared by all layers)."""

    slot_index: torch.Tensor  # (B,) slot of each batch row
    slot_range: slice | None  # the same as a slice when the slots are contiguous
    positions: torch.Tensor  # (B, T) absolute position of each new token
    mask: torch.Tensor  # (B, 1, T, S) bool attention mask over the first S cache entries
    kv_len: int  # S

    def update(self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, H, T, D) in place and return the keys/values to attend over (B, H, S, D)."""
        rows = self.slot_index[:, None]  # (B, 1) broadcast against positions (B, T)
        # advanced indices on dims 0 and 2 → the indexed view is (B, T, H, D)
        cache_k[rows, :, self.positions] = k.transpose(1, 2)
        cache_v[rows, :, self.positions] = v.transpose(1, 2)
        if self.slot_range is not None:
            return cache_k[self.slot_range, :, : self.kv_len], cache_v[self.slot_range, :, : self.kv_len]
        return cache_k[self.slot_index, :, : self.kv_len], cache_v[self.slot_index, :, : self.kv_len]
