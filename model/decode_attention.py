"""Decode attention on a CPU as inductor's loops, reading the KV cache where it lies, in its own dtype.

A decode step attends one query per row over the keys its slot holds, read from the cache as strided views (slot,
head, first S entries). PyTorch's CPU attention in bf16 copies such views before its matmuls (16 rows x 12 heads
x 300 keys: 2.4 ms a layer against fp32's 0.37, 2 threads on an avx512_bf16 EPYC), and per-row calls, which keep a
row's result the same alone or batched, cost a call each. Written out here as reductions (scores, softmax, p.V),
`torch.compile` (dynamic batch and length) turns them into C++ loops that read the cache as stored (bf16: half
fp32's bytes) and compute in fp32: bf16 0.24 ms at 16 rows, 1.8 ms at 64 (fp32 SDPA: 0.37 / 5.1; fp32 loops 0.27 /
2.9), 41 us at one row (fp32 SDPA: 31; docs/performance.md, "Decode attention through compiled loops").

A row gets the same result alone or batched: keys are read in whole blocks of KEY_BLOCK (`read_len`), so a row's
sums run over the same lanes in the same order whether the batch's longest row is its own or longer; the extra
entries are masked to exact zeros. Compiling takes seconds (inductor's FX graph cache on disk makes a restart's
~1-2 s), so the engine compiles in the background (`build`) and hands the result to its cache between steps
(`KVCache.decode_attention`); until then, or where a compile fails, CacheStep.attend keeps its per-row SDPA calls.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable

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


def attend_slots(q: torch.Tensor, slots_k: torch.Tensor, slots_v: torch.Tensor, S: int,
                 visible: torch.Tensor) -> torch.Tensor:
    """`attend` over the first S entries of consecutive slots of one layer's cache (views of its whole tensors, one
    row per slot): compiled, the cache's strides and its other dimensions stay constants of the loops (H and D
    unrolled and vectorised), and only the rows and S vary. The slots are sliced before the call, not inside it: a
    slot number inside would be one more guarded value (a recompile per slot, at serve time)."""
    return attend(q, slots_k[:, :, :S], slots_v[:, :, :S], visible)


def eager_query(rows: int, H: int, D: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty (rows, H, 1, D) query laid out as an eager decode step's (a view of the (rows, 1, 3·H·D) output of
    the qkv matmul): the compiled loops are specialised to their inputs' strides, so every call (the warm-up
    below, `attend_as_eager`) hands them this layout, else it compiles again while serving."""
    return torch.empty(rows, 1, 3 * H * D, dtype=dtype)[:, :, :H * D].view(rows, 1, H, D).transpose(1, 2)


def build(cache_k: torch.Tensor, q_dtype: torch.dtype = torch.float32) -> Callable[..., torch.Tensor]:
    """Compile `attend_slots` for caches shaped like `cache_k` (n_slots, H, max_len, D) and queries of `q_dtype`,
    and run it on one row and on several, at a length short of the cache, a second one and the whole cache, so that
    every graph a server's steps need exists (torch.compile's automatic dynamic shapes: general in rows and length
    after a second shape; one row and the whole cache are graphs of their own) before a request needs it; raises
    what the compile raises. Returns `loops(q, cache_k, cache_v, first, rows, S, visible)`: slots first..first+rows-1
    of one layer's whole cache tensors."""
    # dynamo keeps its graphs on the function's code object, at most 8 (recompile_limit; past it, with fullgraph, a
    # call raises: the step fails): a code object of its own per build, so caches of other shapes in one process
    # (tests, a draft model's) do not add up to that limit, and every call in the layout warmed here (slots sliced
    # outside, `eager_query`, tensors made outside inference mode as the cache's are): GPT-2 int8 over a bf16 cache
    # hit the limit while serving when its query's strides, a slot number and an inference-mode scratch cache each
    # compiled again (docs/performance.md)
    own = types.FunctionType(attend_slots.__code__.replace(), attend_slots.__globals__, attend_slots.__name__)
    fn = torch.compile(own, fullgraph=True)

    def loops(q, cache_k, cache_v, first, rows, S, visible):
        return fn(q, cache_k[first:first + rows], cache_v[first:first + rows], S, visible)

    n_slots, H, max_len, D = cache_k.shape
    k, v = torch.zeros_like(cache_k), torch.zeros_like(cache_k)
    # per kind of row count (one; several): a first shape, a second length (now general in it), the whole cache
    lengths = sorted({min(KEY_BLOCK, max_len), min(2 * KEY_BLOCK, max_len), max_len})
    shapes = [(1, S) for S in lengths]
    if n_slots >= 3:
        shapes = [(2, lengths[0]), *((3, S) for S in lengths[1:]), *shapes]
    with torch.inference_mode():  # as the engine's steps run (a guard: another mode would compile again)
        for rows, S in shapes:
            loops(eager_query(rows, H, D, q_dtype).zero_(), k, v, 0, rows, S, torch.ones(rows, dtype=torch.long))
        _check(loops, k, v, rows=min(n_slots, 3), q_dtype=q_dtype)
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
        visible = torch.tensor([S - 3 * i for i in range(n)])
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
