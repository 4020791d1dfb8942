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
        self._arange = torch.arange(max_len, device=device)  # positions are views of this

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
        """Index tensors for writing `n_tokens` new tokens into each of `slots` and attending over them.

        The common cases need no mask: slots that all hold the same number of tokens decode one token
        each (every cached key is visible) or prefill from empty (plain causal attention). Slots of
        equal length are written with a slice instead of a scatter. A mask is built only when the
        slots' lengths differ or a chunk of several tokens continues a partly filled slot.
        """
        for s in slots:
            self.check_room(s, n_tokens)
        device = self.device
        lengths = [self.lengths[s] for s in slots]
        first = slots[0]
        contiguous = slots == list(range(first, first + len(slots)))
        kv_len = max(lengths) + n_tokens
        slot_index = torch.tensor(slots, dtype=torch.long, device=device)
        slot_range = slice(first, first + len(slots)) if contiguous else None  # a view; others need a gather
        start = lengths[0]
        uniform = all(n == start for n in lengths)
        if uniform and (n_tokens == 1 or start == 0):
            positions = self._arange[start:start + n_tokens].expand(len(slots), n_tokens)
            return CacheStep(slot_index, slot_range, positions, None, kv_len, start=start, is_causal=n_tokens > 1)
        starts = torch.tensor(lengths, dtype=torch.long)
        positions = starts[:, None] + torch.arange(n_tokens)[None, :]  # (B, T)
        # key j is visible to the query at position p iff j <= p (causal, and masks stale/unused entries)
        mask = torch.arange(kv_len)[None, None, :] <= positions[:, :, None]  # (B, T, S)
        return CacheStep(slot_index, slot_range, positions.to(device), mask[:, None].to(device), kv_len,
                         start=start if uniform else None)

    def advance(self, slots: list[int], n_tokens: int) -> None:
        for s in slots:
            self.lengths[s] += n_tokens


@dataclass
class CacheStep:
    """Where one forward pass writes and reads in the cache (shared by all layers)."""

    slot_index: torch.Tensor  # (B,) slot of each batch row
    slot_range: slice | None  # the same as a slice when the slots are contiguous
    positions: torch.Tensor  # (B, T) absolute position of each new token
    mask: torch.Tensor | None  # (B, 1, T, S) bool attention mask over the first S cache entries; None: not needed
    kv_len: int  # S
    start: int | None = None  # the length every slot holds before this step, when they all hold the same
    is_causal: bool = False  # no mask, plain causal attention (T new tokens into empty slots, S == T)

    def update(self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, H, T, D) in place and return the keys/values to attend over (B, H, S, D)."""
        if self.start is not None:  # every row writes the same positions: a slice
            cols = slice(self.start, self.start + k.size(2))
            if self.slot_range is not None:
                cache_k[self.slot_range, :, cols] = k
                cache_v[self.slot_range, :, cols] = v
            else:
                cache_k[self.slot_index, :, cols] = k
                cache_v[self.slot_index, :, cols] = v
        else:
            rows = self.slot_index[:, None]  # (B, 1) broadcast against positions (B, T)
            # advanced indices on dims 0 and 2 → the indexed view is (B, T, H, D)
            cache_k[rows, :, self.positions] = k.transpose(1, 2)
            cache_v[rows, :, self.positions] = v.transpose(1, 2)
        if self.slot_range is not None:
            return cache_k[self.slot_range, :, : self.kv_len], cache_v[self.slot_range, :, : self.kv_len]
        return cache_k[self.slot_index, :, : self.kv_len], cache_v[self.slot_index, :, : self.kv_len]
