"""CUDA-graph decode (engine/cuda_graphs.py): replays equal eager steps.

Everything but `torch.cuda.graph` itself runs on CPU here: GraphedDecode takes its capture step as an argument,
and `eager_capture` runs each bucket's `GPT.decode_static` eagerly, so the engine's warm-up → capture → replay
sequence is the one a GPU runs. The graph's body is also checked against the dynamic step in test_model.py. The
last test needs a CUDA device (CI has none; `make gpu-check` runs it)."""

from __future__ import annotations

import pytest
import torch

from engine.core import EngineCore
from engine.cuda_graphs import GraphedDecode, context_buckets, eager_capture
from engine.generate import decode_step, prefill
from engine.params import SamplingParams
from engine.request import EngineRequest
from model.config import ContextLengthError
from model.kv_cache import KVCache
from tests.helpers import tiny_model


def spy_decode_static(model, calls: list):
    """Record (rows, kv_len) of every decode_static call (a graph's capture and, eagerly, its replays)."""
    inner = model.decode_static

    def spy(idx, cache, kv_len=None):
        calls.append((idx.size(0), kv_len))
        return inner(idx, cache, kv_len)

    model.decode_static = spy


def run_core(core: EngineCore, prompts, new_tokens: list[int]) -> dict[str, list]:
    for i, (p, n) in enumerate(zip(prompts, new_tokens)):
        core.add(EngineRequest(str(i), p, SamplingParams(max_new_tokens=n, temperature=0), seed=i))
    out: dict[str, list] = {}
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(zip(o.token_ids, o.logprobs))
    return out


def test_warmup_with_graphs_captures_every_bucket_and_serves_the_eager_tokens():
    # issue 31: warm-up prefilled the whole context into slot 0, then captured decode_static over slots 0..b-1, whose
    # position for slot 0 was max_len (IndexError here, a device-side assert on CUDA); graphs were then off
    model = tiny_model(vocab_size=300, block_size=600)  # contexts 256, 512, 600
    calls: list = []
    spy_decode_static(model, calls)
    core = EngineCore(model, n_slots=4, vocab_size=300, cuda_graphs=True)
    core.warmup(graph_capture=eager_capture)
    assert core.warmup_error is None
    assert core.stats()["cuda_graphs"]
    assert core.cache.lengths == [0] * 4
    assert {(b, c) for b in (1, 2, 4) for c in (256, 512, 600)} <= set(calls)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 300, 17)]
    calls.clear()
    graphed = run_core(core, prompts, [8, 4, 8])
    assert (4, 512) in calls and (2, 256) in calls  # 3 rows while the 300-token prompt decodes, then 2 short ones
    plain = EngineCore(tiny_model(vocab_size=300, block_size=600), n_slots=4, vocab_size=300, cuda_graphs=False)
    eager = run_core(plain, prompts, [8, 4, 8])
    for rid in eager:
        assert [t for t, _ in graphed[rid]] == [t for t, _ in eager[rid]]
        torch.testing.assert_close([lp for _, lp in graphed[rid]], [lp for _, lp in eager[rid]], rtol=1e-4, atol=1e-4)


def test_replays_pick_the_context_bucket_of_the_longest_row_and_equal_eager_decoding():
    model = tiny_model(vocab_size=300)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 5, 20)]
    caches = [KVCache(model.config, n_slots=8) for _ in range(2)]
    for cache in caches:
        for slot, p in enumerate(prompts):
            prefill(model, cache, slot, p)
    graphed = GraphedDecode(model, caches[0], 8, capture=eager_capture, contexts=(8, 16, 32))
    assert graphed.contexts == [8, 16, 32, 64]
    calls: list = []
    spy_decode_static(model, calls)
    tokens = torch.tensor([7, 8, 9])
    for runs in (2, 1, 1):  # longest row 20 → 21..23 keys; captured (one eager run) at first use, then replayed
        calls.clear()
        a = graphed(tokens, 3)
        assert calls == [(4, 32)] * runs
        b = decode_step(model, caches[1], [0, 1, 2], tokens)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        tokens = a.argmax(-1)
    calls.clear()
    graphed(tokens[:2], 2)  # slots 0, 1: 6 and 8 tokens held → 9 keys
    assert calls[-1] == (2, 16)
    assert graphed.check(2)


def test_a_full_padding_slot_stays_in_the_cache_and_a_full_live_row_is_refused():
    model = tiny_model(vocab_size=300)
    L = model.config.block_size
    cache = KVCache(model.config, n_slots=4)
    for slot, n in enumerate((3, 4, 5)):
        prefill(model, cache, slot, list(range(1, n + 1)))
    prefill(model, cache, 3, list(range(L)))  # an idle slot holding the whole context (prefix reuse keeps it)
    keep = [t[3, :, : L - 1].clone() for t in cache.k + cache.v]
    graphed = GraphedDecode(model, cache, 4, capture=eager_capture)
    graphed.capture_all()  # bucket 4 covers slot 3: its position is clamped, not past the cache
    graphed(torch.tensor([1, 2, 3]), 3)
    assert all(torch.equal(t[3, :, : L - 1], k) for t, k in zip(cache.k + cache.v, keep))
    assert cache.lengths == [4, 5, 6, L]
    with pytest.raises(ContextLengthError, match="context length"):
        graphed(torch.tensor([1, 2, 3, 4]), 4)  # slot 3 is live now: no room
    assert context_buckets(1024) == [256, 512, 1024] and context_buckets(100) == [100]


def test_graphs_need_a_capture_step_off_cuda():
    model = tiny_model(vocab_size=300)
    with pytest.raises(ValueError, match="CUDA"):
        GraphedDecode(model, KVCache(model.config, n_slots=2), 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replays_equal_eager_decoding_without_host_syncs():
    from engine.cuda_graphs import GraphedDecode

    dev = torch.device("cuda")
    model = tiny_model(vocab_size=300).to(dev)
    caches = [KVCache(model.config, n_slots=8, device=dev) for _ in range(2)]
    for cache in caches:
        for slot, n in enumerate((3, 5, 4)):
            prefill(model, cache, slot, list(range(1, n + 1)))
    graphed = GraphedDecode(model, caches[0], 8)
    graphed.capture_all()
    tokens = torch.tensor([7, 8, 9], device=dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        a = graphed(tokens, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    b = decode_step(model, caches[1], [0, 1, 2], tokens)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
