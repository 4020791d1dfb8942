"""Sampling rules on hand-made logits: greedy, top-k, top-p, repetition penalty, log-probabilities."""

from __future__ import annotations

import torch

from model.sampling import SamplingParams, apply_repetition_penalty, filter_top_k_top_p, sample_next


def _draw(logits: torch.Tensor, params: SamplingParams, n: int = 400, seed: int = 0) -> set[int]:
    gen = torch.Generator().manual_seed(seed)
    return {int(sample_next(logits[None], [params], [gen])[0]) for _ in range(n)}


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 5
    tokens, logprobs = sample_next(logits, params, [torch.Generator() for _ in range(5)])
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values)


def test_top_k_never_samples_outside_the_k_best():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    best = set(torch.topk(logits, 5).indices.tolist())
    seen = _draw(logits, SamplingParams(temperature=5.0, top_k=5), n=2000)
    assert seen <= best
    assert len(seen) == 5  # at a high temperature all five show up


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    vals, ids = filter_top_k_top_p(logits[None], torch.tensor([0]), torch.tensor([0.8]))
    kept = ids[0][torch.isfinite(vals[0])].tolist()
    assert kept == [0, 1]  # 0.5 < 0.8 ≤ 0.5 + 0.3
    vals, ids = filter_top_k_top_p(logits[None], torch.tensor([0]), torch.tensor([0.81]))
    assert ids[0][torch.isfinite(vals[0])].tolist() == [0, 1, 2]
    assert _draw(logits, SamplingParams(temperature=1.0, top_p=0.8)) == {0, 1}


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([3.0, 1.0, 0.0])
    assert _draw(logits, SamplingParams(temperature=1.0, top_p=1e-6), n=50) == {0}


def test_top_k_then_top_p_per_row():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    vals, ids = filter_top_k_top_p(logits, torch.tensor([3, 0]), torch.tensor([1.0, 0.6]))
    kept = [ids[r][torch.isfinite(vals[r])].tolist() for r in range(2)]
    assert kept == [[0, 1, 2], [0, 1]]


def test_repetition_penalty_lowers_seen_tokens_as_specified():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    presence = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, presence, torch.tensor([[2.0]]))
    # positive logits are divided, negative ones multiplied: both move down; unseen ones stay
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0]]
    # end to end: with a strong penalty, greedy stops picking the seen best token
    tok, _ = sample_next(logits, [SamplingParams(temperature=0, repetition_penalty=3.0)],
                         [torch.Generator()], presence)
    assert tok.item() == 2


def test_sampling_is_distributed_as_the_probabilities():
    probs = torch.tensor([0.6, 0.3, 0.1])
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample_next(probs.log()[None], [params], [gen])[0]] += 1
    torch.testing.assert_close(counts / counts.sum(), probs, atol=0.03, rtol=0)
