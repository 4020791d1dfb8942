"""engine/plain_draw.py: the draw fused into the compiled decode step is the sampler's own draw for plain plans —
the same tokens and log-probabilities as `Sampler.step` over the same logits, for greedy, T = 1 and T < 1 rows —
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


@pytest.mark.parametrize("kind,temperature", [("greedy", 0.0), ("sample", 1.0), ("sample_sharpened", 0.7)])
def test_plain_draw_is_the_samplers_draw(kind, temperature):
    n = 4
    params = [SamplingParams(temperature=temperature) for _ in range(n)]
    eager, fused = sampler_with(params), sampler_with(params)
    assert eager.plain_kind(range(n)) == kind
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):  # 40 steps: the noise's positions move on as the tokens are recorded
        logits = torch.randn(n, V, generator=gen) * 3
        want = eager.step(logits.clone(), range(n))
        inv_temp, seed_key, length, prompt_len = fused.plain_inputs(n)
        token, logprob = plain_draw(logits, V, fused.block, kind, inv_temp, seed_key, length - prompt_len)
        got = fused.take(range(n), token, logprob)
        assert [d.token for d in got] == [d.token for d in want]
        assert [d.logprob for d in got] == pytest.approx([d.logprob for d in want], abs=1e-5)
    assert torch.equal(eager.history, fused.history) and torch.equal(eager.state.seen, fused.state.seen)


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
    for p in (SamplingParams(temperature=1.5), SamplingParams(top_k=5), SamplingParams(top_p=0.9),
              SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5),
              SamplingParams(logit_bias={3: 1.0}), SamplingParams(min_tokens=2, stop_token_ids=[7])):
        assert sampler_with([p]).plain_kind(range(1)) is None, p
    s = Sampler(SLOTS, V, 64)
    s.admit(0, plain, [1], seed=1, top_n=2)  # logprobs alternatives
    assert s.plain_kind(range(1)) is None
    s.admit(0, plain, [1], seed=1, constrained=True)  # a grammar
    assert s.plain_kind(range(1)) is None
