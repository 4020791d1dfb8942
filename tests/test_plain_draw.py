"""engine/plain_draw.py: the draw fused into the compiled decode step is the sampler's own draw for plain plans —
the same tokens and log-probabilities as `Sampler.step` over the same logits, for greedy, T = 1 and T < 1 rows,
with and without top-p (its rejected draws redrawn after the read-back as `step` redraws them) —
and `Sampler.plain_kind` sends only such plans there."""

from __future__ import annotations

import pytest
import torch

from engine.params import SamplingParams
from engine.plain_draw import plain_draw
from engine.sampler import Sampler

V, SLOTS = 1000, 6  # not a multiple of the block: the padding columns are never drawn


def sampler_with(params: list[SamplingParams], block: int = 128) -> Sampler:
    s = Sampler(SLOTS, V, 64, block_size=block)
    for slot, p in enumerate(params):
        s.admit(slot, p, [1, 2, 3 + slot], seed=100 + slot)
    return s


@pytest.mark.parametrize("kind,temperature,top_p,top_k", [
    ("greedy", 0.0, (1.0,), (0,)), ("sample", 1.0, (1.0,), (0,)), ("sample_sharpened", 0.7, (1.0,), (0,)),
    ("sample", 1.0, (0.5, 1.0, 0.9, 0.3), (0,)), ("sample_sharpened", 0.7, (0.6, 0.95, 1.0, 0.2), (0,)),
    ("top_k", 1.0, (1.0,), (50, 1, 7, 64)), ("top_k", 0.8, (0.9, 1.0, 0.5, 0.95), (40, 64, 3, 20)),
    ("top_k", 1.3, (0.95,), (50, 10))])
def test_plain_draw_is_the_samplers_draw(kind, temperature, top_p, top_k):
    n = 4
    params = [SamplingParams(temperature=temperature, top_p=top_p[i % len(top_p)], top_k=top_k[i % len(top_k)])
              for i in range(n)]
    eager, fused = sampler_with(params), sampler_with(params)
    assert eager.plain_kind(range(n)) == kind
    gen = torch.Generator().manual_seed(0)
    redrawn = 0
    for _ in range(40):  # 40 steps: the noise's positions move on as the tokens are recorded
        logits = torch.randn(n, V, generator=gen) * 3
        want = eager.step(logits.clone(), range(n))
        inv_temp, top_k_t, top_p_t, seed_key, length, prompt_len = fused.plain_inputs(n)
        out = plain_draw(logits, V, fused.block, kind, inv_temp, top_k_t, top_p_t, seed_key, length - prompt_len)
        assert len(out) == (2 if kind in ("greedy", "top_k") else 7)
        redrawn += 0 if len(out) == 2 else int((~out[2]).sum())
        got = fused.take(range(n), *out)
        assert [d.token for d in got] == [d.token for d in want]
        assert [d.logprob for d in got] == pytest.approx([d.logprob for d in want], abs=1e-5)
    assert torch.equal(eager.history, fused.history) and torch.equal(eager.state.seen, fused.state.seen)
    assert eager.read_backs == fused.read_backs  # the same redraw rounds
    if min(top_p) < 1.0 and kind != "top_k":
        assert redrawn > 0  # top-p rejected some draws: the redraw after take() was exercised


def test_only_plain_plans_are_drawn_inside_the_step():
    plain = SamplingParams(temperature=1.0)
    cases = {
        "greedy": [SamplingParams(temperature=0.0)] * 2,
        "sample": [plain, plain],
        "sample_sharpened": [SamplingParams(temperature=0.5)] * 2,
        None: [SamplingParams(temperature=0.0), plain],  # mixed
    }
    for want, params in cases.items():
        assert sampler_with(params).plain_kind(range(2)) == want
    cases = {  # top-p rides along: checked inside, the rare rejected draw redrawn by the sampler
        "sample": [SamplingParams(top_p=0.9), plain],
        "sample_sharpened": [SamplingParams(temperature=0.8, top_p=0.95)] * 2,
        "top_k": [SamplingParams(top_k=64, temperature=0.7), SamplingParams(top_k=5, top_p=0.9)],
    }
    for want, params in cases.items():
        assert sampler_with(params).plain_kind(range(2)) == want
    assert sampler_with([SamplingParams(top_k=5), plain]).plain_kind(range(2)) is None  # top-k beside whole-vocab
    for p in (SamplingParams(temperature=1.5), SamplingParams(top_k=65),
              SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5),
              SamplingParams(logit_bias={3: 1.0}), SamplingParams(min_tokens=2, stop_token_ids=[7])):
        assert sampler_with([p]).plain_kind(range(1)) is None, p
    s = Sampler(SLOTS, V, 64)
    s.admit(0, plain, [1], seed=1, top_n=2)  # logprobs alternatives
    assert s.plain_kind(range(1)) is None
    s.admit(0, plain, [1], seed=1, constrained=True)  # a grammar
    assert s.plain_kind(range(1)) is None
