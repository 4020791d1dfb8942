"""The draw of plain rows as one pure function: what the compiled decode step (engine/compiled_decode.py) fuses
into its graph, so that a batch-1 token costs one call instead of the forward's plus the sampler's ~20 small ops.

A plan is plain when every row is greedy, or every row samples from its whole distribution at one kind of
temperature (T = 1; or T < 1, clamped as `Sampler._sample` clamps it), with no top-k, top-p, penalties, logit bias,
min_tokens, grammar or top-n logprobs. These are the server's defaults (TGI's greedy, OpenAI's T = 1) and the
common sampled requests; anything else stays on `Sampler.step`. The arithmetic is `Sampler._sample`'s for such a
plan, step for step (the same blocks, maxima, noise keys and summation order), so a seeded request draws the same
tokens either way; tests/test_compiled_decode.py holds the two against each other.
"""

from __future__ import annotations

from typing import Literal

import torch

from engine.sampler.noise import STREAM_BLOCK, STREAM_TOKEN, gumbel, row_keys
from engine.sampler.sampler import EXP_FLOOR

Kind = Literal["greedy", "sample", "sample_sharpened"]  # T = 0, T = 1, T < 1 (clamped before exp)
KINDS: tuple[Kind, ...] = ("greedy", "sample", "sample_sharpened")


def plain_draw(logits: torch.Tensor, vocab_size: int, block: int, kind: Kind, inv_temp: torch.Tensor,
               seed_key: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, logprob) per row of logits (B, ≥ vocab) for a plain plan of `kind`; inv_temp, seed_key and position
    (B,) are the rows' 1/T, seed key and generated-token index (`SlotState`)."""
    V = vocab_size
    n_blocks = (V + 1 + block - 1) // block  # as Sampler: column V is a -inf sink
    raw = logits[:, :V].float()
    src = torch.nn.functional.pad(raw, (0, n_blocks * block - V), value=float("-inf"))
    srcb = src.unflatten(1, (n_blocks, block))
    bmax = srcb.amax(-1)
    m = bmax.amax(-1, keepdim=True)
    d = src - m
    scale = None if kind in ("greedy", "sample") else inv_temp[:, None]
    if scale is None:
        e = d.exp()
        lse = None
    else:
        lse = m[:, 0] + d.exp().sum(-1).log()
        e = (d * scale).clamp(min=EXP_FLOOR).exp()
    bsum = e.unflatten(1, (n_blocks, block)).sum(-1)
    if lse is None:
        lse = m[:, 0] + bsum.sum(-1).log()
    in_block = torch.arange(block, device=logits.device)
    if kind == "greedy":
        best = bmax.argmax(-1)
        within = srcb.gather(1, best[:, None, None].expand(-1, 1, block))[:, 0]
        token = best * block + within.argmax(-1)
    else:
        key_b = row_keys(seed_key, position, STREAM_BLOCK)
        key_t = row_keys(seed_key, position, STREAM_TOKEN)
        chosen = (bsum.log() + gumbel(key_b, torch.arange(n_blocks, device=logits.device))).argmax(-1)
        within = srcb.gather(1, chosen[:, None, None].expand(-1, 1, block))[:, 0]
        if scale is not None:
            within = within * scale
        ids = chosen[:, None] * block + in_block
        token = chosen * block + (within + gumbel(key_t, ids)).argmax(-1)
    return token, raw.gather(1, token[:, None])[:, 0] - lse
