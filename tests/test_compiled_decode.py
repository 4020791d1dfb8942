"""The decode step compiled by inductor on a CPU (engine/compiled_decode.py): compiled tokens = eager tokens, the
compiled replay serves only the batches it was made for, the engine serves while it compiles, and a compile that
fails leaves the engine eager with one log line. The routing tests swap the compiler for an eager stand-in (fast);
the real inductor compile is slow."""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

import engine.compiled_decode as cd
import model.decode_attention as decode_attention
import model.linear as L
from engine.compiled_attention import ATTENTION
from engine.core import EngineCore
from engine.params import SamplingParams
from engine.request import EngineRequest
from model.gpt import GPT
from model.kv_cache import KVCache
from tests.helpers import force_cpu, run_alone_or_together, tiny_model

# (prompt, temperature, top_p, top_k, seed)
REQUESTS = [(list(range(5, 17)), 0.0, None, 0, 1), (list(range(9, 30)), 0.8, 0.9, 0, 7),
            (list(range(3, 8)), 1.0, None, 0, 3), (list(range(20, 26)), 0.9, 0.95, 40, 5)]


def make_core(compile: str, wait: bool = True, **kw) -> EngineCore:
    core = EngineCore(tiny_model(0, vocab_size=96, block_size=64), n_slots=4, vocab_size=96, prepack=True,
                      compile=compile, **kw)
    core.warmup()
    if wait:
        core.wait_compiled(600)
    return core


def run(core: EngineCore, together: bool) -> dict[str, list[int]]:
    """The requests one at a time (batch 1 throughout), or all at once (batch 3)."""
    return run_alone_or_together(core, [
        EngineRequest(str(i), prompt, SamplingParams(max_new_tokens=24, temperature=t, top_p=top_p or 1.0,
                                                     top_k=top_k), seed=seed)
        for i, (prompt, t, top_p, top_k, seed) in enumerate(REQUESTS)], together)


def stand_in_compiler(monkeypatch, calls: list, shift: float = 0.0, error: Exception | None = None) -> dict:
    """AOTInductor swapped for an eager stand-in: a "package" is a file naming its bucket, and loading it gives the
    eager `Step` it was made from, counted (and shifted by `shift`, or raising `error` when building, to stand for a
    wrong or failing compile). Returns the packages built, by file name."""
    built: dict = {}

    def build(step, example, path, store):
        if error is not None:
            raise error
        path.write_text("stand-in package")
        built[path.name] = step
        return {}  # no constants

    def load(path, constants):
        if path.read_text() != "stand-in package":
            raise RuntimeError("PytorchStreamReader failed reading zip archive")
        step = built[path.name]

        def run(*args):
            calls.append((args[0].size(0), step.kind if args[0].size(1) == 1 else (cd.VERIFY, args[0].size(1))))
            out = step(*args)
            return out + shift if step.kind is None else out

        return run

    monkeypatch.setattr(cd, "build_package", build)
    monkeypatch.setattr(cd, "load_step", load)
    return built


@pytest.fixture(autouse=True)
def compile_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cd, "default_cache_dir", lambda: tmp_path / "compiled")
    return tmp_path / "compiled"


def test_the_compiled_step_serves_the_batches_it_was_made_for_and_eager_the_rest(monkeypatch):
    calls: list = []
    stand_in_compiler(monkeypatch, calls)
    core = make_core("on", compile_max_batch=1)
    assert core.stats()["compiled_decode"] and core.compile_seconds is not None
    packed = [m for m in core.model.modules() if isinstance(m, L.PackedLinear)]
    if L.ONEDNN_LINEAR is not None:  # eager keeps oneDNN's packed copies; the plain ones go once compiled from
        assert packed and all(m.weight is None for m in packed)
    made = len(calls)
    alone = run(core, together=False)
    assert len(calls) - made == sum(len(v) - 1 for v in alone.values())  # every batch-1 decode step replayed
    # greedy, T = 1 and T = 0.8 with top-p 0.9 draw inside the step (engine/plain_draw.py)
    assert {kind for _, kind in calls[made:]} == {"greedy", "sample", "sample_sharpened", "top_k"}
    made = len(calls)
    batched = run(core, together=True)
    assert len(calls) == made  # four rows decoding together: above the compiled batch, eager
    eager = run(make_core("off"), together=False)
    assert alone == eager and batched == eager  # seeded and greedy requests: the same tokens alone or batched


def test_the_engine_serves_while_the_step_compiles_and_swaps_it_in_between_steps(monkeypatch):
    calls: list = []
    release = threading.Event()
    stand_in_compiler(monkeypatch, calls)
    inner = cd.CompiledDecode.compile_all

    def slow_compile(self):
        release.wait(30)
        inner(self)

    monkeypatch.setattr(cd.CompiledDecode, "compile_all", slow_compile)
    core = make_core("on", wait=False)
    assert core.stats()["compiling"] and not core.stats()["compiled_decode"]
    first = run(core, together=False)  # served eagerly while the compiler runs
    assert calls == []
    release.set()
    assert core.wait_compiled(30)
    assert run(core, together=False) == first and calls


def test_the_decode_step_and_the_attention_compile_one_at_a_time(monkeypatch):
    """Dynamo traces one thing at a time: the two background compiles at once made the export fail on the bundled
    model ("'GraphModule' object has no attribute '_in_spec'"), so every server decoded eagerly."""
    spans: dict = {}
    stand_in_compiler(monkeypatch, [])
    inner, real_build = cd.CompiledDecode.compile_all, decode_attention.build

    def timed_compile(self):
        t = time.perf_counter()
        time.sleep(0.3)  # long enough for the attention's thread to start meanwhile
        inner(self)
        spans["decode"] = (t, time.perf_counter())

    def timed_build(*args):
        t = time.perf_counter()
        fn = real_build(*args)
        spans["attention"] = (t, time.perf_counter())
        return fn

    monkeypatch.setattr(cd.CompiledDecode, "compile_all", timed_compile)
    monkeypatch.setattr(decode_attention, "build", timed_build)
    core = make_core("on")
    assert core.stats()["compiled_decode"] and core.stats()["compiled_attention"]
    (a0, a1), (b0, b1) = sorted(spans.values())
    assert a1 <= b0, spans


def test_a_compile_that_fails_leaves_the_engine_eager_with_one_log_line(monkeypatch, caplog):
    stand_in_compiler(monkeypatch, [], error=RuntimeError("InductorError: no C++ compiler"))
    with caplog.at_level(logging.WARNING, logger="engine.core"):
        core = make_core("on")
    assert not core.stats()["compiled_decode"] and core.warmup_error is None
    lines = [r.getMessage() for r in caplog.records if "not compiled" in r.getMessage()]
    assert lines == ["decode step not compiled (RuntimeError: InductorError: no C++ compiler); decoding eagerly"]
    assert run(core, together=False) == run(make_core("off"), together=False)


def test_a_compiled_step_not_kept_is_freed_and_its_pages_given_back(monkeypatch):
    """A step that is not kept (it differs, failed, or timed no faster) must not stay resident: freed memory stays
    mapped in the core (engine.heap.keep_freed_memory), and GPT-2 int4's rejected packages held 2.2 GB of a server."""
    import weakref

    import engine.runner as runner

    stand_in_compiler(monkeypatch, [], shift=1.0)
    made: list = []
    start = cd.CompiledDecode.start
    monkeypatch.setattr(cd.CompiledDecode, "start", lambda self: (made.append(weakref.ref(self)), start(self))[1])
    trims: list = []  # at each trim: whether every compiled step made is gone
    monkeypatch.setattr(runner, "release_freed_memory", lambda: trims.append(all(r() is None for r in made)))
    core = make_core("on")
    assert not core.stats()["compiled_decode"] and made
    assert trims and trims[-1], trims


def test_a_compiled_step_that_differs_from_eager_is_dropped(monkeypatch, caplog):
    stand_in_compiler(monkeypatch, [], shift=1.0)
    with caplog.at_level(logging.WARNING, logger="engine.core"):
        core = make_core("on")
    assert not core.stats()["compiled_decode"]
    assert any("differs from eager" in r.getMessage() for r in caplog.records)


def test_auto_compiles_fp32_and_quantized_models_on_a_cpu_only(monkeypatch):
    force_cpu(monkeypatch, capability="AVX512", flags=frozenset({"avx2", "avx512f", "avx512_vnni"}))
    small = tiny_model(0, vocab_size=96, block_size=64)
    cpu = torch.device("cpu")
    assert cd.resolve_mode("auto", small, cpu, torch.float32, "none") == "on"
    assert cd.resolve_mode("auto", small, cpu, torch.bfloat16, "none") == "off"
    assert cd.resolve_mode("auto", small, cpu, torch.float32, "int4") == "on"  # quantized too: counted as loaded
    assert cd.resolve_mode("on", small, torch.device("meta"), torch.float32, "none") == "off"  # not a CPU
    with torch.device("meta"):  # GPT-2 124M's shape: 85M block parameters
        from model.config import GPTConfig
        from model.gpt import GPT

        gpt2 = GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768))
    # fp32 and quantized weights of any size (kept where faster, engine.compile_gate): a quantized step computes
    # eager's bits (Step.exact)
    assert cd.resolve_mode("auto", gpt2, cpu, torch.float32, "none") == "on"
    assert cd.resolve_mode("auto", gpt2, cpu, torch.float32, "none", torch.float32) == "on"
    assert cd.resolve_mode("auto", gpt2, cpu, torch.bfloat16, "none") == "off"
    for kv in (torch.bfloat16, torch.float16):  # over a 16-bit cache GPT-2's step failed the install check
        assert cd.resolve_mode("auto", gpt2, cpu, torch.float32, "none", kv) == "off"
        assert cd.resolve_mode("auto", small, cpu, torch.float32, "none", kv) == "on"  # the bundled model's installs
        assert cd.resolve_mode("on", gpt2, cpu, torch.float32, "none", kv) == "on"
    for fmt in ("int8", "int4"):
        assert cd.resolve_mode("auto", gpt2, cpu, torch.float32, fmt) == "on"
        assert cd.resolve_mode("auto", gpt2, cpu, torch.float32, fmt, torch.bfloat16) == "on"
    for fmt in ("none", "int8", "int4"):
        assert cd.resolve_mode("on", gpt2, cpu, torch.float32, fmt) == "on"


@pytest.mark.parametrize("capability, flags, twin", [
    ("AVX512", {"avx512f", "avx512_vnni"}, L.Int8Traced),  # Zen 4: inductor's int8 GEMM over VNNI, 2.1x eager
    ("AVX512", {"avx512f", "amx_int8", "avx512_vnni"}, L.Int8Traced),
    ("AVX2", {"avx2", "fma"}, L.Int8Extern),  # Zen 3: inductor's GEMM 2.8x slower than eager; fbgemm's called
    ("AVX2", {"avx2", "avx512_vnni"}, L.Int8Extern),  # an AVX-512 CPU capped at AVX2 (ATEN_CPU_CAPABILITY)
    ("AVX512", {"avx512f"}, L.Int8Extern),  # AVX-512 without VNNI
])
def test_auto_compiles_int8_wherever_fbgemm_serves_it_with_the_cpu_s_twin(monkeypatch, capability, flags, twin):
    """int8 compiles on every CPU where fbgemm serves it eagerly (auto then keeps the step where it times faster):
    its matmuls as inductor's int8 GEMM where the CPU has int8 dot products, else fbgemm's own kernel called from
    the step (before that twin, AVX2 hosts did not compile int8: a 21-minute compile of a 2.8x slower step)."""
    force_cpu(monkeypatch, capability=capability, flags=frozenset(flags))
    model, cpu = tiny_model(0, vocab_size=96, block_size=64), torch.device("cpu")
    for mode in ("auto", "on"):
        for fmt in ("int8", "int4", "none"):
            assert cd.resolve_mode(mode, model, cpu, torch.float32, fmt) == "on"
    L.convert(model, "int8")
    assert {type(m) for m in cd.plain_twin(model).modules()} >= {twin, L.Int8Table}
    force_cpu(monkeypatch, capability=capability, flags=frozenset(flags), fbgemm=False)
    assert cd.resolve_mode("auto", model, cpu, torch.float32, "int8") == "off"


def slow_stand_in(monkeypatch, delay: float) -> list:
    """The stand-in compiler (eager steps) with `delay` seconds added to every compiled call: a compiled step
    slower than eager."""
    calls: list = []
    stand_in_compiler(monkeypatch, calls)
    load = cd.load_step

    def slow_load(path, constants):
        run = load(path, constants)

        def slow(*args):
            time.sleep(delay)
            return run(*args)

        return slow

    monkeypatch.setattr(cd, "load_step", slow_load)
    return calls


def test_auto_drops_a_compiled_step_slower_than_eager_with_one_log_line(monkeypatch, caplog):
    slow_stand_in(monkeypatch, 0.02)
    with caplog.at_level(logging.WARNING, logger="engine.core"):
        core = make_core("auto")
    stats = core.stats()
    assert not stats["compiled_decode"] and core.warmup_error is None
    timing = stats["compile_timing"]
    assert timing["compiled_ms"] >= 20 > timing["eager_ms"] and not timing["kept"] and timing["length"] == 63
    lines = [r.getMessage() for r in caplog.records if "no faster" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("the compiled decode step is no faster than eager here (")
    assert run(core, together=False) == run(make_core("off"), together=False)


def test_on_keeps_the_compiled_step_untimed(monkeypatch):
    """`on` is the user's choice: the step is not timed, and kept however slow."""
    calls = slow_stand_in(monkeypatch, 0.02)
    core = make_core("on")
    assert core.stats()["compiled_decode"] and core.stats()["compile_timing"] is None
    n = len(calls)
    run(core, together=False)
    assert len(calls) > n


def test_auto_keeps_a_compiled_step_faster_than_eager(monkeypatch):
    """The eager step made slower instead (the tiny model's compiled stand-in is the eager step itself): auto keeps
    the compiled steps, which serve the requests their tokens."""
    import engine.compile_gate as gate

    forward = gate.GPT.forward_cached

    def slow_eager(self, *args, **kw):
        time.sleep(0.02)
        return forward(self, *args, **kw)

    calls: list = []
    stand_in_compiler(monkeypatch, calls)
    with monkeypatch.context() as m:
        m.setattr(gate.GPT, "forward_cached", slow_eager)  # during the timing only
        core = make_core("auto")
    timing = core.stats()["compile_timing"]
    assert core.stats()["compiled_decode"] and timing["kept"] and timing["eager_ms"] >= 20 > timing["compiled_ms"]
    n = len(calls)
    assert run(core, together=False) == run(make_core("off"), together=False) and len(calls) > n


def test_a_compile_that_would_not_fit_in_memory_is_not_started_but_a_cached_one_loads(monkeypatch, caplog):
    import engine.compile_gate as gate

    built = stand_in_compiler(monkeypatch, [])
    monkeypatch.setattr(gate, "available_memory", lambda device: 2**29)  # 0.5 GiB: the compile needs more
    with caplog.at_level(logging.WARNING, logger="engine.core"):
        core = make_core("on")
    assert not core.stats()["compiled_decode"] and not built  # nothing compiled, the engine eager
    lines = [r.getMessage() for r in caplog.records if "not compiled" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("decode step not compiled (CompileMemoryError: its compile needs about ")
    assert lines[0].endswith(", 0.50 GiB available); decoding eagerly")
    assert run(core, together=False) == run(make_core("off"), together=False)
    monkeypatch.setattr(gate, "available_memory", lambda device: 2**40)
    assert make_core("on").stats()["compile_source"] == "compiled" and built
    monkeypatch.setattr(gate, "available_memory", lambda device: 2**29)  # a load needs no compile's memory
    core = make_core("on")
    assert core.stats()["compiled_decode"] and core.stats()["compile_source"] == "cache"

def test_int8_compiles_only_where_fbgemm_serves_it(monkeypatch):
    """Elsewhere eager int8 is the weight-only kernel over bf16 activations, which the twin does not round as."""
    force_cpu(monkeypatch, fbgemm=False)
    assert cd.resolve_mode("on", tiny_model(0, vocab_size=96, block_size=64), torch.device("cpu"), torch.float32,
                           "int8") == "off"


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_steps_compile_from_their_traceable_twins(monkeypatch, quantize):
    """int8 / int4 weights: the stand-in compiler runs the twin the export traces (model.linear's `traceable`:
    int8 as the quantization ops inductor fuses, its weights read back from fbgemm's copies), so the install check
    compares that twin with the served layers, and seeded requests get the eager tokens alone or batched."""
    if quantize == "int8" and not L.cpu_support.support().fbgemm:
        pytest.skip("int8 compiles where fbgemm serves it")
    calls: list = []
    built = stand_in_compiler(monkeypatch, calls)
    core = make_core("on", quantize=quantize)
    assert core.stats()["compiled_decode"]
    twin = next(iter(built.values())).model
    kinds = {type(m) for m in twin.modules()}
    int8_twin = L.Int8Traced if L.cpu_support.support().int8_dot else L.Int8Extern  # inductor's GEMM, or fbgemm's
    assert (int8_twin in kinds) and (L.Int4Traced in kinds) == (quantize == "int4") and L.Int8Table in kinds
    alone = run(core, together=False)
    assert calls
    eager = run(make_core("off", quantize=quantize), together=False)
    assert alone == eager and run(core, together=True) == eager


def test_bad_modes_are_refused():
    with pytest.raises(ValueError, match="compile must be one of off, on, auto"):
        EngineCore(tiny_model(0, vocab_size=96, block_size=64), n_slots=2, vocab_size=96, compile="maybe")


@pytest.mark.slow  # real AOTInductor compiles (max_autotune), 5 packages: ~2-5 min on 2 CPU cores
def test_compiled_tokens_equal_eager_tokens_and_a_restart_loads_them():
    core = make_core("on")
    assert core.stats()["compiled_decode"] and core.stats()["compile_source"] == "compiled"
    eager = run(make_core("off"), together=False)
    assert run(core, together=False) == eager  # greedy, T = 1 and top-p drawn inside the step
    assert run(core, together=True) == eager
    again = make_core("on")
    assert again.stats()["compile_source"] == "cache" and again.compile_seconds < 30
    assert run(again, together=False) == eager


@pytest.mark.slow  # real AOTInductor compiles: 5 decode packages and 2 verification passes, ~3-5 min on 2 CPU cores
def test_compiled_verification_passes_give_the_tokens_of_plain_decoding():
    """n-gram speculation verified through compiled passes (k = 4: widths 3 and 5, their logits the eager pass's
    at install) emits the tokens of eager decoding without speculation, greedy and seeded sampled."""
    from engine.spec_decode import parse_speculative

    spec = make_core("on", speculative=parse_speculative("ngram", k=4))
    assert spec.stats()["compiled_decode"] and spec._compiled.verify_widths == (3, 5)
    requests = [([72] * 20, 0.0, 1), ([5, 6, 7, 8] * 6, 0.0, 2), ([72] * 12 + [5, 6] * 6, 0.8, 3)]
    out: dict = {}
    for name, core in (("spec", spec), ("plain", make_core("off"))):
        for i, (prompt, t, seed) in enumerate(requests):  # one at a time: the batch the compiled passes serve
            core.add(EngineRequest(str(i), prompt, SamplingParams(max_new_tokens=24, temperature=t), seed=seed))
            while core.has_work():
                for o in core.step():
                    out.setdefault(name, {}).setdefault(o.request_id, []).extend(o.token_ids)
    assert spec.stats()["speculative"]["verify_steps"] > 0
    assert out["spec"] == out["plain"]


@pytest.mark.slow  # real AOTInductor compiles of the int8 / int4 twins, 5 packages each: ~1-2 min
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["kv-fp32", "kv-bf16"])
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_compiled_quantized_tokens_equal_eager_tokens(quantize, kv_dtype):
    """Over the fp32 cache and the bf16 one (the server's default beside quantized weights on a CPU:
    engine.build.resolve_kv_dtype)."""
    if quantize == "int8" and not L.cpu_support.support().fbgemm:
        pytest.skip("int8 compiles where fbgemm serves it")
    core = make_core("on", quantize=quantize, kv_dtype=kv_dtype)
    assert core.stats()["compiled_decode"] and core.stats()["compile_source"] == "compiled"
    assert core.cache.k[0].dtype == kv_dtype
    eager = run(make_core("off", quantize=quantize, kv_dtype=kv_dtype), together=False)
    assert run(core, together=False) == eager and run(core, together=True) == eager


@pytest.mark.slow  # real AOTInductor compiles of a GPT-2-wide int8 (both twins) and int4 step, a package each: ~1-4 min
@pytest.mark.parametrize("quantize", ["int8-traced", "int8-extern", "int4"])
def test_a_compiled_quantized_step_gives_the_eager_step_s_logits_bit_for_bit(quantize, tmp_path, monkeypatch):
    """A quantized model's compiled step (Step.exact) computes what the eager step computes, bit for bit, step after
    step: fbgemm's int8 rows (model.linear.Int8Traced), ATen's layer norms and GELU (`_eager_norms`) and the eager
    step's attention (model.decode_attention.attend_as_eager: the cache's compiled loops, SDPA before them). Within
    ulps was not enough: int8 rounds an activation near a tie a whole step the other way, and seeded GPT-2 int8
    streams left the eager tokens after 11-24 of 128; a 2-layer GPT-2-wide int8 step compiled without Step.exact
    differed from eager on 87 of these 180 steps (docs/performance.md). Both int8 twins whatever the CPU: inductor's
    int8 GEMM (Int8Traced, the twin of CPUs with int8 dot products) and fbgemm's kernel called from the step
    (Int8Extern, the others')."""
    if quantize.startswith("int8") and not L.cpu_support.support().fbgemm:
        pytest.skip("int8 compiles where fbgemm serves it")
    if quantize.startswith("int8"):
        extern = quantize == "int8-extern"
        monkeypatch.setattr(L.Int8Linear, "traceable", functools.partialmethod(L.Int8Linear.traceable, extern))
        monkeypatch.setattr(L.Int8Embedding, "traceable", functools.partialmethod(L.Int8Embedding.traceable, extern))
    quantize = quantize[:4]
    from model.config import GPTConfig
    from model.gpt import GPT
    from model.kv_cache import KVCache

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=2048, block_size=256, n_layer=2, n_head=12, n_embd=768)).eval()
    L.convert(model, quantize, keep_plain=True)
    cache = KVCache(model.config, 2, 256)
    compiled = cd.CompiledDecode(model, cache, 1, contexts=(256,), cache_dir=tmp_path)
    with torch.inference_mode():
        compiled.compile_all()
    g = torch.Generator().manual_seed(1)
    for attention in ("sdpa", "loops"):
        if attention == "loops":
            cache.decode_attention = decode_attention.build(cache.k[0])
        with torch.inference_mode():
            for prompt_len in (20, 50, 80):
                cache.reset(0)
                model.forward_cached(torch.randint(0, 2048, (1, prompt_len), generator=g), cache, [0])
                token = torch.randint(0, 2048, (1,), generator=g)
                for _ in range(30):
                    n = cache.lengths[0]
                    got = compiled(token, 1)
                    cache.truncate(0, n)
                    want = model.forward_cached(token[:, None], cache, [0])
                    assert torch.equal(got, want), (attention, prompt_len, n)
                    token = want.argmax(-1)


def test_eager_norms_leave_inductor_s_tables_as_they_were():
    """The fallbacks a quantized step's compile registers for layer norm and GELU are undone after it: a later
    compile (an fp32 step, the decode attention) decomposes them as inductor does."""
    from torch._inductor import decomposition, lowering

    def state():
        return (decomposition.select_decomp_table().copy(), dict(lowering.lowerings), set(lowering.fallbacks),
                set(lowering.needs_realized_inputs))

    before = state()
    with cd._eager_norms():
        table = decomposition.select_decomp_table()
        assert all(op not in table and op in lowering.lowerings and op in lowering.fallbacks for op in cd.EAGER_OPS)
    assert state() == before


def test_a_step_attends_as_eager_only_for_quantized_weights():
    """Step.exact (ATen's norms, the eager attention) where int8 / int4 rounding would amplify an ulp; fp32 steps
    keep inductor's fused norms and attention (their ulps stay ulps: compiled = eager tokens, the slow tests)."""
    assert not cd.Step(tiny_model(0, vocab_size=96, block_size=64), 64, 64, None, 0, 0).exact
    for fmt in ("int8", "int4") if L.cpu_support.support().fbgemm else ("int4",):
        model = tiny_model(0, vocab_size=96, block_size=64)
        L.convert(model, fmt, keep_plain=True)
        assert cd.Step(model, 64, 64, None, 0, 0).exact and cd.Step(cd.plain_twin(model), 64, 64, None, 0, 0).exact
        # so no verification pass (several tokens a row) compiled for them
        assert cd.CompiledDecode(model, KVCache(model.config, 1), 1, verify_most=9).verify_widths == ()
    model = tiny_model(0, vocab_size=96, block_size=64)
    assert cd.CompiledDecode(model, KVCache(model.config, 1), 1, verify_most=9).verify_widths == (3, 5, 9)


def test_verification_passes_come_in_widths_a_proposal_pads_to():
    """A proposal starts at 2 tokens and doubles while it holds (engine/spec_decode), and a pass costs about its
    width in one-row steps on a CPU: passes of 3, 5, 9, ... positions, and the widest the speculation asks for."""
    assert cd.verify_widths(9) == (3, 5, 9) and cd.verify_widths(16) == (3, 5, 9, 16)
    assert cd.verify_widths(3) == (3,) and cd.verify_widths(2) == (2,) and cd.verify_widths(0) == ()


def test_a_restart_loads_the_compiled_steps_from_the_cache_keyed_by_what_they_depend_on(monkeypatch, caplog,
                                                                                     compile_cache):
    stand_in_compiler(monkeypatch, [])
    builds: list = []
    build = cd.build_package
    monkeypatch.setattr(cd, "build_package", lambda *a: builds.append(a[2].name) or build(*a))
    first = make_core("on")
    assert first.stats()["compile_source"] == "compiled" and len(builds) == 5  # logits + 4 plain kinds
    # the steps' folders (beside engine.cpu_tuning's file and engine.compiled_attention's packages)
    folders = lambda: [p for p in compile_cache.iterdir()  # noqa: E731
               if p.is_dir() and p.name not in (ATTENTION, cd.ISA_PROBE)]
    assert [p.name for p in folders()] == [first._compiled.folder.name]  # a folder per key
    again = make_core("on")  # the same weights, CPU, threads and torch: loaded, not built
    assert again.stats()["compile_source"] == "cache" and len(builds) == 5 and again.stats()["compiled_decode"]
    assert run(again, together=False) == run(make_core("off"), together=False)

    package = next(p for p in folders()[0].iterdir() if p.suffix == ".so")
    package.write_bytes(b"\0garbage")  # a corrupt package: compiled again, one log line
    with caplog.at_level(logging.WARNING, logger="engine.compiled_decode"):
        mended = make_core("on")
    assert mended.stats()["compile_source"] == "compiled" and len(builds) == 10
    assert [r.getMessage().split(" (")[-1] for r in caplog.records if "do not load" in r.getMessage()] == [
        "RuntimeError: PytorchStreamReader failed reading zip archive); compiling them again"]

    monkeypatch.setattr(torch, "__version__", "0.0.0-another")  # another torch (or CPU, threads, weights): a new key
    make_core("on")
    assert len(builds) == 15 and len(folders()) == 2
    other = tiny_model(1, vocab_size=96, block_size=64)  # other weights
    core = EngineCore(other, n_slots=4, vocab_size=96, prepack=True, compile="on")
    core.warmup()
    core.wait_compiled(60)
    assert len(builds) == 20 and len(folders()) == 3


def test_the_key_reads_the_traced_code_not_its_comments_or_docstrings():
    code = 'def f(x):\n    """Doc."""\n    return x + 1  # one\n'
    assert cd.code_digest(code) == cd.code_digest('\n# a note\ndef f(x):\n    """Other words."""\n\n    return x + 1\n')
    assert cd.code_digest(code) != cd.code_digest(code.replace("x + 1", "x + 2"))
    assert cd.code_digest('class A:\n    """Doc."""\n') == cd.code_digest("class A:\n    pass\n")


def test_installed_steps_hold_their_folder_and_prune_the_cache_s_stale_ones(monkeypatch, compile_cache):
    """engine.compile_cache at install: the folder serving is held in use; a folder nobody used for a month goes,
    in the background."""
    import os
    import time

    from engine.compile_cache import MAX_IDLE_DAYS, SETUP, USED, _in_use, setup_of
    from engine.compiled_decode import MANIFEST

    stale = compile_cache / "0123456789abcdef01234567"  # a key folder nobody used for a month
    stale.mkdir(parents=True)
    (stale / MANIFEST).write_text("{}")
    (stale / USED).touch()
    old = time.time() - (MAX_IDLE_DAYS + 1) * 86400
    os.utime(stale / USED, (old, old))
    stand_in_compiler(monkeypatch, [])
    core = make_core("on")
    assert core.stats()["compiled_decode"]
    assert core.runner.pruning.wait(30) and core.runner.pruning.result == [stale] and not stale.exists()
    assert _in_use(core._compiled.folder)
    # its setup recorded beside it, so a prune by another configuration of these weights leaves it
    assert (core._compiled.folder / SETUP).read_text() == setup_of(core._compiled, core.runner.weights)
    os.close(core.runner.cache_lock)
    assert not _in_use(core._compiled.folder)


def test_an_unwritable_compile_cache_compiles_for_the_process_with_one_log_line(monkeypatch, caplog, tmp_path):
    stand_in_compiler(monkeypatch, [])
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setattr(cd, "default_cache_dir", lambda: blocked / "compiled")
    at_exit: list = []
    register = cd.atexit.register  # still registered: seen here as well

    def seen(fn, *args):
        at_exit.append((fn, args))
        return register(fn, *args)

    monkeypatch.setattr(cd.atexit, "register", seen)
    with caplog.at_level(logging.WARNING, logger="engine.compiled_decode"):
        core = make_core("on")
    assert core.stats()["compiled_decode"] and core.stats()["compile_source"] == "compiled"
    lines = [r.getMessage() for r in caplog.records if "not writable" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"compile cache {blocked / 'compiled'} is not writable")
    assert run(core, together=False) == run(make_core("off"), together=False)
    # the process's own folder goes with it (GPT-2's packages: 0.68 GB a start left in /tmp otherwise)
    folder = core._compiled.folder.parent
    ours = [(fn, args) for fn, args in at_exit if args and args[0] == folder]  # (torch registers its own too)
    assert folder.name.startswith("gpt-serve-compiled-") and folder.is_dir() and len(ours) == 1
    fn, args = ours[0]
    fn(*args)
    assert not folder.exists()


def spec_and_plain(monkeypatch, prompt: list[int], new_tokens: int) -> tuple[EngineCore, list, dict]:
    """A greedy request served with n-gram speculation and compiled steps (the stand-in compiler), and without
    either: (the speculating core, the compiled calls it made serving, each core's tokens)."""
    from engine.spec_decode import parse_speculative

    calls: list = []
    stand_in_compiler(monkeypatch, calls)
    spec = make_core("on", speculative=parse_speculative("ngram"))
    plain = make_core("off")
    made = len(calls)  # the install's check called every step once
    out: dict = {}
    for name, core in (("spec", spec), ("plain", plain)):
        core.add(EngineRequest(name, prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0.0), seed=1))
        while core.has_work():
            for o in core.step():
                out.setdefault(name, []).extend(o.token_ids)
    return spec, calls[made:], out


def test_speculation_verifies_one_row_through_the_compiled_pass(monkeypatch, caplog, default_spec_prices):
    """One row's verification passes compiled beside the decode steps (up to 1 + k positions, each context bucket;
    the start-up log says so): the speculating core verifies through them, never eagerly, and emits the tokens of
    plain decoding. A proposal fills the narrowest pass that holds it (one token for two at the same price)."""
    caplog.set_level(logging.INFO, logger="engine.core.runner")
    eager_passes: list = []
    forward_cached = GPT.forward_cached
    monkeypatch.setattr(GPT, "forward_cached", lambda self, idx, *a, all_logits=False, **kw: (
        eager_passes.append(idx.shape) if all_logits else None, forward_cached(self, idx, *a, all_logits=all_logits,
                                                                                **kw))[1])
    # a repeating prompt: the n-gram proposer has something to propose
    spec, calls, out = spec_and_plain(monkeypatch, [5, 6, 7, 8] * 6, 20)
    assert spec._compiled.verify_widths == (3, 5, 9)  # up to 1 + the n-gram's k
    assert "verification passes of 3/5/9 positions" in caplog.text
    assert spec.stats()["speculative"]["verify_steps"] > 0
    assert eager_passes == [(1, 9)]  # the warm-up's, before the compile: none serving
    passes = [kind for b, kind in calls if kind != "greedy"]
    assert passes and all(b == 1 for b, _ in calls) and {w for _, w in passes} <= {3, 5, 9}
    assert (cd.VERIFY, 3) in passes  # a proposal's first 2 tokens: the narrowest pass, not the widest
    assert out["spec"] == out["plain"]
    assert [spec._compiled.fill(k) for k in range(1, 10)] == [2, 2, 4, 4, 8, 8, 8, 8, 9]
    fills: list = []
    propose = spec.speculator.propose
    monkeypatch.setattr(spec.speculator, "propose", lambda ids, limits, fill=None: (fills.append(fill),
                                                                                   propose(ids, limits, fill))[1])
    spec.add(EngineRequest("again", [5, 6, 7, 8] * 6, SamplingParams(max_new_tokens=12, temperature=0.0), seed=1))
    while spec.has_work():
        spec.step()
    assert fills and all(f == spec._compiled.fill for f in fills)  # the core's proposals fill its compiled passes
    priced = spec.speculator.costs._verify  # and each pass is priced by the width that ran
    assert priced and set(priced) <= {(1, 3), (1, 5), (1, 9)}


@pytest.mark.parametrize("prompt_len, widths", [(58, {3, 5}), (62, set())])
def test_near_the_end_of_its_slot_a_row_verifies_in_the_passes_that_fit_or_not_at_all(monkeypatch, prompt_len,
                                                                                     widths, default_spec_prices):
    """A pass's positions, its padding's too, must fit the slot (one past it would be clamped onto a live entry):
    a row proposes only what the widest pass that fits takes, and where none fits decodes one token a step through
    the compiled step, never eagerly verified (~4x a compiled step)."""
    spec, calls, out = spec_and_plain(monkeypatch, [72] * prompt_len, 64 - prompt_len)  # the tiny model's 72s
    used = {kind[1] for _, kind in calls if kind != "greedy"}
    assert used <= widths and bool(used) == bool(widths) and out["spec"] == out["plain"]
    assert (spec.stats()["speculative"]["verify_steps"] > 0) == bool(widths)


class _Shifted(torch.nn.Module):
    """Two Linears and a shift: the packages of one model differ in their graphs, not in their weights."""

    def __init__(self, net: torch.nn.Module, shift: float) -> None:
        super().__init__()
        self.net, self.shift = net, shift

    def forward(self, x):
        return self.net(x) + self.shift


def test_a_compile_leaves_nothing_in_inductor_s_own_cache_folder(monkeypatch, compile_cache):
    """inductor keeps a copy of every package's frozen weights in its cache folder (GPT-2: 15 x 0.63 GB in
    /tmp/torchinductor_<user> a compile): the packages are built with a folder of their own, deleted after."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    before = cache_dir()
    built = stand_in_compiler(monkeypatch, [])
    seen: list[str] = []
    build = cd.build_package

    def build_recording(step, example, path, store):
        seen.append(cache_dir())
        Path(seen[-1], "weights.blob").write_bytes(b"a frozen copy")
        return build(step, example, path, store)

    monkeypatch.setattr(cd, "build_package", build_recording)
    core = make_core("on")
    assert core.stats()["compile_source"] == "compiled" and len(seen) == len(built) == 5
    assert len(set(seen)) == 1 and Path(seen[0]).parent == compile_cache and not Path(seen[0]).exists()
    assert cache_dir() == before
    assert {p.name for p in compile_cache.iterdir()} <= {core._compiled.folder.name, "kernels.json", ATTENTION,
                                                          cd.ISA_PROBE}


def test_inductor_s_isa_probe_is_built_once_a_machine(monkeypatch, tmp_path):
    """inductor's vector-ISA check (a g++ build per ISA) keeps its builds in the compile cache's ISA_PROBE folder, so a
    later process (a restart) builds none: inside a compile's scratch folder every start built them again, and a
    cached attention package's load waited 11-22 s for them beside a serving engine."""
    from torch._inductor import cpp_builder
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    before = cache_dir()
    builds: list[str] = []
    real = cpp_builder.CppBuilder.build

    def counted(self):
        builds.append(self.get_target_file_path())
        return real(self)

    first_list = valid_vec_isa_list()  # (where this process checked first: not counted)
    if not first_list:
        pytest.skip("inductor finds no vector ISA to check on this CPU")
    monkeypatch.setattr(cpp_builder.CppBuilder, "build", counted)
    try:
        for start in range(2):  # two processes' first calls (the list is cached in a process)
            valid_vec_isa_list.cache_clear()
            for klass in {k for isa in first_list for k in type(isa).__mro__}:  # each ISA's checks, cached per class
                for f in (klass.__dict__.get("__bool__"), klass.__dict__.get("_VecISA__bool__impl")):
                    getattr(f, "cache_clear", lambda: None)()
            cd.probe_vec_isa(tmp_path)
            assert [str(i) for i in valid_vec_isa_list()] == [str(i) for i in first_list]
            if start == 0:
                assert builds and all(Path(b).is_relative_to(tmp_path / cd.ISA_PROBE) for b in builds)
                first_builds = len(builds)
        assert len(builds) == first_builds  # the second process built nothing
    finally:
        valid_vec_isa_list.cache_clear()
    assert cache_dir() == before


def test_a_read_only_compile_cache_leaves_inductor_s_isa_check_where_it_was(monkeypatch, tmp_path):
    """A compile cache the server cannot write (a read-only volume): no isa-probe folder is used and the check is
    left to run where it ran before (the compile's scratch folder), instead of failing the attention's build."""
    from torch._inductor import cpu_vec_isa

    def refused():
        raise AssertionError("checked in a folder that cannot be written")

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", refused)
    monkeypatch.setattr(cd.os, "access", lambda path, mode: False)
    cd.probe_vec_isa(tmp_path)  # returns without checking


@pytest.mark.parametrize("positions", [1, 3])
def test_packages_keep_one_copy_of_their_constants(tmp_path, monkeypatch, positions):
    """Real AOTInductor (the server's options) on a small module, two packages: their frozen constants go to one
    store, each distinct tensor once, the libraries hold none, and each step computes the module's output from the
    shared copies (the same memory). The linears are offered inductor's own GEMMs only, for a decode step's one
    position and for a verification pass's several (whose options offer ATen's GEMMs to its batched matmuls): had
    autotuning picked ATen's oneDNN linear, a package would hold an opaque constant and keep its own blob (a GPT-2
    compile whose autotuning timed ATen's 768x768 matmul faster by a hair: 15 packages of 0.63 GB each, all loaded;
    a verification-shaped compile on a loaded Zen 4 whose autotuning timed the C++ micro-kernel at 32 ms). The
    choices offered are recorded, so the test does not depend on what a timing picks."""
    from torch._inductor import mkldnn_lowerings

    offered: list[tuple[str, list[str]]] = []
    select = mkldnn_lowerings.autotune_select_algorithm

    def recording(name, choices, *args, **kwargs):
        offered.append((name, [type(c).__name__ for c in choices]))
        return select(name, choices, *args, **kwargs)

    monkeypatch.setattr(mkldnn_lowerings, "autotune_select_algorithm", recording)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).eval()
    x = torch.randn(1, positions, 64)
    store = tmp_path / cd.WEIGHTS
    store.mkdir()
    names = ["s0.so", "s1.so"]
    manifest = {name: cd.build_package(_Shifted(net, i), (x,), tmp_path / name, store) for i, name in enumerate(names)}
    (tmp_path / cd.MANIFEST).write_text(__import__("json").dumps(manifest))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, cd.WEIGHTS, cd.MANIFEST])  # no .pt2 left
    digests = [{entry[0] for entry in manifest[n].values()} for n in names]
    assert digests[0] == digests[1] and len(list(store.iterdir())) == len(digests[0]) >= 2
    steps = cd.load_steps(tmp_path, names)
    with torch.no_grad():
        for i, name in enumerate(names):
            assert torch.allclose(steps[name](x), net(x) + i, atol=1e-5)
    a, b = (steps[n].constants for n in names)
    assert {c: t.data_ptr() for c, t in a.items()} == {c: t.data_ptr() for c, t in b.items()}
    linears = [kinds for name, kinds in offered if name.startswith("linear")]
    assert len(linears) == 4 and all(kinds and "ExternKernelCaller" not in kinds for kinds in linears), offered


@pytest.mark.parametrize("extern", [False, True])
def test_a_compiled_int8_row_is_fbgemm_s_row_bit_for_bit(tmp_path, extern):
    """Real AOTInductor (the server's options) over an int8 layer's traceable twin, GPT-2's MLP projection width:
    inductor's fused u8 x s8 GEMM (or where the CPU lacks int8 dot products, fbgemm's kernel called from the step:
    `extern`) returns what fbgemm's eager kernel returns, bit for bit, for rows with values a
    hair off a rounding tie (where fl(x + 64) and round(x) + 64 part). Within float rounding was not enough: GPT-2
    int8 compiled left its eager greedy tokens after 24 of 128 before the twin rounded and scaled as fbgemm does."""
    if not L.cpu_support.support().fbgemm:
        pytest.skip("int8 compiles where fbgemm serves it")
    from tests.test_linear import int8_rows_at_rounding_ties

    torch.manual_seed(0)
    m = L.Int8Linear(*L.quantize_int8(torch.randn(64, 3072) * 0.02), torch.randn(64) * 0.01, torch.float32)
    twin = m.traceable(extern).eval()
    x = int8_rows_at_rounding_ties(3072)
    store = tmp_path / cd.WEIGHTS
    store.mkdir()
    manifest = {"s.so": cd.build_package(twin, (x[:1].clone(),), tmp_path / "s.so", store)}
    (tmp_path / cd.MANIFEST).write_text(__import__("json").dumps(manifest))
    step = cd.load_steps(tmp_path, ["s.so"])["s.so"]
    with torch.no_grad():
        for row in x:
            assert torch.equal(step(row[None].clone()), m(row[None]))


def _table(*constants) -> str:
    """A wrapper's constants table as AOTInductor writes it: (name, dtype, shape, stride, bytes, layout, folded)."""
    lines = []
    for i, (name, dtype, shape, stride, size, layout, folded) in enumerate(constants):
        lines += [f'    constants_info_[{i}].name = "{name}";',
                  f"    constants_info_[{i}].dtype = cached_torch_dtype_{dtype};",
                  f"    constants_info_[{i}].offset = 0;", f"    constants_info_[{i}].data_size = {size};",
                  f"    constants_info_[{i}].from_folded = {folded};",
                  f"    constants_info_[{i}].shape = {{{', '.join(map(str, shape))}}};",
                  f"    constants_info_[{i}].stride = {{{', '.join(map(str, stride))}}};",
                  f"    constants_info_[{i}].layout = static_cast<int32_t>(cached_torch_layout_{layout});"]
    return "\n".join(lines) + "\n"


def test_a_package_blob_is_read_by_its_constants_table():
    """Two constants that share an original fqn keep their own bytes (read by name, in table order); a folded one
    takes none; an opaque one means the package keeps its blob (None); a blob that does not hold what the table
    says is an error, not a silently wrong weight."""
    a, b = torch.arange(6, dtype=torch.float32), torch.arange(4, dtype=torch.int64)
    blob = a.numpy().tobytes() + b.numpy().tobytes()
    table = _table(("constant58", "float32", [2, 3], [3, 1], 24, "strided", "false"),
                   ("folded", "float32", [1], [1], 4, "strided", "true"),
                   ("constant58_0", "int64", [4], [1], 32, "strided", "false"))
    got = cd.package_constants(table, blob)
    assert list(got) == ["constant58", "constant58_0"]
    data, dtype, shape, stride, offset = got["constant58_0"]
    assert (dtype, shape, stride, offset) == (torch.int64, [4], [1], 0)
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=dtype), b)
    assert torch.equal(torch.frombuffer(bytearray(got["constant58"][0]), dtype=torch.float32).view(2, 3), a.view(2, 3))
    assert cd.package_constants(_table(("w", "float32", [4], [1], 16, "_mkldnn", "false")), bytes(16)) is None
    with pytest.raises(ValueError, match="the constants take 56 bytes of a 60-byte blob"):
        cd.package_constants(table, blob + bytes(4))
