"""The draw of plain rows as one pure function: what the compiled decode step (engine/compiled_decode.py) fuses
into its graph, so that a batch-1 token costs one call instead of the forward's plus the sampler's ~20 small ops.

A plan is plain when every row is greedy, or every row samples at one kind of temperature (T = 1; or T < 1,
clamped as `Sampler._sample` clamps it), with or without top-p, or every row has a top-k of at most TOP_K_MAX
(any temperature, with or without top-p: `top_k_draw`'s arithmetic), and no row has penalties, logit bias,
min_tokens, a grammar or top-n logprobs. Top-p is checked inside (`in_nucleus`, one pass); the rare row whose draw
falls outside its nucleus is drawn again by the sampler after the read-back, as `Sampler.step` does. These are the
server's defaults (TGI's greedy, OpenAI's T = 1) and the common sampled requests (llama.cpp's T 0.8, top-k 40,
top-p 0.95); anything else stays on `Sampler.step`. The arithmetic is `Sampler._sample`'s for such a plan, step for
step (the same blocks, maxima, noise keys and summation order), so a seeded request draws the same tokens either
way; tests/test_plain_draw.py and tests/test_compiled_decode.py hold the two against each other.
"""

from __future__ import annotations

from typing import Literal

import torch

from engine.sampler.draw import TOP_K_MAX, draw_among_best
from engine.sampler.noise import STREAM_BLOCK, STREAM_TOKEN, gumbel, row_keys
from engine.sampler.sampler import EXP_FLOOR
from engine.sampler.top_p import in_nucleus

Kind = Literal["greedy", "sample", "sample_sharpened", "top_k"]  # T = 0, T = 1, T < 1 (clamped before exp), top-k
KINDS: tuple[Kind, ...] = ("greedy", "sample", "sample_sharpened", "top_k")


def plain_draw(logits: torch.Tensor, vocab_size: int, block: int, kind: Kind, inv_temp: torch.Tensor,
               top_k: torch.Tensor, top_p: torch.Tensor, seed_key: torch.Tensor,
               position: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(token, logprob) per row of logits (B, ≥ vocab) for a plain plan of `kind`; inv_temp, top_k, top_p, seed_key
    and position (B,) are the rows' 1/T, top-k (vocabulary size: off), top-p (1: off), seed key and generated-token
    index (`SlotState`). The sample kinds also return top-p's membership check and what a rejected row's redraw
    reads (`Sampler.take`): (token, logprob, accepted, raw, e, total, lse)."""
    V = vocab_size
    n_blocks = (V + 1 + block - 1) // block  # as Sampler: column V is a -inf sink
    raw = logits[:, :V].float()
    src = torch.nn.functional.pad(raw, (0, n_blocks * block - V), value=float("-inf"))
    srcb = src.unflatten(1, (n_blocks, block))
    bmax = srcb.amax(-1)
    m = bmax.amax(-1, keepdim=True)
    d = src - m
    if kind == "top_k":  # the eager top_k_draw's own function, over TOP_K_MAX candidates for every row
        token = draw_among_best(srcb, bmax, min(TOP_K_MAX, n_blocks * block), torch.arange(block, device=src.device),
                                inv_temp[:, None], top_k, top_p, row_keys(seed_key, position, STREAM_TOKEN))
        return token, raw.gather(1, token[:, None])[:, 0] - (m[:, 0] + d.exp().sum(-1).log())
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
    logprob = raw.gather(1, token[:, None])[:, 0] - lse
    if kind == "greedy":
        return token, logprob
    total = bsum.sum(-1)
    return token, logprob, in_nucleus(e, token, total, top_p), raw, e, total, lse

