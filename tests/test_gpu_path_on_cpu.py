"""The GPU path's host-sync-free pieces (issue 31, item 7), run on CPU: the sampler's sync-free underflow rescue
gives the read-back version's draws, and index tensors for non-contiguous slots equal torch.tensor's."""

from __future__ import annotations

import pytest
import torch

import engine.sampling as sampling
from engine.sampling import Sampler, SamplingParams
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
    inner = Sampler._rescue_underflow_all_rows

    def spy(self, *args):
        calls.append(args[-1].clone())
        return inner(self, *args)

    expected = draws(params, constrained, shifts)
    monkeypatch.setattr(sampling, "READBACK_DEVICES", ())  # as on a GPU
    monkeypatch.setattr(Sampler, "_rescue_underflow_all_rows", spy)
    got = draws(params, constrained, shifts)
    assert [t for t, _ in got] == [t for t, _ in expected]
    torch.testing.assert_close([lp for _, lp in got], [lp for _, lp in expected])
    if params["temperature"] > 0:
        assert calls and all(bool(low.any()) for low in calls)  # the rescue ran, and had rows to rescue
    assert all(ALLOWED[t] for i, (t, _) in enumerate(got) if constrained[i % 3])


def test_device_index_equals_torch_tensor_on_cpu():
    t = device_index([3, 0, 2], torch.device("cpu"))
    assert torch.equal(t, torch.tensor([3, 0, 2])) and t.dtype == torch.long
