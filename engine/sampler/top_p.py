"""Top-p, exact and sort-free, by rejection (FlashInfer's scheme): a row's draw is in the nucleus iff the mass of
strictly more likely tokens is < top_p (`in_nucleus`, one pass); a rejected row is drawn again above a rising pivot
after the step's read-back (`redraw`), on those rows only."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler.draw import Blocks
from engine.sampler.noise import STREAM_BLOCK, STREAM_TOKEN, gumbel, row_keys
from model.kv_cache import device_index


@dataclass
class Ctx:
    """What a step's draw leaves for the redraws of its rejected rows (all batch rows)."""

    raw: torch.Tensor  # (B, V) the raw logits, float32
    e: torch.Tensor  # (B, padded) exp of the processed logits, shifted; 0 where impossible
    total: torch.Tensor  # (B,) e's row sums
    lse: torch.Tensor  # (B,) the raw logits' log-normalizer (the reported log-probabilities)
    seed_key: torch.Tensor  # (B,)
    position: torch.Tensor  # (B,) the index of the token being generated
    top_p: torch.Tensor  # (B,) each row's top_p


def in_nucleus(e: torch.Tensor, token: torch.Tensor, total: torch.Tensor, top_p: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) bool: each row's token is in its nucleus (or the row has no top-p). The mass of strictly more likely
    tokens < top_p · total, in one pass over e / e_s: Σ_j e_j [e_j > e_s] = e_s · Σ_j threshold(e_j / e_s, 1, 0).
    Boolean tensors and torch.where cost several times more on a CPU. `out`: a (B, padded) workspace (None: a new
    tensor, as in a compiled graph)."""
    e_s = e.gather(1, token[:, None]).clamp(min=1e-30)
    F = torch.nn.functional
    r = F.threshold(e / e_s, 1.0, 0.0) if out is None else F.threshold_(torch.div(e, e_s, out=out), 1.0, 0.0)
    above = e_s[:, 0] * r.sum(-1)
    return (above < top_p * total) | (top_p >= 1.0)


def redraw(rejected: list[int], token: torch.Tensor, ctx: Ctx, blocks: Blocks) -> tuple[list[tuple[int, float]], int]:
    """Rows whose draw fell outside the nucleus: draw again above the pivot until accepted (exact); their
    (token, logprob) and the read-backs made.

    Runs on the rejected rows only. Each round draws from the tokens strictly more likely than the
    last rejected one (hierarchically, with the round's own noise streams) and checks membership.
    Within a block, log e = z + a per-row constant, so e alone carries the distribution.
    """
    device = blocks.device
    idx = device_index(rejected, device)
    e = ctx.e[idx]  # (R, padded): exp of processed logits, shifted; 0 where impossible
    total, seed_key, position = ctx.total[idx], ctx.seed_key[idx], ctx.position[idx]
    p = ctx.top_p[idx]
    R, BS, NB = len(rejected), blocks.size, blocks.n
    pivot = e.gather(1, token[idx][:, None])  # (R, 1)
    result: list[int | None] = [None] * R
    live = list(range(R))
    rnd = 0
    threshold = torch.nn.functional.threshold_
    while live:
        rnd += 1
        li = device_index(live, device)
        el = e if len(live) == R else e[li]
        # the tokens strictly more likely than the pivot: threshold on e / pivot (no masked_fill / where,
        # several times slower on a CPU), scaled back
        kept = threshold(el / pivot[li], 1.0, 0.0)
        key_b = row_keys(seed_key[li], position[li], STREAM_BLOCK + 2 * rnd)
        key_t = row_keys(seed_key[li], position[li], STREAM_TOKEN + 2 * rnd)
        kb = kept.unflatten(1, (NB, BS))
        block = (kb.sum(-1).log() + gumbel(key_b, blocks.ids)).argmax(-1)
        within = kb.gather(1, block[:, None, None].expand(-1, 1, BS))[:, 0].log()  # log e = z + const
        ids = block[:, None] * BS + blocks.in_block
        tok = block * BS + (within + gumbel(key_t, ids)).argmax(-1)
        e_s = el.gather(1, tok[:, None])
        above = e_s[:, 0] * threshold(el / e_s, 1.0, 0.0).sum(-1)
        ok = (above < p[li] * total[li]).tolist()
        toks = tok.tolist()
        still = []
        for j, (i, a) in enumerate(zip(live, ok)):
            if a:
                result[i] = toks[j]
            else:
                pivot[i] = e_s[j]
                still.append(i)
        live = still
    ids = device_index(result, device)
    lps = (ctx.raw[idx, ids] - ctx.lse[idx]).tolist()
    return list(zip(result, lps)), rnd
