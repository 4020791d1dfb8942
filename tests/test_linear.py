"""Weight formats and their kernels (model/linear.py): each served Linear against F.linear on the fp32 weight, the
swap of a whole model (cached decode = its own full recompute), batch invariance, and the errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import model.linear as L
from model.config import GPTConfig
from model.cpu_support import PACKED_BF16_NEEDS, support
from model.gpt import GPT
from model.kv_cache import KVCache
from tests.helpers import force_cpu

needs_onednn = pytest.mark.skipif(L.ONEDNN_LINEAR is None, reason="this torch build has no oneDNN linear")
# the same answer model.linear.convert reads: oneDNN packs bf16 only on AVX-512 / AVX-NE-CONVERT CPUs
needs_packed_bf16 = pytest.mark.skipif(not support().packed_bf16,
                                       reason=f"oneDNN does not pack bf16 on this CPU (needs {PACKED_BF16_NEEDS})")


def small_gpt(seed: int = 0, n_embd: int = 64) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=n_embd, dropout=0.0)
    return GPT(cfg).eval()


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def layer(out_f: int = 48, in_f: int = 64, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_f, out_f)


def test_plain_linear_is_f_linear_with_the_activation():
    lin, act = layer(), torch.nn.GELU(approximate="tanh")
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(L.linear(x, lin, act), act(F.linear(x, lin.weight, lin.bias)), atol=1e-5,
                                   rtol=1e-5)
    y = L.linear(x.requires_grad_(), lin)  # a pass that needs gradients keeps autograd's F.linear
    y.sum().backward()
    assert lin.weight.grad is not None


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), pytest.param(torch.bfloat16, 2e-2,
                                                                            marks=needs_packed_bf16)])
@pytest.mark.parametrize("rows", [1, 2, 4, 17])
def test_packed_linear_equals_f_linear(rows, dtype, tol):
    lin = layer()
    ref_act = torch.nn.GELU(approximate="tanh")
    packed = L.PackedLinear(copy.deepcopy(lin).to(dtype))
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        ref = ref_act(F.linear(x, lin.weight, lin.bias))
        got = L.linear(x.to(dtype), packed, ref_act)
    assert got.dtype == dtype
    assert relerr(got, ref) < tol


@needs_onednn
def test_tune_times_from_memory_a_model_larger_than_the_cache(monkeypatch):
    """A decode step reads each weight once: tune times the kernels with cached weights only where the whole model
    fits the last-level cache, and otherwise reads a new copy each call (the cold path runs and gives a ratio)."""
    from model import cpu_support

    monkeypatch.delenv("GPT_SMALL_LINEAR", raising=False)
    seen = []
    real = L._mkl_over_onednn
    monkeypatch.setattr(L, "_mkl_over_onednn", lambda m, repeats, cold=False: seen.append(cold) or real(m, 1, cold))
    model = small_gpt()
    L.convert(model, "none", keep_plain=True)
    total = sum(m.in_features * m.out_features * 4 for m in model.modules() if isinstance(m, L.PackedLinear))
    monkeypatch.setattr(cpu_support, "last_level_cache_bytes", lambda: total + 1)
    L.tune(model)
    assert seen and not any(seen)
    seen.clear()
    monkeypatch.setattr(cpu_support, "last_level_cache_bytes", lambda: total // 8)  # a few copies of each
    L.tune(model)
    assert seen and all(seen)
    assert real(next(m for m in model.modules() if isinstance(m, L.PackedLinear)), 1, True) > 0


@needs_onednn
def test_tune_keeps_a_column_major_copy_only_where_mkl_is_chosen(monkeypatch):
    model = small_gpt()
    L.convert(model, "none")
    layers = [m for m in model.modules() if isinstance(m, L.PackedLinear)]
    assert len(layers) == 9 and all(m.column_major is None for m in layers)  # 8 block Linears and the head
    before = L.weight_bytes(model)
    monkeypatch.setenv("GPT_SMALL_LINEAR", "onednn")
    assert set(L.tune(model).values()) == {"onednn"}
    assert all(m.column_major is None for m in layers) and L.weight_bytes(model) == before
    monkeypatch.setenv("GPT_SMALL_LINEAR", "mkl")
    assert set(L.tune(model).values()) == {"mkl"}
    assert all(m.column_major is not None for m in layers) and L.weight_bytes(model) > before
    m = layers[0]
    lin = model.transformer.h[0].attn.c_attn
    assert lin is m
    x = torch.randn(1, 64)
    with torch.inference_mode():  # one row reads the copy (MKL), two rows the packed weight (oneDNN): same result
        torch.testing.assert_close(m(x), m(torch.cat([x, x]))[:1], atol=1e-5, rtol=1e-5)
    fresh = small_gpt()
    L.convert(fresh, "none")
    monkeypatch.setenv("GPT_SMALL_LINEAR", "auto")
    monkeypatch.setattr(L, "_mkl_over_onednn", lambda m, repeats, cold=False: 0.5 if m.out_features == 96 else 1.0)
    assert L.tune(fresh) == {(192, 64): "onednn", (64, 64): "onednn", (256, 64): "onednn", (64, 256): "onednn",
                             (96, 64): "mkl"}  # the timing's verdict per shape; a copy only where MKL won
    assert [m.out_features for m in fresh.modules() if isinstance(m, L.PackedLinear) and m.column_major is not None] \
        == [96]


@needs_onednn
def test_the_column_major_copy_is_the_same_from_the_plain_weight_or_the_packed_one(monkeypatch):
    monkeypatch.setenv("GPT_SMALL_LINEAR", "mkl")
    kept, unpacked = small_gpt(), small_gpt()
    plain = {n: p.detach().clone() for n, p in kept.named_parameters()}
    L.convert(kept, "none", keep_plain=True)  # the engine's way: tune copies the plain weight, then drop_plain
    L.convert(unpacked, "none")  # packed only: tune unpacks through the matmul
    L.tune(kept), L.tune(unpacked)
    L.drop_plain(kept)
    a = [m for m in kept.modules() if isinstance(m, L.PackedLinear)]
    b = [m for m in unpacked.modules() if isinstance(m, L.PackedLinear)]
    assert all(m.weight is None for m in a)
    for x, y in zip(a, b):
        assert x.column_major.stride() == y.column_major.stride() == (1, x.out_features)
        torch.testing.assert_close(x.column_major, y.column_major, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a[0].column_major, plain["transformer.h.0.attn.c_attn.weight"], atol=0, rtol=0)


def test_int8_quantization_round_trips_within_half_a_step():
    w = torch.randn(40, 64)
    q, scale = L.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64])
def test_int4_quantization_round_trips_and_packs(group):
    w = torch.randn(48, 128)
    q, scale, zero = L.quantize_int4(w, group)
    assert q.max() <= 15 and q.min() >= 0
    deq = (q.float() - 8) * scale.repeat_interleave(group, 1) + zero.repeat_interleave(group, 1)
    assert ((deq - w).abs() <= scale.repeat_interleave(group, 1) / 2 + 1e-5).all()
    assert torch.equal(L.unpack_nibbles(L.pack_nibbles(q)), q)


@pytest.mark.parametrize("fbgemm", [True, False])
def test_int8_linear_is_close_to_fp32_and_batch_invariant(fbgemm, monkeypatch):
    if fbgemm and not support().fbgemm:
        pytest.skip("no fbgemm in this torch build or CPU")
    force_cpu(monkeypatch, fbgemm=fbgemm)
    lin = layer(48, 64)
    m = L.Int8Linear(*L.quantize_int8(lin.weight), lin.bias, torch.float32)
    assert (m.fbgemm is not None) == fbgemm
    x = torch.randn(9, 64)
    with torch.inference_mode():
        y = m(x)
        assert relerr(y, F.linear(x, lin.weight, lin.bias)) < 0.03
        alone = torch.cat([m(x[i:i + 1]) for i in range(9)])
    assert torch.equal(alone, y)  # a row's result does not depend on its batch


def int8_rows_at_rounding_ties(in_f: int, rows: int = 12, seed: int = 0) -> torch.Tensor:
    """Rows as a served model feeds an int8 layer (a few outlier channels), some with values a hair above a
    quantization tie (x = k + 0.5 + 2^-20 where a row's max |x| is 63.5): fbgemm rounds fl(x + 64), landing on the
    tie (then to even), where round(x) + 64 rounds up: the case that set a compiled GPT-2 stream apart from its eager
    tokens. One row of zeros and one whose largest magnitude is negative."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_f, generator=g) * torch.rand(rows, 1, generator=g) * 3
    x[:, :3] *= 20
    x[1] = -x[1].abs()
    x[2] = 0
    for r in range(3, rows):
        x[r, 0] = 63.5 * (1 if r % 2 else -1)
        x[r, 1:3] = x[r, 1:3].clamp(-60, 60)
        x[r, 3:9] = torch.tensor([2.5, -1.5, 0.5, 40.5, -17.5, 6.5]) + 2 ** -20 * torch.tensor([1, -1, 1, 8, -4, 1])
    return x


@pytest.mark.parametrize("in_f", [64, 3072])  # 3072: GPT-2's MLP projection, int32 sums past 2^16
def test_int8_traced_twin_equals_fbgemm_bit_for_bit(in_f):
    """The compiled step's int8 matmul (quantization ops that inductor fuses into its u8 x s8 GEMM) computes
    fbgemm's eager result bit for bit: the same int8 weights read back from fbgemm's packed copy, the activations
    rounded as fbgemm rounds them (at its scale of 1: rows spanning [-63.5, 63.5]), the exact int32 sums scaled
    afterwards in the same order. Within float rounding is not enough: one activation rounded the other way changes
    a stream's tokens (issue 38). tests/test_compiled_decode.py compiles the twin and checks the same."""
    if not support().fbgemm:
        pytest.skip("no fbgemm in this torch build or CPU")
    lin = layer(64, in_f)  # outputs a multiple of 32: torch's eager GELU takes a scalar tail otherwise (rows differ)
    m = L.Int8Linear(*L.quantize_int8(lin.weight), lin.bias, torch.float32)
    q, scale = m.int8_weight()
    assert all(torch.equal(a, b) for a, b in zip((q, scale), L.quantize_int8(lin.weight)))
    twin = m.traceable(extern=False)
    x = int8_rows_at_rounding_ties(in_f)
    with torch.inference_mode():
        for act in (None, torch.nn.GELU(approximate="tanh")):
            assert torch.equal(twin(x, act), m(x, act))
            assert torch.equal(torch.cat([twin(r[None], act) for r in x]), m(x, act))


@pytest.mark.parametrize("in_f", [64, 3072])
def test_int8_extern_twin_calls_fbgemm_with_the_eager_bits(in_f):
    """Where the CPU has no int8 dot products the compiled step's int8 layer is the ops around fbgemm's matmul,
    the matmul a call of fbgemm's kernel on the layer's own packed copy (`gpt_serve::int8_matmul`, found by the
    weights' digest): rows at rounding ties give eager's bits, alone or batched, with and without the activation.
    tests/test_compiled_decode.py compiles it and checks the same."""
    if not support().fbgemm:
        pytest.skip("no fbgemm in this torch build or CPU")
    lin = layer(64, in_f)
    m = L.Int8Linear(*L.quantize_int8(lin.weight), lin.bias, torch.float32)
    twin = m.traceable(extern=True)
    assert type(twin) is L.Int8Extern and twin.weight_id == L.weights_digest(*L.quantize_int8(lin.weight), lin.bias)
    assert {n for n, _ in twin.named_buffers()} == {"digest", "bias", "pm"}  # no weights: the layer's are called
    x = int8_rows_at_rounding_ties(in_f)
    with torch.inference_mode():
        for act in (None, torch.nn.GELU(approximate="tanh")):
            assert torch.equal(twin(x, act), m(x, act))
            assert torch.equal(torch.cat([twin(r[None], act) for r in x]), m(x, act))


def test_int8_extern_names_other_weights_otherwise_and_fails_once_its_layer_is_gone():
    if not support().fbgemm:
        pytest.skip("no fbgemm in this torch build or CPU")
    a = L.Int8Linear(*L.quantize_int8(layer(48, 64, seed=0).weight), None, torch.float32)
    b = L.Int8Linear(*L.quantize_int8(layer(48, 64, seed=1).weight), None, torch.float32)
    again = L.Int8Linear(*L.quantize_int8(layer(48, 64, seed=0).weight), None, torch.float32)
    ta, tb = a.traceable(extern=True), b.traceable(extern=True)
    assert ta.weight_id != tb.weight_id and again.traceable(extern=True).weight_id == ta.weight_id
    x = torch.randn(2, 64)
    with torch.inference_mode():
        assert torch.equal(tb(x), b(x))
        del a, again
        import gc

        gc.collect()
        with pytest.raises(RuntimeError, match=f"no int8 layer with weights {ta.weight_id:x}"):
            ta(x)


def test_int8_twins_follow_the_cpu_s_int8_dot_products(monkeypatch):
    """inductor's int8 GEMM where the CPU has int8 dot products (AVX-512 VNNI / AMX), fbgemm's kernel called
    elsewhere; the tied head likewise."""
    if not support().fbgemm:
        pytest.skip("no fbgemm in this torch build or CPU")
    m = L.Int8Linear(*L.quantize_int8(layer().weight), None, torch.float32)
    emb = L.Int8Embedding(torch.randn(40, 64) * 0.1, torch.float32)
    for dot, kind in ((True, L.Int8Traced), (False, L.Int8Extern)):
        force_cpu(monkeypatch, capability="AVX512" if dot else "AVX2",
                  flags=frozenset({"avx512f", "avx512_vnni"} if dot else {"avx2", "fma"}))
        assert type(m.traceable()) is kind and type(emb.traceable()[1]) is kind


def test_int8_table_twin_looks_up_and_heads_as_the_table_does():
    if not support().fbgemm:
        pytest.skip("no fbgemm in this torch build or CPU")
    emb = L.Int8Embedding(torch.randn(40, 64) * 0.1, torch.float32)
    idx = torch.tensor([[3, 0, 39]])
    h = torch.randn(2, 64)
    for extern in (False, True):
        table, head = emb.traceable(extern)
        with torch.inference_mode():
            assert torch.equal(table(idx), emb(idx))
            assert torch.equal(head(h), emb.head(h))
        assert table.q is head.q if not extern else type(head) is L.Int8Extern  # one table for both, or fbgemm's


def test_int4_traced_twin_is_the_layer_with_its_tensors_as_buffers():
    lin = layer(48, 128)
    m = L.Int4Linear(*L.quantize_int4(lin.weight, 32), lin.bias, torch.float32, 32)
    twin = m.traceable()
    assert {n for n, _ in twin.named_buffers()} == {"packed", "scales_zeros", "bias"}  # what a compile key hashes
    x = torch.randn(3, 128)
    with torch.inference_mode():
        assert torch.equal(twin(x), m(x))


def test_int4_linear_is_close_to_fp32():
    lin = layer(48, 128)
    m = L.Int4Linear(*L.quantize_int4(lin.weight, 32), lin.bias, torch.float32, 32)
    x = torch.randn(5, 128)
    with torch.inference_mode():
        assert relerr(m(x), F.linear(x, lin.weight, lin.bias)) < 0.15
    assert m.weight_bytes() < 48 * 128  # under a byte a weight


@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
def test_converted_model_cached_decode_equals_its_own_recompute(fmt):
    model = small_gpt()
    ref = copy.deepcopy(model)
    info = L.convert(model, fmt, 32)
    assert info["format"] == fmt
    idx = torch.randint(0, 96, (3, 12))
    with torch.inference_mode():
        full, _ = model(idx)
        cache = KVCache(model.config, 3, 32)
        cached = model.forward_cached(idx[:, :7], cache, [0, 1, 2], all_logits=True)
        step = [model.forward_cached(idx[:, t:t + 1], cache, [0, 1, 2]) for t in range(7, 12)]
        base, _ = ref(idx)
    torch.testing.assert_close(cached, full[:, :7], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(step, 1), full[:, 7:], atol=1e-4, rtol=1e-4)
    tol = {"none": 1e-5, "int8": 0.05, "int4": 0.2}[fmt]
    assert relerr(full, base) < tol
    if fmt != "none":
        assert L.weight_bytes(model) < L.weight_bytes(ref) / 2


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("threads_restored")
@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
def test_a_conversion_on_two_threads_is_the_conversion_on_one(fmt):
    """convert builds the layers a thread each where torch has several (GPT-2 int8: 1.2-1.7 → 0.85-1.1 s): the same
    modules, bit for bit, in the same places, and the process's thread count as it was."""
    models = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        models[threads] = small_gpt()
        L.convert(models[threads], fmt, 32)
        assert torch.get_num_threads() == threads
    one, two = (dict(m.named_modules()) for m in (models[1], models[2]))
    assert [(n, type(m)) for n, m in one.items()] == [(n, type(m)) for n, m in two.items()]
    idx = torch.randint(0, 96, (3, 12))
    with torch.inference_mode():
        assert torch.equal(models[1](idx)[0], models[2](idx)[0])
    if fmt == "int8" and isinstance(one["transformer.h.0.mlp.c_fc"], L.Int8Linear):
        for name in ("transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_proj", "transformer.wte.head"):
            q1, s1 = one[name].int8_weight()
            q2, s2 = two[name].int8_weight()
            assert torch.equal(q1, q2) and torch.equal(s1, s2), name


@needs_onednn
@pytest.mark.usefixtures("threads_restored")
def test_tune_s_column_major_copies_made_on_two_threads_are_each_layer_s_own(monkeypatch):
    monkeypatch.setenv("GPT_SMALL_LINEAR", "mkl")
    torch.set_num_threads(2)
    model = small_gpt()
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    L.convert(model, "none", keep_plain=True)
    L.tune(model)
    assert torch.get_num_threads() == 2
    layers = {n: m for n, m in model.named_modules() if isinstance(m, L.PackedLinear)}
    assert len(layers) == 9
    for name, m in layers.items():
        weight = plain["transformer.wte.weight" if name == "lm_head" else f"{name}.weight"]
        assert torch.equal(m.column_major, weight) and m.column_major.stride() == (1, m.out_features), name


@pytest.mark.usefixtures("threads_restored")
def test_a_layer_s_kernel_that_refuses_names_the_layer_from_a_conversion_thread(monkeypatch):
    torch.set_num_threads(2)

    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(L, "quantize_int8", refuse)
    with pytest.raises(L.FormatError, match=r"cannot prepare transformer\.\S+ \(int8, float32\).*no kernel for this"):
        L.convert(small_gpt(), "int8")
    assert torch.get_num_threads() == 2


def test_bad_formats_and_shapes_are_one_line_errors():
    with pytest.raises(L.FormatError, match="unknown weight format 'int3'"):
        L.convert(small_gpt(), "int3")
    with pytest.raises(L.FormatError, match=r"transformer\.h\.0\.attn\.c_attn is 144x48"):
        L.convert(small_gpt(n_embd=48), "int4", 32)  # 48 inputs: not whole groups of 32
    with pytest.raises(L.FormatError, match="group size must be one of"):
        L.convert(small_gpt(), "int4", 48)


def test_weight_bytes_counts_one_copy():
    model = small_gpt()
    plain = L.weight_bytes(model)
    assert plain == sum(p.numel() * 4 for p in model.parameters())
    if L.ONEDNN_LINEAR is not None:
        L.convert(model, "none")  # each packed copy replaces its plain weight; the tied head gets one of its own
        assert L.weight_bytes(model) == plain + model.transformer.wte.weight.numel() * 4


@needs_onednn
@needs_packed_bf16
def test_a_lone_bf16_row_gets_the_product_it_gets_in_a_batch():
    # oneDNN takes another path for one row on some shapes (GPT-2's MLP projection, 3072 -> 768, on the CPUs measured:
    # ~1 bf16 row in 6 rounded apart); tune() finds those and runs a lone row as two
    dtype = torch.bfloat16
    lin = layer(768, 3072).to(dtype)
    m = L.PackedLinear(lin)
    with torch.inference_mode():
        L.tune(torch.nn.Sequential(m))
        x = torch.randn(16, 3072).to(dtype)
        batch = m(x)
        for r in range(16):
            assert torch.equal(m(x[r:r + 1]), batch[r:r + 1]), r
        if m.one_row_as_two:  # the lone row's result also stays close to the reference
            torch.testing.assert_close(m(x[:1]).float(), F.linear(x[:1], lin.weight, lin.bias).float(),
                                       atol=0.1, rtol=0.02)


@needs_onednn
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_the_served_model_keeps_no_view_of_the_checkpoint_file(tiny_ckpt, quantize):
    """Loaded tensors are views of the safetensors file's memory map: every tensor the engine keeps is its own copy
    (the plain weights kept for tune go after it), so the map goes (it counted ~0.5 GB of GPT-2's idle PSS)."""
    import gc

    from model.checkpoint import load_checkpoint

    weights = str((tiny_ckpt / "model.safetensors").resolve())
    ck = load_checkpoint(tiny_ckpt)
    assert weights in Path("/proc/self/maps").read_text()  # what the test looks for is there to begin with
    from engine.runner import ModelRunner

    runner = ModelRunner(ck.model, n_slots=2, vocab_size=ck.tokenizer.vocab_size, prepack=True, quantize=quantize,
                         compile_cache=None)
    del ck
    gc.collect()
    assert weights not in Path("/proc/self/maps").read_text()
    assert runner.model is not None
