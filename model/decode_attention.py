"""Decode attention on a CPU as inductor's loops, reading the KV cache where it lies, in its own dtype.

A decode step attends one query per row over the keys its slot holds, read from the cache as strided views (slot,
head, first S entries). PyTorch's CPU attention in bf16 copies such views before its matmuls (16 rows x 12 heads
x 300 keys: 2.4 ms a layer against fp32's 0.37, 2 threads on an avx512_bf16 EPYC), and per-row calls, which keep a
row's result the same alone or batched, cost a call each. Written out here as reductions (scores, softmax, p.V),
inductor (ahead of time, AOTInductor: dynamic batch and length) turns them into C++ loops that read the cache as
stored (bf16: half fp32's bytes) and compute in fp32: bf16 0.24 ms at 16 rows, 1.8 ms at 64 (fp32 SDPA: 0.37 /
5.1; fp32 loops 0.27 / 2.9), 41 us at one row (fp32 SDPA: 31; docs/performance.md, "Decode attention through
compiled loops").

A row gets the same result alone or batched: keys are read in whole blocks of KEY_BLOCK (`read_len`), so a row's
sums run over the same lanes in the same order whether the batch's longest row is its own or longer; the extra
entries are masked to exact zeros. Compiling takes ~12 s, so the engine compiles in the background (`build`;
engine/compiled_attention.py keeps the package on disk: a restart loads it in milliseconds) and hands the result to
its cache between steps (`KVCache.decode_attention`); until then, or where a compile fails, CacheStep.attend keeps
its per-row SDPA calls.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

KEY_BLOCK = 64  # keys are read in blocks of this many (batch invariance, above)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Attention of one query per row: q (B, H, 1, D) any float dtype, k / v (B, H, S, D) in the cache's dtype,
    `visible` (B,) the keys row b may see (its first visible[b]); fp32 arithmetic, the result (B, H, 1, D) in q's
    dtype. Eager it is the reference; compiled (`build`) it is the decode path."""
    S = k.size(2)
    scores = (q.float() * k.float()).sum(-1) * (q.size(-1) ** -0.5)  # (B, H, S)
    hidden = torch.arange(S, device=k.device) >= visible[:, None, None]
    p = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
    return (p.unsqueeze(-1) * v.float()).sum(-2, keepdim=True).to(q.dtype)


def read_len(kv_len: int, max_len: int) -> int:
    """How many cache entries a step reads for `kv_len` visible ones: whole blocks, within the cache."""
    return min(-(-kv_len // KEY_BLOCK) * KEY_BLOCK, max_len)


class SlotsAttention(torch.nn.Module):
    """`attend` over the first S entries of consecutive slots of one layer's cache, as exported and compiled ahead of
    time (`build`): q (rows, H, 1, D) in the eager layout (`eager_query`), the slots' whole keys and values (rows,
    H, max_len, D: views of the cache's tensors, so their strides are constants of the loops), `positions` (S,) the
    entries read (arange(S): S comes in as its size) and `visible` (rows,). The keys are read as (rows, S, H, D),
    transposed views: sliced as (rows, H, S, D), the view is contiguous exactly when S is the whole cache, a guard
    that export refuses over a dynamic S up to max_len (inductor fuses both into the same loops, bit for bit)."""

    def forward(self, q: torch.Tensor, slots_k: torch.Tensor, slots_v: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        S = positions.size(0)
        # (rows, S, H, D) in fp32: converted whole (of a view of S entries, the copy would keep its layout where it is
        # dense, which is one more such guard), which inductor fuses into the loops reading S entries
        k, v = slots_k.float().transpose(1, 2)[:, :S], slots_v.float().transpose(1, 2)[:, :S]
        scores = (q.transpose(1, 2).float() * k).sum(-1) * (q.size(-1) ** -0.5)  # (rows, S, H)
        p = torch.softmax(scores.masked_fill(positions[None, :, None] >= visible[:, None, None], float("-inf")), 1)
        return (p.unsqueeze(-1) * v).sum(1, keepdim=True).transpose(1, 2).to(q.dtype)


def eager_query(rows: int, H: int, D: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty (rows, H, 1, D) query laid out as an eager decode step's (a view of the (rows, 1, 3·H·D) output of
    the qkv matmul): the compiled loops are specialised to their inputs' strides, so every call hands them this
    layout (`Loops` copies another into it)."""
    return torch.empty(rows, 1, 3 * H * D, dtype=dtype)[:, :, :H * D].view(rows, 1, H, D).transpose(1, 2)


class Loops:
    """The compiled attention of one cache's layers, called as `loops(q, cache_k, cache_v, first, rows, S, visible)`:
    slots first..first+rows-1 of one layer's whole cache tensors, their first S entries. One AOTInductor package
    (dynamic rows and S) run by its C++ runner straight from here: the same loops through `torch.compile` cost
    dynamo's frame and AOT autograd's and inductor's Python wrappers, ~40-100 us a call beside a kernel of 20-70
    (a one-row call over 64 / 256 keys: 23 / 67 us against 66-131 / 103-166; docs/performance.md, "Decode attention
    without wrappers")."""

    def __init__(self, package: str, cache_k: torch.Tensor, q_dtype: torch.dtype) -> None:
        self._run = torch._inductor.aoti_load_package(package).loader.run
        n_slots, self.H, max_len, self.D = self.shape = cache_k.shape
        self.dtype, self.q_dtype = cache_k.dtype, q_dtype
        self._positions = torch.arange(max_len)
        self._q_stride = eager_query(2, self.H, self.D).stride()

    def __call__(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, first: int, rows: int, S: int,
                 visible: torch.Tensor) -> torch.Tensor:
        if cache_k.shape[1:] != self.shape[1:] or cache_k.dtype != self.dtype or rows > self.shape[0]:
            # the loops would read past another cache's slots (one with fewer, a scratch cache's, reads as this one)
            raise ValueError(f"these loops attend over up to {self.shape[0]} rows of (slots, "
                             f"{', '.join(map(str, self.shape[1:]))}) {self.dtype} caches, not {rows} of "
                             f"{tuple(cache_k.shape)} {cache_k.dtype}")
        stride = q.stride()  # the package reads the layout it was built for (a size-1 dim's stride is never read)
        if (stride[1] != self._q_stride[1] or stride[3] != 1 or (rows > 1 and stride[0] != self._q_stride[0])
                or q.dtype != self.q_dtype):
            q = eager_query(rows, self.H, self.D, self.q_dtype).copy_(q)
        return self._run([q, cache_k[first:first + rows], cache_v[first:first + rows], self._positions[:S],
                          visible.long()])[0]


def export(cache_k: torch.Tensor, q_dtype: torch.dtype = torch.float32) -> torch.export.ExportedProgram:
    """`SlotsAttention` for caches shaped like `cache_k` (n_slots, H, max_len, D), queries of `q_dtype`: rows
    1..n_slots and S 1..max_len dynamic (a cache of one slot or of at most two entries: static there, at that size:
    `read_len` reads the whole of so short a cache)."""
    n_slots, H, max_len, D = cache_k.shape
    k = torch.zeros_like(cache_k)
    # examples of 1 would specialise; a dimension that cannot vary is static at its one size
    rows, S = min(3, n_slots), (min(2 * KEY_BLOCK, max_len - 1) if max_len > 2 else max_len)
    example = (eager_query(rows, H, D, q_dtype).zero_(), k[:rows], k[:rows], torch.arange(S),
               torch.ones(rows, dtype=torch.long))
    dim_rows = torch.export.Dim("rows", min=1, max=n_slots) if n_slots > 1 else None
    dim_s = torch.export.Dim("S", min=1, max=max_len) if max_len > 2 else None
    return torch.export.export(SlotsAttention(), example, dynamic_shapes=(
        {0: dim_rows}, {0: dim_rows}, {0: dim_rows}, {0: dim_s}, {0: dim_rows}))


def build(cache_k: torch.Tensor, q_dtype: torch.dtype = torch.float32, package: str | Path | None = None) -> Loops:
    """The compiled attention for caches shaped like `cache_k` (n_slots, H, max_len, D) and queries of `q_dtype`:
    AOTInductor's package of `export`, loaded from `package` if that file exists, else compiled (~12 s on a 2-vCPU
    EPYC; written to `package` when given), then checked against SDPA (`_check`); raises what the compile, the
    load or the check raises."""
    with contextlib.ExitStack() as stack:
        if package is None or not Path(package).is_file():
            if package is None:
                package = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "attention.pt2"
            torch._inductor.aoti_compile_and_package(export(cache_k, q_dtype), package_path=str(package))
        loops = Loops(str(package), cache_k, q_dtype)
    k, v = torch.zeros_like(cache_k), torch.zeros_like(cache_k)
    _check(loops, k, v, rows=min(cache_k.size(0), 3), q_dtype=q_dtype)
    return loops


def _check(fn: Callable[..., torch.Tensor], k: torch.Tensor, v: torch.Tensor, rows: int,
           q_dtype: torch.dtype = torch.float32) -> None:
    """Raise unless `fn` equals fp32 SDPA over each row's own keys on random data, at one row and at `rows`. A
    kernel from inductor's on-disk cache made under another vector ISA (`ATEN_CPU_CAPABILITY=avx2` after an AVX-512
    run, same cache folder) returned values of 1e23 here: the engine then keeps SDPA (one log line)."""
    g = torch.Generator().manual_seed(0)
    S = min(2 * KEY_BLOCK, k.size(2))
    k[:rows, :, :S] = torch.randn(rows, k.size(1), S, k.size(3), generator=g).to(k.dtype)
    v[:rows, :, :S] = torch.randn(rows, v.size(1), S, v.size(3), generator=g).to(v.dtype)
    for n in sorted({1, rows}):
        q = eager_query(n, k.size(1), k.size(3), q_dtype)
        q.copy_(torch.randn(n, k.size(1), 1, k.size(3), generator=g))
        visible = torch.tensor([max(1, S - 3 * i) for i in range(n)])  # (a cache of a few entries too)
        got = fn(q, k, v, 0, n, S, visible)
        ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1].float(), k[b:b + 1, :, :m].float(), v[b:b + 1, :, :m].float())
            for b, m in enumerate(visible.tolist())])
        err = (got.float() - ref).abs().max().item()
        if not err <= 1e-3:  # (also NaN) fp32 sums in another order: ~1e-6
            raise RuntimeError(f"the compiled decode attention differs from SDPA by {err:.3g} ({n} rows)")


# every live KV cache (model.kv_cache) by its layers' key tensors' addresses: how a compiled step's attention finds
# the cache its inputs are views of (`attend_as_eager`)
_CACHES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_LAYERS: dict[int, int] = {}  # ... and the layer of each (read only where _CACHES holds the address)


def register(cache) -> None:
    """Make `cache` (a KVCache) findable by `attend_as_eager` from its layers' tensors."""
    for gone in [ptr for ptr in _LAYERS if ptr not in _CACHES]:  # caches since freed
        del _LAYERS[gone]
    for i, t in enumerate(cache.k):
        _CACHES[t.data_ptr()], _LAYERS[t.data_ptr()] = cache, i


def attend_as_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """One query a row (q: B, H, 1, D) over slots 0..B-1 of a live cache's layer (k, v: those slots' views, this
    step's keys already written; `visible`: the keys each row sees), computed as an eager decode step of those rows
    computes it at this moment: the cache's compiled loops (`build`; model.kv_cache `_loops`) if it has them, else SDPA
    over each row's own keys. A compiled step of quantized weights (engine/compiled_decode.py) calls this op from
    its C++ code (AOTInductor's proxy executor), so that its attention gives eager's bits: int8 rounds each
    activation to a step, and an ulp of difference near a rounding tie became a whole step, so that seeded GPT-2
    int8 streams left the eager tokens after 11-24 of 128 (docs/performance.md)."""
    ptr = k.data_ptr()
    cache = _CACHES.get(ptr)
    ck = None if cache is None else cache.k[_LAYERS[ptr]]
    if ck is None or ck.data_ptr() != ptr or cache.v[_LAYERS[ptr]].data_ptr() != v.data_ptr():
        raise RuntimeError("attend_as_eager: its keys and values are not slots 0.. of a live KV cache's layer")
    cv = cache.v[_LAYERS[ptr]]
    B, H, _, D = q.shape
    # q in the layout of an eager step's query: the loops would compile again for another (`eager_query`); one such
    # tensor kept per thread, shape and inference mode (an inference tensor cannot be written outside it, and the
    # loops guard on it), not made a call (GPT-2's 12 calls a token: 153 -> 134 us each, an A/B in one process,
    # docs/performance.md "int8 compiled without int8 dot products")
    where = (threading.get_ident(), B, H, D, q.dtype, torch.is_inference_mode_enabled())
    eager_q = _QUERIES.get(where)
    if eager_q is None:
        eager_q = _QUERIES[where] = eager_query(B, H, D, q.dtype)
    eager_q.copy_(q)
    if cache.decode_attention is not None:
        S = read_len(int(visible.max()), cache.max_len)
        return cache.decode_attention(eager_q, ck, cv, 0, B, S, visible.contiguous())
    eager_q = eager_q.to(ck.dtype)
    return torch.cat([F.scaled_dot_product_attention(eager_q[b:b + 1], ck[b:b + 1, :, :n], cv[b:b + 1, :, :n])
                      for b, n in enumerate(visible.tolist())]).to(q.dtype)


_QUERIES: dict[tuple, torch.Tensor] = {}  # attend_as_eager's query in the eager layout, per thread, shape and mode


# an operator of the dispatcher's own, not `torch.library.custom_op`, whose Python wrapper cost ~10 us more a call from
# a compiled step (model.linear's int8_matmul, measured the same way: docs/performance.md)
_LIB = torch.library.Library("gpt_serve", "FRAGMENT")
_LIB.define("attend_as_eager(Tensor q, Tensor k, Tensor v, Tensor visible) -> Tensor")
_LIB.impl("attend_as_eager", attend_as_eager, "CPU")


@torch.library.register_fake("gpt_serve::attend_as_eager", lib=_LIB)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)
