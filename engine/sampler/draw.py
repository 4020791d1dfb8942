"""The hierarchical draw's layout (`Blocks`: the vocabulary, plus the -inf sink column V, in whole blocks) and its
draws: greedy (`argmax`), Gumbel-max within a chosen block (`draw`), and top-k rows (`top_k_draw`)."""

from __future__ import annotations

import torch

from engine.sampler.bitmask import apply_bitmask
from engine.sampler.noise import STREAM_TOKEN, gumbel, row_keys
from engine.sampler.plan import Plan
from engine.sampler.state import SlotState

BLOCK_SIZE = 256  # tokens per block of the hierarchical draw (√V-ish for GPT-2's 50257)
# rows with 0 < top_k <= this (llama.cpp's default 40, Hugging Face's 50) draw inside the compiled decode step
# (engine/plain_draw.py): its graph takes this many best tokens and masks each row's beyond its own k, as top_k_draw
# does for a batch whose largest k is below it
TOP_K_MAX = 64


class Blocks:
    """`n` blocks of `size` tokens covering the vocabulary and its -inf sink column V (`padded` = n · size
    columns), with the index tensors the draws reuse."""

    def __init__(self, vocab_size: int, size: int, device: torch.device) -> None:
        self.size = size
        self.n = (vocab_size + 1 + size - 1) // size  # +1: column V is a -inf sink
        self.padded = self.n * size
        self.device = device
        self.ids = torch.arange(self.n, dtype=torch.long, device=device)
        self.in_block = torch.arange(size, dtype=torch.long, device=device)

    def argmax(self, zb: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """Greedy: the best block by its max, then the best token in it (first index on ties, as argmax)."""
        within = zb.gather(1, block[:, None, None].expand(-1, 1, self.size))[:, 0]  # (B, BS)
        return block * self.size + within.argmax(-1)

    def draw(self, zb: torch.Tensor, block: torch.Tensor, key: torch.Tensor, scale: torch.Tensor | None,
             e: torch.Tensor | None = None, e_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The token of the chosen block: argmax of z + Gumbel noise keyed by token id (z = zb · scale).
        With `e` (the masked exp, constrained rows `e_rows`, None: all), those rows read log e instead: z plus a
        row's constant where the grammar allows a token, −inf where it does not."""
        at = block[:, None, None].expand(-1, 1, self.size)
        within = zb.gather(1, at)[:, 0]  # (B, BS)
        if scale is not None:
            within = within * scale
        if e is not None:
            log_e = e.unflatten(1, (self.n, self.size)).gather(1, at)[:, 0].log()
            within = log_e if e_rows is None else within.index_copy(0, e_rows, log_e[e_rows])
        ids = block[:, None] * self.size + self.in_block  # (B, BS)
        return block * self.size + (within + gumbel(key, ids)).argmax(-1)


def top_k_draw(blocks: Blocks, state: SlotState, src: torch.Tensor, scale: torch.Tensor | None, plan: Plan,
               seed_key: torch.Tensor, position: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """Rows with top-k: their k best (one topk(max k) for the batch), top-p inside them, Gumbel-max. The
    constrained ones among them choose among their allowed tokens (a masked copy of their rows)."""
    sel, K, BS = plan.topk_rows, plan.k_max, blocks.size
    z = src if plan.topk_all else src[sel]
    if plan.mask_topk is not None:
        at, mask_at = plan.mask_topk  # their rows in z, their rows of the bitmask
        z = z.clone() if z is src else z
        sub = z[at]
        apply_bitmask(sub, bitmask[mask_at], state.vocab_size)
        z[at] = sub
    scale = None if scale is None else (scale if plan.topk_all else scale[sel])
    k = state.top_k[plan.rows][sel]
    p = state.top_p[plan.rows][sel] if plan.top_p_in_k else None
    key = row_keys(seed_key[sel], position[sel], STREAM_TOKEN)
    zb = z.unflatten(1, (blocks.n, BS))
    return draw_among_best(zb, zb.amax(-1), K, blocks.in_block, scale, k, p, key)


def draw_among_best(zb: torch.Tensor, bmax: torch.Tensor, K: int, in_block: torch.Tensor,
                    scale: torch.Tensor | None, k: torch.Tensor, p: torch.Tensor | None,
                    key: torch.Tensor) -> torch.Tensor:
    """Top-k's draw as a pure function (the eager step's `top_k_draw` and the compiled step's engine/plain_draw.py
    share it): over each row's K best tokens of zb (B, blocks, block) with block maxima bmax, scaled by `scale`
    (B, 1) or not, each row's beyond its own k masked, top-p `p` (B,) inside them (None: no row has it), then
    Gumbel-max keyed by token id with `key` (B,). A K above a row's k changes nothing: the extra columns are masked."""
    BS = zb.size(2)
    # the k best tokens lie in the k blocks with the best maxima: topk over those k · BS candidates
    best = bmax.topk(min(K, zb.size(1)), -1).indices  # (B, K')
    cand = zb.gather(1, best[:, :, None].expand(-1, -1, BS)).flatten(1)
    vals, pos = cand.topk(K, -1)  # sorted, best first (the order of z = src · scale too)
    ids = (best[:, :, None] * BS + in_block).flatten(1).gather(1, pos)
    if scale is not None:
        vals = vals * scale
    cols = in_block[:K] if K <= BS else torch.arange(K, device=zb.device)
    vals = vals.masked_fill(cols[None, :] >= k[:, None], float("-inf"))
    if p is not None:
        probs = torch.softmax(vals, -1)
        before = torch.cumsum(probs, -1) - probs
        # a token stays while the mass of the better ones is < p; the best one always stays
        vals = vals.masked_fill((before >= p[:, None]) & (p[:, None] < 1.0), float("-inf"))
    return ids.gather(1, (vals + gumbel(key, ids)).argmax(-1, keepdim=True))[:, 0]
