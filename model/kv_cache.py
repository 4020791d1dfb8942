"""A preallocated KV cache of independent sequence slots.

Every layer's keys and values live in one tensor allocated once, shaped
[n_slots, n_head, max_len, head_dim]. A slot holds one sequence; slots fill to
different lengths, so a server can add a sequence to a free slot (prefill) or
drop one (reset) between decode steps without touching the others. Nothing is
concatenated or reallocated per step: new keys/values are written in place at
each slot's current length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import decode_attention, zero_pages
from model.config import ContextLengthError, GPTConfig


def device_index(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of `values` (host ints: slots, rows, token ids; or bools, floats with `dtype`) on `device` without
    waiting for it: on CUDA through pinned memory and an asynchronous copy (the caching host allocator keeps the
    pinned block until the copy is done; torch.tensor(..., device="cuda") copies from pageable memory and
    synchronizes the stream); on CPU torch.tensor. Every host → device copy of the engine goes through here."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class KVCache:
    def __init__(
        self,
        config: GPTConfig,
        n_slots: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        resident: bool = True,
    ) -> None:
        max_len = config.block_size if max_len is None else max_len
        if not 0 < max_len <= config.block_size:
            raise ContextLengthError(f"cache max_len {max_len} must be in 1..block_size ({config.block_size})")
        if n_slots <= 0:
            raise ValueError(f"n_slots must be positive, got {n_slots}")
        self.n_slots, self.max_len = n_slots, max_len
        shape = (n_slots, config.n_head, max_len, config.head_dim)
        # resident=False on a CPU: the cache lies on untouched zero pages (model.zero_pages), free until used, and
        # its owner makes it resident later (`make_resident`, in the background: engine.cache_pages), so a server
        # starts without writing gigabytes of zeros; a cache left untouched decodes slower (reads of unwritten
        # pages go through the kernel's zero page; docs/performance.md). Default: written at allocation.
        lazy = not resident and torch.device(device).type == "cpu" and zero_pages.supported()

        def zeros() -> torch.Tensor:
            return zero_pages.untouched_zeros(shape, dtype) if lazy else torch.zeros(shape, dtype=dtype, device=device)

        self.k = [zeros() for _ in range(config.n_layer)]
        self.v = [zeros() for _ in range(config.n_layer)]
        self.resident = not lazy
        # Tokens held per slot. Plain ints: the scheduler reads them every step and
        # they must not force a device sync. A device copy feeds positions and masks
        # when the slots of a step hold different lengths (no host→device copy per step).
        self.lengths = [0] * n_slots
        self.lengths_t = torch.zeros(n_slots, dtype=torch.long, device=device)
        self._arange = torch.arange(max(max_len, n_slots), device=device)  # positions are views of this
        # on a CPU: its decode steps' attention, compiled (model.decode_attention.build), once the engine has it
        # (one token a row, at every batch: `_loops`); None: SDPA
        self.decode_attention: Callable[..., torch.Tensor] | None = None
        decode_attention.register(self)  # where a compiled step's attention finds it (attend_as_eager)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def make_resident(self) -> None:
        """Fault in a lazily allocated cache's pages (seconds for gigabytes; safe while it is in use, from another
        thread: model.zero_pages). OSError if the kernel refuses (the cache then stays as it is, correct)."""
        if not self.resident:
            for t in self.k + self.v:
                zero_pages.make_resident(t)
            self.resident = True

    def reset(self, slot: int) -> None:
        """Free a slot. Old keys stay in memory but are masked out by the length."""
        self.lengths[slot] = 0
        self.lengths_t[slot] = 0

    def truncate(self, slot: int, n: int) -> None:
        """Keep the slot's first n entries (prefix caching reuses them); n = 0 is `reset`."""
        if not 0 <= n <= self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} tokens; cannot keep {n}")
        self.lengths[slot] = n
        self.lengths_t[slot] = n

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """dst holds src's first n entries, and nothing else (prefix caching: a copy instead of a prefill)."""
        if not 0 <= n <= self.lengths[src]:
            raise ValueError(f"slot {src} holds {self.lengths[src]} tokens; cannot copy {n}")
        for t in self.k + self.v:
            t[dst, :, :n] = t[src, :, :n]
        self.lengths[dst] = n
        self.lengths_t[dst] = n

    def move(self, src: list[int], dst: list[int]) -> None:
        """Move the sequences in slots `src` to slots `dst` (swaps work): a copy of what they hold, once.

        The server keeps its decoding slots contiguous this way, so every decode step reads the cache
        through views instead of gathering each layer's keys and values for the active slots.
        """
        n = max(self.lengths[s] for s in src)
        s_idx, d_idx = device_index(src, self.device), device_index(dst, self.device)
        if n:
            for t in self.k + self.v:
                t[d_idx, :, :n] = t[s_idx, :, :n]  # the right side is a gathered copy
        moved = [self.lengths[s] for s in src]
        for s in set(src) - set(dst):
            self.lengths[s] = 0
        for d, n_d in zip(dst, moved):
            self.lengths[d] = n_d
        self.lengths_t[d_idx] = self.lengths_t[s_idx]
        for s in set(src) - set(dst):
            self.lengths_t[s] = 0

    def check_room(self, slot: int, n_new: int) -> None:
        if self.lengths[slot] + n_new > self.max_len:
            raise ContextLengthError(
                f"slot {slot} holds {self.lengths[slot]} tokens; {n_new} more exceed the context length {self.max_len}"
            )

    def plan(self, slots: list[int] | range, n_tokens: int) -> CacheStep:
        """Index tensors for writing `n_tokens` new tokens into each of `slots` and attending over them.

        The common cases need no mask: slots that all hold the same number of tokens decode one token
        each (every cached key is visible) or prefill from empty (plain causal attention). Slots of
        equal length are written with a slice instead of a scatter. A mask is built only when the
        slots' lengths differ or a chunk of several tokens continues a partly filled slot.
        """
        for s in slots:
            self.check_room(s, n_tokens)
        B = len(slots)
        lengths = [self.lengths[s] for s in slots]
        first = slots[0]
        contiguous = (isinstance(slots, range) and slots.step == 1) or list(slots) == list(range(first, first + B))
        kv_len = max(lengths) + n_tokens
        if contiguous:  # a view; others need a gather (built from the list: only off the server's path)
            slot_range, slot_index = slice(first, first + B), self._arange[first:first + B]
        else:
            slot_range, slot_index = None, device_index(list(slots), self.device)
        start = lengths[0]
        uniform = all(n == start for n in lengths)
        loops = self._loops(n_tokens, contiguous)
        if uniform and (n_tokens == 1 or start == 0):
            positions = self._arange[start:start + n_tokens].expand(B, n_tokens)
        else:
            starts = self.lengths_t[slot_range] if slot_range is not None else self.lengths_t[slot_index]
            positions = starts[:, None] + self._arange[None, :n_tokens]  # (B, T)
        if loops is not None:  # whole blocks of keys, each row's visible ones counted (model.decode_attention)
            return CacheStep(slot_index, slot_range, positions, None, decode_attention.read_len(kv_len, self.max_len),
                             start=start if uniform else None, loops=loops, visible=positions[:, 0] + 1)
        if uniform and (n_tokens == 1 or start == 0):
            return CacheStep(slot_index, slot_range, positions, None, kv_len, start=start, is_causal=n_tokens > 1)
        # key j is visible to the query at position p iff j <= p (causal, and masks stale/unused entries)
        mask = self._arange[None, None, :kv_len] <= positions[:, :, None]  # (B, T, S)
        return CacheStep(slot_index, slot_range, positions, mask[:, None], kv_len,
                         start=start if uniform else None, row_kv=[n + n_tokens for n in lengths])

    def _loops(self, n_tokens: int, contiguous: bool) -> Callable[..., torch.Tensor] | None:
        """The compiled attention a step of `n_tokens` per row uses (model.decode_attention), else None: one token a
        row, rows in consecutive slots (the server's decoding rows are slots 0..n-1), one row as several. SDPA is
        faster for one row of an fp32 cache (GPT-2 int8 / fp32 one-row steps 3.8% / 2.1% faster), but it rounds that
        row unlike the loops that serve it batched, and int8 weights make such an ulp a whole quantization step: a
        4-layer GPT-2-width int8 model's seeded requests left their own batched tokens after 19-37 of 128
        (docs/performance.md; tests/test_decode_attention.py)."""
        if (self.decode_attention is None or n_tokens != 1 or not contiguous or self.device.type != "cpu"
                or torch.compiler.is_dynamo_compiling()):
            return None
        return self.decode_attention

    def plan_static(self, n_rows: int, kv_len: int | None = None, exact: bool = False,
                    n_tokens: int = 1) -> CacheStep:
        """`n_tokens` tokens for each of slots 0..n_rows-1 (several: a speculative verification pass, at the slot's
        next positions, each attending to the keys before it), with shapes that do not depend on what the slots hold:
        positions come from the device lengths and attention covers the first kv_len cache entries (default: the
        whole cache) under a mask. Nothing here reads the host, so a CUDA graph can capture the step once and
        replay it (engine.cuda_graphs picks kv_len per step: the context bucket that holds its longest live row).

        A position is clamped to max_len - 1: a live row never gets there (GraphedDecode.key refuses a row with no
        room), but a padding row may be a full idle slot, and its write would land past the cache (a device-side
        assert on CUDA). Clamped, it overwrites the slot's last entry, which prefix reuse never reads (it keeps at
        most a prompt's length - 1 entries)."""
        kv_len = self.max_len if kv_len is None else kv_len
        if not 0 < kv_len <= self.max_len:
            raise ContextLengthError(f"kv_len {kv_len} must be in 1..max_len ({self.max_len})")
        positions = (self.lengths_t[:n_rows, None] + self._arange[:n_tokens]).clamp(max=self.max_len - 1)  # (B, T),
        # read at replay time
        if exact:
            if n_tokens != 1:
                raise ValueError("a step attending as eager decodes one token a row")
            return CacheStep(self._arange[:n_rows], slice(0, n_rows), positions, None, kv_len, exact=True,
                             visible=positions[:, 0] + 1)
        mask = self._arange[None, None, None, :kv_len] <= positions[:, None, :, None]  # (B, 1, T, S)
        return CacheStep(self._arange[:n_rows], slice(0, n_rows), positions, mask, kv_len)

    def advance(self, slots: list[int] | range, n_tokens: int) -> None:
        for s in slots:
            self.lengths[s] += n_tokens
        first = slots[0]
        if (isinstance(slots, range) and slots.step == 1) or len(slots) == 1:
            self.lengths_t[first:first + len(slots)] += n_tokens
        else:
            self.lengths_t[device_index(list(slots), self.device)] += n_tokens


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
    row_kv: list[int] | None = None  # with a mask: the keys each row holds after the step (host ints)
    loops: Callable[..., torch.Tensor] | None = None  # the compiled attention (model.decode_attention), which reads
    visible: torch.Tensor | None = None  # (B,) the keys each row sees of the S read (S = whole blocks)
    exact: bool = False  # a compiled step attending as an eager one (model.decode_attention.attend_as_eager)

    def update(self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, H, T, D) in place and return the keys/values to attend over (B, H, S, D), in the cache's
        dtype; through the compiled attention, the whole cache tensors (it reads its rows and S entries itself)."""
        k, v = k.to(cache_k.dtype), v.to(cache_v.dtype)  # index_put (rows of different lengths) does not cast
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
        if self.loops is not None or self.exact:  # the compiled attention reads the layer's cache itself (`attend`)
            return cache_k, cache_v
        if self.slot_range is not None:
            k_all, v_all = cache_k[self.slot_range, :, : self.kv_len], cache_v[self.slot_range, :, : self.kv_len]
        else:
            k_all, v_all = cache_k[self.slot_index, :, : self.kv_len], cache_v[self.slot_index, :, : self.kv_len]
        return k_all, v_all  # in the cache's dtype: attention casts the queries to it (model/gpt.py)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the step's queries q (B, H, T, D) over the keys and values `update` returned, each row over
        the entries it may see.

        A CPU cache decoding one token a row (16-bit: any rows; fp32: from two), once the engine has compiled them:
        model.decode_attention's loops, which read the cache in its dtype and give a row the same result alone or
        batched. Until then (and for
        several tokens a row), rows of different lengths attend one call each, over just their own keys (the mask
        only where a row adds several tokens). PyTorch's CPU attention splits the keys into blocks by their count
        (512 at most, else all of them), so one padded call over the batch's longest row rounds a row differently
        from that row alone, and in bf16 that flipped seeded tokens of a request batched with others. One call per
        row gives a row the result it gets alone, and skips the padding, which made bf16 decode steps faster from
        16 rows. fp32 on a CPU too: its rounding is ~1e-7, but int8 weights turn such an ulp into a whole
        quantization step of some activation, and a seeded GPT-2 int8 request batched with three others (their
        prompts prefilled in one step) left its own tokens after 24 of 128. CUDA (and the static shapes of CUDA
        graphs) makes one masked call. (docs/performance.md, "bf16 batch invariance", has
        the runs.)"""
        if self.loops is not None:  # k, v: the layer's whole cache tensors (`update`)
            return self.loops(q, k, v, self.slot_range.start, q.size(0), self.kv_len, self.visible)
        if self.exact:  # k, v: slots 0..B-1 of the layer's cache, just written (`update`)
            return torch.ops.gpt_serve.attend_as_eager(q, k, v, self.visible)  # model.decode_attention
        q = q.to(k.dtype)  # the cache's dtype (a 16-bit cache beside fp32 weights is read as stored)
        if q.device.type == "cpu" and self.mask is not None and torch.compiler.is_dynamo_compiling():
            # a compiled CPU decode or verification step (engine/compiled_decode.py): written out, inductor fuses
            # the queries' attention into its own loops, without the SDPA kernel's per-call cost
            # (docs/performance.md, "Decode steps compiled ahead of time")
            scores = (q @ k.transpose(-1, -2)) * (q.size(-1) ** -0.5)
            scores = scores.masked_fill(~self.mask, float("-inf"))
            return torch.softmax(scores.float(), -1).to(v.dtype) @ v
        if self.row_kv is not None and q.device.type == "cpu":
            T = q.size(2)
            return torch.cat([F.scaled_dot_product_attention(
                q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                attn_mask=None if T == 1 else self.mask[b:b + 1, :, :, :n]) for b, n in enumerate(self.row_kv)])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.is_causal)
