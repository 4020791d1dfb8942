"""model/decode_attention.py and its engine side (engine/compiled_attention.py): a 16-bit CPU cache's decode steps
attend through compiled loops that equal the eager reference and fp32 attention over the same rounded keys, give a
row the same result alone or batched, and fall back to SDPA where the compile fails."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F

from engine import compiled_attention
from engine.runner import ModelRunner
from model import cpu_support, decode_attention
from model.config import GPTConfig
from model.kv_cache import KVCache
from tests.helpers import run_alone_or_together, tiny_model

H, D = 12, 64  # GPT-2's heads


N_SLOTS, MAX_LEN = 8, 1024


@functools.cache
def built(dtype: torch.dtype = torch.bfloat16):
    """The compiled loops for a cache of N_SLOTS x MAX_LEN in `dtype` (one build per dtype: a server has one)."""
    return decode_attention.build(torch.zeros(N_SLOTS, H, MAX_LEN, D, dtype=dtype))


@pytest.fixture(scope="module")
def loops():
    return built()


def test_the_compiled_loops_equal_the_eager_reference_and_fp32_attention_over_the_same_keys(loops):
    g = torch.Generator().manual_seed(0)
    lens = [300, 1, 64, 65, 129]
    S = decode_attention.read_len(max(lens), MAX_LEN)
    assert S == 320 and decode_attention.read_len(1000, 1024) == 1024 and decode_attention.read_len(64, 60) == 60
    cache_k, cache_v = (torch.randn(N_SLOTS, H, MAX_LEN, D, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(len(lens), H, 1, D, generator=g)
    visible = torch.tensor(lens)
    k, v = cache_k[1:1 + len(lens), :, :S], cache_v[1:1 + len(lens), :, :S]
    with torch.inference_mode():
        got = loops(q, cache_k, cache_v, 1, len(lens), S, visible)
        ref = decode_attention.attend(q, k, v, visible)
    assert got.dtype == torch.float32 and got.shape == (len(lens), H, 1, D)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for b, n in enumerate(lens):  # fp32 attention over the row's own (rounded) keys only
        sdpa = F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, :n].float(), v[b:b + 1, :, :n].float())
        torch.testing.assert_close(got[b:b + 1], sdpa, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_row_decodes_as_it_does_alone_whatever_its_batch(dtype):
    # KVCache.plan reads whole blocks of keys, so a row's sums run the same whether its batch's longest row is its
    # own or longer; lengths either side of block edges and of 512
    g = torch.Generator().manual_seed(1)
    cfg = GPTConfig(vocab_size=8, block_size=1024, n_layer=1, n_head=H, n_embd=H * D)
    lens = [700, 90, 511, 63, 64, 1, 128, 260]
    prefix = [(torch.randn(1, H, n, D, generator=g).to(dtype), torch.randn(1, H, n, D, generator=g).to(dtype))
              for n in lens]
    new = [(torch.randn(1, H, 1, D, generator=g).to(dtype), torch.randn(1, H, 1, D, generator=g).to(dtype))
           for _ in lens]
    q = torch.randn(len(lens), H, 1, D, generator=g)
    loops = built(dtype)

    def attend(rows):
        cache = KVCache(cfg, n_slots=N_SLOTS, dtype=dtype)
        cache.decode_attention = loops
        for s, r in enumerate(rows):
            cache.k[0][s, :, :lens[r]], cache.v[0][s, :, :lens[r]] = prefix[r]
            cache.lengths[s] = cache.lengths_t[s] = lens[r]
        step = cache.plan(range(len(rows)), 1)
        assert step.loops is loops and step.kv_len % decode_attention.KEY_BLOCK == 0
        k, v = step.update(cache.k[0], cache.v[0], torch.cat([new[r][0] for r in rows]),
                           torch.cat([new[r][1] for r in rows]))
        with torch.inference_mode():
            return step.attend(q[rows], k, v)

    batched = attend(list(range(len(lens))))
    for r in range(len(lens)):
        assert torch.equal(batched[r:r + 1], attend([r])), r
        assert torch.equal(attend([r, 0])[:1], batched[r:r + 1]), r  # beside the longest row


def test_a_bf16_cache_through_the_loops_stays_close_to_full_recompute():
    model = tiny_model(seed=3)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    lens = [9, 5]
    with torch.inference_mode():
        full, _ = model(idx)
        cache = KVCache(model.config, n_slots=2, dtype=torch.bfloat16)
        cache.decode_attention = decode_attention.build(cache.k[0])
        out = [model.forward_cached(idx[r:r + 1, :lens[r]], cache, [r], all_logits=True)[0] for r in range(2)]
        for t in range(6):
            step = model.forward_cached(torch.stack([idx[r, lens[r] + t] for r in range(2)])[:, None], cache, [0, 1])
            out = [torch.cat([o, step[j:j + 1]]) for j, o in enumerate(out)]
    for r in range(2):
        torch.testing.assert_close(out[r], full[r, :lens[r] + 6], atol=2e-3, rtol=0)


COMPILE_CACHE: list[str] = []  # the engines here keep their compiled attention in this module's folder


@pytest.fixture(autouse=True, scope="module")
def compile_cache(tmp_path_factory):
    COMPILE_CACHE[:] = [str(tmp_path_factory.mktemp("compiled"))]


def runner(kv_dtype=torch.bfloat16, compile="auto") -> ModelRunner:
    model = tiny_model(seed=0)
    return ModelRunner(model, n_slots=2, vocab_size=model.config.vocab_size, kv_dtype=kv_dtype, compile=compile,
                       compile_cache=COMPILE_CACHE[0])


@pytest.fixture(autouse=True)
def no_compiled_steps(monkeypatch):
    """The tiny model's whole decode step would compile too (GPT_COMPILE=auto, minutes): only the attention here."""
    import engine.runner

    monkeypatch.setattr(engine.runner, "resolve_compile", lambda *args: "off")


def test_the_engine_compiles_a_16_bit_caches_attention_in_the_background_and_installs_it_between_steps():
    r = runner()
    assert r.compile_attention and r.cache.decode_attention is None
    r.warmup()
    assert r.cache.decode_attention is None  # not before a step boundary
    assert not r.wait_compiled(timeout=300)  # (no compiled steps)
    assert r.cache.decode_attention is not None and r.attention_seconds is not None
    assert runner(kv_dtype=torch.float32).compile_attention  # fp32 too (below)
    assert not runner(compile="off").compile_attention


def test_an_fp32_cache_attends_through_the_loops_for_one_row_as_for_several():
    cfg = GPTConfig(vocab_size=8, block_size=1024, n_layer=1, n_head=H, n_embd=H * D)
    cache = KVCache(cfg, n_slots=N_SLOTS)
    cache.decode_attention = built(torch.float32)
    for s, n in enumerate([40, 300, 7]):
        cache.lengths[s] = cache.lengths_t[s] = n
    assert cache.plan(range(3), 1).loops is not None
    assert cache.plan(range(1), 1).loops is not None  # one row too: rounded as when batched
    assert cache.plan([0, 2], 1).loops is None  # rows not in consecutive slots
    assert cache.plan(range(3), 2).loops is None  # several tokens a row (verification, prefill)
    # a row batched against the same row alone, both through the loops: the same bits
    g = torch.Generator().manual_seed(3)
    for t in cache.k + cache.v:
        t[:3, :, :300] = torch.randn(3, H, 300, D, generator=g)
    q = torch.randn(3, H, 1, D, generator=g)
    new_kv = [torch.randn(3, H, 1, D, generator=g) for _ in range(2)]

    def attend(slots):  # the same positions each time (no advance)
        step = cache.plan(slots, 1)
        k, v = step.update(cache.k[0], cache.v[0], new_kv[0][list(slots)], new_kv[1][list(slots)])
        with torch.inference_mode():
            return step.attend(q[list(slots)], k, v)

    batched = attend(range(3))
    for r in range(3):
        assert torch.equal(attend(range(r, r + 1)), batched[r:r + 1])


def test_a_failed_attention_compile_leaves_sdpa_with_one_log_line(monkeypatch, caplog, tmp_path):
    def fail(*args):
        raise RuntimeError("no C++ compiler\nmore lines")

    monkeypatch.setattr(decode_attention, "build", fail)
    r = runner()
    r.compile_cache = str(tmp_path)  # nothing compiled yet
    with caplog.at_level(logging.WARNING, logger="engine.core.runner"):
        r.warmup()
        r.wait_compiled(timeout=60)
    assert r.cache.decode_attention is None
    lines = [rec.getMessage() for rec in caplog.records if "decode attention" in rec.getMessage()]
    assert lines == ["decode attention over the bfloat16 cache not compiled (RuntimeError: no C++ compiler); "
                     "attending through SDPA"]
    assert compiled_attention.wanted(r.cache, "auto")


def test_a_compiled_attention_that_differs_from_sdpa_is_refused_at_build(monkeypatch):
    # what a kernel from inductor's cache made under another vector ISA did (values of 1e23): build raises, and the
    # engine keeps SDPA with one log line (test_a_failed_attention_compile_leaves_sdpa_with_one_log_line)
    real = decode_attention.Loops.__call__
    monkeypatch.setattr(decode_attention.Loops, "__call__", lambda self, *args: real(self, *args) + 1.0)
    with pytest.raises(RuntimeError, match="the compiled decode attention differs from SDPA by 1 "):
        decode_attention.build(torch.zeros(4, 2, 128, 16, dtype=torch.bfloat16))



def engine(kv_dtype=torch.bfloat16):
    from engine.core import EngineCore

    model = tiny_model(seed=0, block_size=256)  # rows past a 64-key block's edge
    return EngineCore(model, n_slots=4, vocab_size=model.config.vocab_size, kv_dtype=kv_dtype, compile="auto",
                      compile_cache=COMPILE_CACHE[0])


def test_seeded_requests_give_the_same_tokens_alone_or_batched_through_the_compiled_attention():
    """The engine's promise with the loops installed (the rest of the suite decodes through SDPA): a bf16 cache's
    rows attend through them at every batch, in whole blocks of keys, so a row's tokens do not depend on its batch."""
    from engine.params import SamplingParams
    from engine.request import EngineRequest

    reqs = [(list(range(5, 17)), 0.0, 1.0, 1), (list(range(9, 70)), 0.8, 0.9, 7), (list(range(3, 8)), 1.0, 1.0, 3)]

    def run(core, together: bool) -> dict[str, list[int]]:
        return run_alone_or_together(core, [
            EngineRequest(str(i), prompt, SamplingParams(max_new_tokens=40, temperature=t, top_p=top_p), seed=seed)
            for i, (prompt, t, top_p, seed) in enumerate(reqs)], together)

    core = engine()
    core.warmup()
    core.wait_compiled(300)
    assert core.stats()["compiled_attention"] and core.cache.decode_attention is not None
    alone, batched = run(core, together=False), run(core, together=True)
    assert alone == batched and sorted(map(len, alone.values())) == [40, 40, 40]


@pytest.mark.slow  # a GPT-2-width model, 4 x 128 tokens twice: ~10 s (also run by make test-cpu-isa's file run)
def test_int8_weights_over_an_fp32_cache_give_a_seeded_request_its_tokens_alone_or_batched():
    """int8's activation rounding turns an ulp of attention into a whole quantization step, so every path a row
    attends through must round it as when batched: one fp32 row through SDPA while batched rows took the loops, or
    prompts prefilled together in one masked SDPA call, left these requests' own tokens after 19-37 of 128 (a
    4-layer GPT-2-width model; GPT-2 124M after 24-112)."""
    from engine.core import EngineCore
    from engine.params import SamplingParams
    from engine.request import EngineRequest
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2", n_layer=4)).eval()
    core = EngineCore(model, n_slots=4, vocab_size=model.config.vocab_size, prepack=True, quantize="int8",
                      compile="auto", compile_cache=COMPILE_CACHE[0])
    core.warmup()
    core.wait_compiled(300)
    assert core.stats()["compiled_attention"] and core.cache.k[0].dtype == torch.float32
    reqs = [(list(range(10, 42)), 0.0, 1.0, 0, 1), (list(range(50, 90)), 0.8, 0.95, 0, 7),
            (list(range(5, 20)), 1.0, 1.0, 0, 3), (list(range(100, 130)), 0.8, 0.95, 40, 5)]

    def run(together: bool) -> dict[str, list[int]]:
        return run_alone_or_together(core, [
            EngineRequest(f"r{i}", p, SamplingParams(max_new_tokens=128, temperature=t, top_p=tp, top_k=k,
                                                    stop_at_eos=False), seed=seed)
            for i, (p, t, tp, k, seed) in enumerate(reqs)], together)

    alone, batched = run(False), run(True)
    assert alone == batched and sorted(map(len, alone.values())) == [128] * 4


def test_the_server_says_compiling_until_the_attention_is_installed(monkeypatch):
    import threading

    release, real = threading.Event(), decode_attention.build

    def held(*args):
        release.wait(60)
        return real(*args)

    monkeypatch.setattr(decode_attention, "build", held)
    core = engine()
    core.warmup()
    assert core.stats()["compiling"] and not core.stats()["compiled_attention"]
    release.set()
    core.wait_compiled(300)
    assert not core.stats()["compiling"] and core.stats()["compiled_attention"]


@pytest.mark.parametrize("with_loops", [True, False], ids=["loops", "sdpa"])
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_static_step_attending_as_eager_gives_an_eager_step_s_logits_bit_for_bit(with_loops, quantize):
    """`decode_static(..., exact=True)` (what a quantized model's compiled step traces) attends through
    `attend_as_eager`, which finds the live cache from its inputs and computes what an eager decode step of that row
    computes at that moment: the cache's compiled loops once installed, SDPA over the row's own keys before. Run
    eagerly here, so every bit of the two steps' logits and written keys must agree, at lengths either side of a
    block edge."""
    from model.linear import convert

    if quantize == "int8" and not cpu_support.support().fbgemm:
        pytest.skip("int8 through fbgemm")
    model = tiny_model(0, n_embd=64, n_head=4, vocab_size=128, block_size=256)
    if quantize != "none":
        convert(model, quantize)
    cache = KVCache(model.config, 3, 256)
    if with_loops:
        cache.decode_attention = decode_attention.build(cache.k[0])
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model.forward_cached(torch.randint(0, 128, (1, 60), generator=g), cache, [0])
        for _ in range(8):  # lengths 60..67: across the 64-key block edge
            tok = torch.randint(0, 128, (1, 1), generator=g)
            n = cache.lengths[0]
            static = model.decode_static(tok, cache, 128, exact=True)
            static_k = cache.k[1][0, :, n].clone()
            eager = model.forward_cached(tok, cache, [0])  # writes the same entry, then advances
            assert torch.equal(static, eager) and torch.equal(static_k, cache.k[1][0, :, n])
        masked = model.decode_static(tok, cache, 128)  # the written-out attention under a mask: close, not equal
        cache.truncate(0, cache.lengths[0])
        torch.testing.assert_close(masked, model.forward_cached(tok, cache, [0]), atol=1e-4, rtol=1e-4)


def test_attending_as_eager_refuses_tensors_that_are_not_a_live_cache_s():
    cache = KVCache(GPTConfig.preset("tiny"), 2, 64)
    q = torch.zeros(1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="not slots 0.. of a live KV cache's layer"):
        torch.ops.gpt_serve.attend_as_eager(q, cache.k[0].clone(), cache.v[0], torch.ones(1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="not slots 0.. of a live KV cache's layer"):
        torch.ops.gpt_serve.attend_as_eager(q, cache.k[0], cache.v[1], torch.ones(1, dtype=torch.long))


@pytest.mark.parametrize("with_loops", [True, False], ids=["loops", "sdpa"])
def test_attending_as_eager_in_and_out_of_inference_mode_gives_one_answer(with_loops):
    """`attend_as_eager` keeps its eager-layout query between calls, one per inference mode: a buffer made in
    inference mode cannot be written outside it (a compiled step under inference mode, then a check under no_grad,
    then the step again)."""
    cache = KVCache(GPTConfig(vocab_size=128, block_size=256, n_layer=1, n_head=4, n_embd=64), 2, 256)
    if with_loops:
        cache.decode_attention = decode_attention.build(cache.k[0])
    g = torch.Generator().manual_seed(0)
    cache.k[0][:1, :, :100] = torch.randn(1, 4, 100, 16, generator=g)
    cache.v[0][:1, :, :100] = torch.randn(1, 4, 100, 16, generator=g)
    q, visible = torch.randn(1, 4, 1, 16, generator=g), torch.tensor([90])
    answers = []
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad):
        with mode():
            answers.append(torch.ops.gpt_serve.attend_as_eager(q, cache.k[0][:1], cache.v[0][:1], visible))
    assert all(torch.equal(a, answers[0]) for a in answers)
    torch.testing.assert_close(answers[0], torch.nn.functional.scaled_dot_product_attention(
        q, cache.k[0][:1, :, :90], cache.v[0][:1, :, :90]), atol=1e-5, rtol=1e-5)


def test_every_call_the_engine_makes_through_the_loops_equals_attention_without_them():
    """The loops are one package compiled for the cache's shape, dynamic in rows and keys read, specialised to its
    inputs' layouts: every call a server makes gets attention's answer. One row and several, slots other than 0 (a
    one-token prefill after a prefix reuse), short lengths and the whole cache, the eager step's query layout, and
    a compiled quantized step's calls through `attend_as_eager` (under torch.compile the same calls once compiled
    again while serving, and past dynamo's limit of 8 graphs failed the step)."""
    model = tiny_model(0, n_embd=64, n_head=4, vocab_size=128, block_size=256)
    caches = [KVCache(model.config, 4, 256) for _ in range(2)]
    caches[0].decode_attention = decode_attention.build(caches[0].k[0])
    g = torch.Generator().manual_seed(0)

    def both(fn, rows: int | None = None, *args):
        tok = torch.randint(0, 128, (rows, 1), generator=g) if rows is not None else None
        got, ref = (fn(tok, c, *args) for c in caches)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)

    cached = model.forward_cached
    with torch.inference_mode():
        both(lambda _, c: cached(torch.arange(180).remainder(128).reshape(3, 60), c, [0, 1, 2]))
        for _ in range(6):  # 3 rows, then 1, at lengths either side of a block edge
            both(cached, 3, [0, 1, 2])
            both(cached, 1, [0])
        both(cached, 1, [2])  # one row at slot 2
        both(cached, 2, [1, 2])  # rows from slot 1
        both(lambda tok, c: model.decode_static(tok, c, 256, exact=True), 1)  # a compiled quantized step's call
        for c in caches:
            c.advance([0, 1, 2, 3], 256 - 1 - max(c.lengths))  # the whole cache read
        both(cached, 3, [0, 1, 2])
        both(cached, 1, [3])
    loops, fewer = caches[0].decode_attention, KVCache(model.config, 2, 256)  # a scratch cache of fewer slots
    assert loops(torch.zeros(2, 4, 1, 16), fewer.k[0], fewer.v[0], 0, 2, 64, torch.ones(2)).shape == (2, 4, 1, 16)
    for other in (KVCache(model.config, 2, 128), KVCache(model.config, 2, 256, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="these loops attend over up to 4 rows of"):  # another shape: refused
            loops(torch.zeros(1, 4, 1, 16), other.k[0], other.v[0], 0, 1, 64, torch.ones(1))
    with pytest.raises(ValueError, match="these loops attend over up to 4 rows of"):  # more rows than slots
        big = KVCache(model.config, 5, 256)
        loops(torch.zeros(5, 4, 1, 16), big.k[0], big.v[0], 0, 5, 64, torch.ones(5))


def test_the_engine_keeps_the_compiled_attention_on_disk_and_compiles_a_package_that_does_not_load_again(
        tmp_path, caplog):
    cache = KVCache(GPTConfig(vocab_size=8, block_size=128, n_layer=1, n_head=2, n_embd=32), 2, 128)

    def build():
        job = compiled_attention.AttentionBuild(cache, cache_dir=tmp_path).start()
        assert job.wait(300) and job.error is None
        return job

    first = build()
    [package] = (tmp_path / compiled_attention.ATTENTION).iterdir()
    assert first.source == "compiled" and package.name == f"{first.key()}.pt2"
    assert build().source == "cache"
    package.write_bytes(b"not a package")
    with caplog.at_level(logging.WARNING, logger="engine.compiled_attention"):
        again = build()
    assert again.source == "compiled" and again.fn is not None and package.stat().st_size > 1000
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "engine.compiled_attention"] == [
        f"compiled decode attention {package} does not load"]


def test_the_attention_package_s_key_names_what_its_loops_depend_on(monkeypatch):
    """ATen's CPU capability (inductor's vector ISA follows it), the threads, the cache's shape and dtypes."""
    cfg = GPTConfig(vocab_size=8, block_size=128, n_layer=1, n_head=2, n_embd=32)
    job = compiled_attention.AttentionBuild(KVCache(cfg, 2, 128))
    key = job.key()
    assert key == compiled_attention.AttentionBuild(KVCache(cfg, 2, 128)).key()
    assert key != compiled_attention.AttentionBuild(KVCache(cfg, 3, 128)).key()
    assert key != compiled_attention.AttentionBuild(KVCache(cfg, 2, 128, dtype=torch.bfloat16)).key()
    assert key != compiled_attention.AttentionBuild(KVCache(cfg, 2, 128), torch.bfloat16).key()
    real = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT" if real != "DEFAULT" else "AVX2")
    assert job.key() != key
    monkeypatch.undo()
    job._threads += 1
    assert job.key() != key


@pytest.mark.parametrize("shape", [(1, 2, 2, 16), (3, 2, 3, 16)], ids=["one-slot-two-entries", "three-entries"])
def test_a_cache_too_small_to_vary_in_a_dimension_gets_loops_static_there(shape):
    """export needs examples of at least 2 in a dynamic dimension: a cache of one slot or of two entries is built
    static there, at the one size its steps read (`read_len` reads the whole of so short a cache)."""
    g = torch.Generator().manual_seed(0)
    cache_k, cache_v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    loops = decode_attention.build(cache_k)
    n, H, L, D = shape
    for rows in range(1, n + 1):
        q = torch.randn(rows, H, 1, D, generator=g)
        got = loops(q, cache_k, cache_v, 0, rows, decode_attention.read_len(L, L), torch.full((rows,), L))
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, cache_k[:rows], cache_v[:rows]),
                                   atol=1e-5, rtol=1e-5)
