"""The passes on the raw logits before temperature: logit bias and min_tokens (`bias`), then repetition, presence
and frequency penalties (`penalize`), in Hugging Face's and vLLM's order. Sparse where they can be: over a few ids
or each row's history, not the vocabulary."""

from __future__ import annotations

import torch

from engine.sampler.plan import Plan
from engine.sampler.state import SlotState

# The logit min_tokens gives EOS and the stop ids: finite, far below any real logit (even times 1e5, the largest
# inverse temperature, and 100, the largest repetition penalty), so they are never drawn beside another token, but a
# grammar that allows nothing else (one complete at the start) still gets them: the grammar outranks min_tokens, as
# it does once it is complete (the core ends the request there). At -inf that row had no token left and drew token 0.
SUPPRESSED_LOGIT = -1e30


def bias(state: SlotState, z: torch.Tensor, plan: Plan) -> None:
    """logit_bias (dense rows, 0 where a request has none), then min_tokens: the suppressed ids of each row
    still short of its min_tokens at SUPPRESSED_LOGIT (sparse, over at most a few ids per row; an empty entry
    points at the -inf sink column V, which stays -inf)."""
    rows = plan.rows
    if plan.bias:
        z.add_(state.bias[rows])
    if plan.min_tokens:
        ids = state.suppress[rows]
        short = (state.length[rows] - state.prompt_len[rows]) < state.min_tokens[rows]
        active = short[:, None] & (ids < state.vocab_size)
        z.scatter_(1, ids, torch.where(active, SUPPRESSED_LOGIT, z.gather(1, ids)))


def penalize(state: SlotState, z: torch.Tensor, plan: Plan) -> None:
    """Penalties on the raw logits in z (B, padded), sparse: over each row's history, not the vocabulary."""
    rows = plan.rows
    hist = state.history[rows]  # (B, L); empty entries point at the -inf sink column V
    if plan.repetition:
        rp = state.repetition[rows][:, None]
        g = z.gather(1, hist)
        z.scatter_(1, hist, torch.where(g > 0, g / rp, g * rp))  # duplicates write the same value
    if plan.presence_frequency:
        length, start = state.length[rows][:, None], state.prompt_len[rows][:, None]
        cols = state.cols[None, :]
        output = (cols >= start) & (cols < length)
        w = state.frequency[rows][:, None] + state.presence[rows][:, None] * state.first[rows]
        z.scatter_add_(1, hist, -(w * output))
