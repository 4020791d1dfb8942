"""What this CPU's kernels can do (model/cpu_support.py) and the fallbacks every choice takes when it cannot: the
probe agrees with the kernels, a bf16 model serves through F.linear where oneDNN cannot pack bf16 (forced here, so
every host runs the fallback), refusals name the CPU, and `python -m app` serves every --dtype / --quantize on this
host with prompt log-probabilities within each format's tolerance of fp32's."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

import model.linear as L
from model import cpu_support
from model.kv_cache import KVCache
from tests.app_helpers import start_app_process
from tests.helpers import REPO, force_cpu, tiny_model

BUNDLED = REPO / "checkpoints" / "shakespeare"


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_probe_answers_what_the_kernels_do():
    cpu = cpu_support.support()
    assert cpu.capability == torch.backends.cpu.get_cpu_capability()
    w = torch.randn(32, 16).to(torch.bfloat16)
    if cpu.packed_bf16:
        torch.ops.mkldnn._reorder_linear_weight(w)
    elif torch.backends.mkldnn.is_available():
        with pytest.raises(RuntimeError, match="bf16"):
            torch.ops.mkldnn._reorder_linear_weight(w)
    assert cpu.native_bf16 == (cpu.packed_bf16 and bool(cpu.flags & {"avx512_bf16", "amx_bf16"}))
    assert cpu.fbgemm == ("fbgemm" in torch.backends.quantized.supported_engines)
    assert set(cpu.describe()) >= {"capability", "flags", "packed_bf16", "native_bf16", "fbgemm", "int4_pack"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_without_packing_serves_through_f_linear(dtype, monkeypatch):
    force_cpu(monkeypatch, packed_bf16=False)  # an AVX2 host's answer, on any host
    ref = tiny_model(0, vocab_size=96, block_size=32)
    model = copy.deepcopy(ref).to(dtype)
    info = L.convert(model, "none")
    assert info["swapped"] == 0
    assert not any(isinstance(m, L.PackedLinear) for m in model.modules())
    idx = torch.randint(0, 96, (3, 12))
    with torch.inference_mode():
        full, _ = model(idx)
        cache = KVCache(model.config, 3, 32, dtype=dtype)
        cached = model.forward_cached(idx[:, :7], cache, [0, 1, 2], all_logits=True)
        step = [model.forward_cached(idx[:, t:t + 1], cache, [0, 1, 2]) for t in range(7, 12)]
        base, _ = ref(idx)
    assert relerr(full, base) < 2e-2  # the format's tolerance against fp32
    torch.testing.assert_close(cached.float(), full[:, :7].float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(torch.stack(step, 1).float(), full[:, 7:].float(), atol=3e-2, rtol=3e-2)


def test_fp32_packs_wherever_onednn_runs_and_bf16_only_where_this_cpu_packs_it():
    for dtype, packs in ((torch.float32, cpu_support.support().packed_fp32),
                         (torch.bfloat16, cpu_support.support().packed_bf16)):
        model = tiny_model(0, vocab_size=96, block_size=32).to(dtype)
        info = L.convert(model, "none")
        assert (info["swapped"] > 0) == (packs and L.ONEDNN_LINEAR is not None), dtype


def test_int4_is_refused_in_one_line_where_its_kernels_do_not_run(monkeypatch):
    force_cpu(monkeypatch, int4_pack=False)
    with pytest.raises(L.FormatError, match=r"int4 needs PyTorch's CPU int4 kernels.*--quantize int8"):
        L.convert(tiny_model(0, vocab_size=96, block_size=32), "int4", 32)


def test_a_kernel_that_refuses_this_cpu_is_reported_as_the_weights_step(monkeypatch):
    force_cpu(monkeypatch, packed_bf16=True)  # a wrong answer: the kernel itself then refuses

    def refuse(w):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(L, "PackedLinear", lambda lin, *args: refuse(lin.weight))
    if L.ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    with pytest.raises(L.FormatError, match=r"cannot prepare transformer\.h\.0\.attn\.c_attn \(none, bfloat16\) "
                                            r"for this cpu's kernels: .*avx_ne_convert"):
        L.convert(tiny_model(0, vocab_size=96, block_size=32).to(torch.bfloat16), "none")


def test_auto_dtype_needs_packing_as_well_as_the_flags(monkeypatch):
    import engine.cpu_tuning as ct
    import model.linear
    from engine.build import CoreConfig

    monkeypatch.setattr(ct, "_DTYPE_CHOICES", {})
    monkeypatch.setattr(model.linear, "time_dtypes", lambda *a: pytest.fail("timed bf16 where it cannot pack"))
    force_cpu(monkeypatch, flags=frozenset({"avx2", "avx512_bf16"}), packed_bf16=False)  # e.g. ONEDNN_MAX_CPU_ISA
    dtype, why = ct.serving_dtype(CoreConfig(checkpoint=str(BUNDLED), compile="off"), torch.device("cpu"),
                                  torch.float32)
    assert dtype == torch.float32 and "does not pack bf16" in why["why"]


def test_the_start_up_report_names_a_16_bit_dtype_without_native_kernels(monkeypatch):
    from engine.build import cpu_report

    force_cpu(monkeypatch, flags=frozenset({"avx2"}), packed_bf16=False)
    cpu, note = cpu_report(torch.bfloat16, "none")
    assert cpu["packed_bf16"] is False and "no native bf16 matmul" in note and "--quantize int8" in note
    assert cpu_report(torch.float32, "none")[1] is None
    assert cpu_report(torch.bfloat16, "int8")[1] is None  # quantized layers run their own kernels
    from model import int4_kernel

    assert cpu_report(torch.float32, "int4")[0]["int4_kernel"] == int4_kernel.isa()  # /info names int4's path
    assert "int4_kernel" not in cpu_report(torch.float32, "int8")[0]
    force_cpu(monkeypatch, flags=frozenset({"avx512_bf16"}), packed_bf16=True)
    assert cpu_report(torch.bfloat16, "none")[1] is None


PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"
# max |Δ logprob| of a prompt token against fp32's (measured on an AVX2 EPYC: bf16 0.017, fp16 0.0017, int8 0.058,
# int4 0.097)
TOLERANCE = {"fp32": 0.0, "bf16": 0.1, "fp16": 0.02, "int8": 0.2, "int4": 0.4}


def _prefill_logprobs(url: str) -> list[float]:
    r = httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "decoder_input_details": True, "details": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return [t["logprob"] for t in r.json()["details"]["prefill"][1:]]


@pytest.mark.slow  # five server starts (~1 min): `make test-cpu-isa` runs it in CI, capped at AVX2
def test_every_dtype_and_format_serves_on_this_cpu():
    """`python -m app` as a user starts it, per --dtype / --quantize: it serves (or would exit in one line naming
    the CPU feature), and its prompt log-probabilities stay within the format's tolerance of fp32's."""
    got = {}
    for name, flags in (("fp32", ["--dtype", "fp32"]), ("bf16", ["--dtype", "bf16"]), ("fp16", ["--dtype", "fp16"]),
                        ("int8", ["--quantize", "int8"]), ("int4", ["--quantize", "int4"])):
        proc, url = start_app_process(BUNDLED, *flags, "--max-batch-size", "2")
        try:
            got[name] = _prefill_logprobs(url)
            info = httpx.get(url + "/info", timeout=10).json()
            assert info["cpu"]["capability"] == cpu_support.support().capability
        finally:
            proc.terminate()
            proc.wait(30)
    for name, lp in got.items():
        worst = max(abs(a - b) for a, b in zip(lp, got["fp32"], strict=True))
        assert worst <= TOLERANCE[name] + 1e-4, (name, worst)
