"""The GPU path's host-sync-free pieces (issue 31, item 7), run on CPU: the sampler's sync-free underflow rescue
gives the read-back version's draws, and index tensors for non-contiguous slots equal torch.tensor's."""

from __future__ import annotations

import pytest
import torch

import engine.sampler.bitmask as bitmask
from engine.params import SamplingParams
from engine.sampler import Sampler
from model.kv_cache import device_index
from tests.helpers import ALLOWED, PROBS, packed_bitmask


def draws(params: dict, constrained: list[bool], shifts: list[float], steps: int = 4) -> list[tuple[int, float]]:
    B, V = len(constrained), PROBS.numel()
    s = Sampler(B, V, steps + 1, block_size=4)
    for i, c in enumerate(constrained):
        s.admit(i, SamplingParams(**params), [0], seed=7 + i, constrained=c)
    n = sum(constrained)
    bitmask = packed_bitmask(ALLOWED.expand(n, V))
    rows = torch.stack([PROBS.log() + torch.where(ALLOWED, shift, 0.0) for shift in shifts])
    out = []
    for _ in range(steps):
        out += [(d.token, d.logprob) for d in s.step(rows.clone(), range(B), bitmask)]
    return out


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                    dict(temperature=0.8, top_k=3), dict(temperature=0.0)])
@pytest.mark.parametrize("constrained", [[True, True, True], [True, False, True]], ids=["all", "some"])
def test_the_sync_free_underflow_rescue_draws_what_the_read_back_does(params, constrained, monkeypatch):
    shifts = [-150.0, 0.0, -150.0]  # rows 0 and 2: the allowed tokens' exp underflows; row 1's does not
    calls = []
    inner = bitmask.Masker._rescue_where

    def spy(self, *args):
        calls.append(args[-1].clone())
        return inner(self, *args)

    expected = draws(params, constrained, shifts)
    monkeypatch.setattr(bitmask, "READBACK_DEVICES", ())  # as on a GPU
    monkeypatch.setattr(bitmask.Masker, "_rescue_where", spy)
    got = draws(params, constrained, shifts)
    assert [t for t, _ in got] == [t for t, _ in expected]
    torch.testing.assert_close([lp for _, lp in got], [lp for _, lp in expected])
    if params["temperature"] > 0:
        assert calls and all(bool(low.any()) for low in calls)  # the rescue ran, and had rows to rescue
    assert all(ALLOWED[t] for i, (t, _) in enumerate(got) if constrained[i % 3])


def test_device_index_equals_torch_tensor_on_cpu():
    t = device_index([3, 0, 2], torch.device("cpu"))
    assert torch.equal(t, torch.tensor([3, 0, 2])) and t.dtype == torch.long


# ---- issue 41: the CUDA branches of the weight formats, built on the meta device (no data, the CUDA code path)
@pytest.mark.parametrize("inp, tiles", [(768, 8), (1600, 4), (1024, 8), (6400, 8), (4096, 8), (96, 2)])
def test_int4_packs_every_admitted_input_dim_for_cudas_kernel(inp, tiles):
    """CUDA's packer needs the input dim divisible by 16 x its inner k-tiles: GPT-2 XL's 1600 with the fixed 8
    failed at load. The packed weight must describe exactly the input dim (the kernel's K = dim 1 x tiles x 16)."""
    from model.linear import Int4Linear, int4_inner_k_tiles, quantize_int4

    group = 32
    q, scale, zero = quantize_int4(torch.empty(64, inp, device="meta"), group)
    m = Int4Linear(q, scale, zero, None, torch.bfloat16, group)
    assert int4_inner_k_tiles(inp) == tiles
    # what _weight_int4pack_mm checks: packed dim 1 == K / (tiles x 16), tiles = 2 x packed dim 3
    assert m.packed.shape[1] * m.packed.shape[3] * 2 * 16 == inp and m.packed.shape[0] * 8 == 64


def test_int8_off_a_cpu_serves_the_values_dequantized_once_not_per_call(monkeypatch):
    """The old CUDA branch kept int8 and made a bf16 copy of the weight in every forward; now the copy is made
    once (and the tied head's counts as its own bytes), or, with GPT_INT8_KERNEL=1, torch's int8 kernel runs."""
    from model.linear import Int8Embedding, Int8Linear, quantize_int8

    q, scale = quantize_int8(torch.randn(48, 32))
    monkeypatch.delenv("GPT_INT8_KERNEL", raising=False)
    m = Int8Linear(q.to("meta"), scale.to("meta"), torch.zeros(48, device="meta"), torch.bfloat16)
    assert m.q is None and m.weight.dtype == torch.bfloat16 and m.bias.dtype == torch.bfloat16
    assert m.matrix_bytes() == 48 * 32 * 2
    assert m(torch.empty(5, 32, device="meta", dtype=torch.bfloat16)).shape == (5, 48)
    emb = Int8Embedding(torch.randn(100, 32, device="meta"), torch.bfloat16)
    assert emb.weight_bytes() == 100 * 32 + 100 * 4 + 100 * 32 * 2  # the table, its scales, the head's copy
    monkeypatch.setenv("GPT_INT8_KERNEL", "1")
    k = Int8Linear(q.to("meta"), scale.to("meta"), None, torch.bfloat16)
    assert k.weight is None and k.q.dtype == torch.int8
    calls = []
    real = torch.ops.aten._weight_int8pack_mm

    class Spy:
        def __call__(self, *a):
            calls.append(a)
            return real(*a)

    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", Spy())
    assert k(torch.empty(5, 32, device="meta", dtype=torch.bfloat16)).shape == (5, 48) and len(calls) == 1



def host_to_device_copies(path) -> list[str]:
    """Calls that make a device tensor from host values without device_index: torch.tensor / as_tensor with a
    device, or followed by .to(...)."""
    import ast

    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        made = lambda n: (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)  # noqa: E731
                          and n.func.attr in ("tensor", "as_tensor") and getattr(n.func.value, "id", "") == "torch")
        if made(node) and any(k.arg == "device" for k in node.keywords):
            found.append(f"{path.name}:{node.lineno}")
        elif isinstance(f, ast.Attribute) and f.attr == "to" and made(f.value):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_every_host_to_device_index_of_a_step_goes_through_device_index():
    """Issue 41 item 5: torch.tensor(list, device=cuda) copies from pageable memory and blocks the host; the step's
    modules use model.kv_cache.device_index (pinned, non-blocking)."""
    from pathlib import Path

    engine = Path(__file__).resolve().parents[1] / "engine"
    files = [*sorted((engine / "sampler").glob("*.py")), engine / "core.py",
             *sorted((engine / "spec_decode").glob("*.py"))]
    assert [hit for f in files for hit in host_to_device_copies(f)] == []
