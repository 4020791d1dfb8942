"""Grammar masks (structured output) on the device: the packed int32 bitmasks of engine/structured_output.py
unpacked by table lookup (`mask_bytes`, `bitmask_rows`, `apply_bitmask`), applied to a step's exp(z − max z),
and the rows whose allowed tokens underflowed there recomputed exactly (`Masker`)."""

from __future__ import annotations

import torch

from engine.sampler.plan import Plan

# A constrained row whose allowed tokens carry less mass than this, relative to its most likely token overall, is
# recomputed relative to its most likely allowed token (Masker.rescue). Above it, the tokens whose exp
# underflowed (< 1.2e-38) weigh < 1e-21 of the allowed mass each: nothing in float32.
MASK_MASS_FLOOR = 2.0 ** -40
# devices where Masker.rescue reads its flags back (no device to wait for); elsewhere it stays on the device
READBACK_DEVICES = ("cpu",)

# byte value → its 8 tokens' values: additive (0 allowed, -inf not) or multiplicative (1 allowed, 0 not), little-endian
# bit order: token t is bit t % 8 of byte t // 8 of the packed mask
_TABLES: dict[tuple[torch.device, bool], torch.Tensor] = {}


def _table(device: torch.device, multiply: bool = False) -> torch.Tensor:
    t = _TABLES.get((device, multiply))
    if t is None:
        bits = (torch.arange(256, dtype=torch.int32)[:, None] >> torch.arange(8, dtype=torch.int32)) & 1
        yes, no = (1.0, 0.0) if multiply else (0.0, float("-inf"))
        t = _TABLES[(device, multiply)] = torch.where(bits == 1, yes, no).to(device)
    return t


def mask_bytes(bitmask: torch.Tensor, vocab_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The packed int32 bitmask (k, ceil(V/32)) as int64 byte values (k, ceil(V/8)), the tables' indices (bit j of
    word i is token 32·i + j: llguidance's and xgrammar's layout, engine/structured_output.py; the words are read as
    little-endian bytes). `out`: a workspace of ≥ k rows."""
    k, nbytes = bitmask.size(0), (vocab_size + 7) // 8
    by = bitmask.contiguous().view(torch.uint8).view(k, -1)[:, :nbytes]
    return by.long() if out is None else out[:k].copy_(by)


def bitmask_rows(idx: torch.Tensor, vocab_size: int, device: torch.device,
                 out: torch.Tensor | None = None, multiply: bool = False) -> torch.Tensor:
    """(k, V) float rows for the mask bytes `idx` (k, nbytes): 0 (allowed) / -inf, or with `multiply` 1 / 0;
    `out`: a workspace of ≥ k rows of 8 · nbytes. One index_select of a 256-entry table (masked_fill and where
    are several times slower on a CPU)."""
    k, nbytes = idx.shape
    table = _table(device, multiply)
    if out is None:
        return torch.index_select(table, 0, idx.flatten()).view(k, -1)[:, :vocab_size]
    rows = out[:k]
    torch.index_select(table, 0, idx.flatten(), out=rows.view(k * nbytes, 8))
    return rows[:, :vocab_size]


def apply_bitmask(z: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """z (k, ≥ vocab_size) float: -inf where the packed int32 bitmask (k, ceil(V/32)) has a 0 bit (see mask_bytes),
    in place. For the few rows that need masked logits (top-k, Masker.rescue); the step masks e."""
    z[:, :vocab_size].add_(bitmask_rows(mask_bytes(bitmask, vocab_size), vocab_size, z.device))


class Masker:
    """A step's grammar masks: the constrained rows of e = exp(z − max z) multiplied by their 0/1 masks (`apply`),
    in workspaces kept across steps (no allocation per step), and the rows whose allowed tokens underflowed there
    recomputed (`rescue`). `block`: the block size of the step's block sums."""

    def __init__(self, n_slots: int, vocab_size: int, block: int, device: torch.device) -> None:
        nbytes = (vocab_size + 7) // 8
        self.vocab_size, self.block = vocab_size, block
        self.rows = torch.empty(n_slots, 8 * nbytes, device=device)  # (k, 8 · bytes) float rows
        self.bytes = torch.empty(n_slots, nbytes, dtype=torch.long, device=device)  # (k, bytes) indices

    def apply(self, e: torch.Tensor, plan: Plan, bitmask: torch.Tensor) -> None:
        """The grammar's mask on the constrained rows of e (B, padded): a disallowed token's e becomes 0 (one
        index_select of 0/1 rows from the packed bits, one multiply).

        Masking e rather than z (−inf before the exp) leaves every other pass that of an unconstrained batch:
        the raw normalizer of the log-probabilities comes from the same exp, and no exp of −inf (a slow path on
        CPUs) is taken: measurably faster on a CPU (docs/performance.md, "Measurements moved out of code
        comments"). The max is over all tokens, not the allowed ones: `rescue` handles the rows whose allowed
        tokens all lie far below it."""
        V = self.vocab_size
        idx = mask_bytes(bitmask, V, self.bytes)
        allowed = bitmask_rows(idx, V, e.device, self.rows, multiply=True)  # (k, V) 1 / 0
        # the padding columns become 0 too (they hold exp(EXP_FLOOR) where clamped): constrained rows draw from
        # log e; the other rows' e stays as it would be without them
        if plan.mask_rows is None:
            e[:, :V].mul_(allowed)
            e[:, V:] = 0.0
        else:
            sub = e[plan.mask_rows]
            sub[:, :V].mul_(allowed)
            sub[:, V:] = 0.0
            e[plan.mask_rows] = sub

    def rescue(self, e: torch.Tensor, bsum: torch.Tensor, total: torch.Tensor, src: torch.Tensor,
               scale: torch.Tensor | None, plan: Plan, bitmask: torch.Tensor) -> None:
        """Constrained rows whose allowed mass in e (relative to the max over all tokens) is below MASK_MASS_FLOOR
        (the grammar allows only tokens the model finds far less likely: their exp may have underflowed) get e,
        bsum and total again relative to the max over their allowed tokens: exact. A read-back of one flag per
        constrained row; the recomputation runs on those rows only (rare: a gap of ~28 nats · T). On a GPU the
        read-back would stall the step: there every constrained row is recomputed and kept where its mass is low
        (`_rescue_where`)."""
        mass = total if plan.mask_rows is None else total[plan.mask_rows]
        if e.device.type not in READBACK_DEVICES:
            self._rescue_where(e, bsum, total, src, scale, plan, bitmask, mass < MASK_MASS_FLOOR)
            return
        low = (mass < MASK_MASS_FLOOR).nonzero()[:, 0]
        if not low.numel():
            return
        rows = low if plan.mask_rows is None else plan.mask_rows[low]
        er, b = self._allowed_exp(src[rows], bitmask[low], None if scale is None else scale[rows])  # a copy
        e[rows] = er
        bsum[rows] = b
        total[rows] = b.sum(-1)

    def _rescue_where(self, e: torch.Tensor, bsum: torch.Tensor, total: torch.Tensor, src: torch.Tensor,
                      scale: torch.Tensor | None, plan: Plan, bitmask: torch.Tensor, low: torch.Tensor) -> None:
        """`rescue` without a read-back: every constrained row recomputed, kept (torch.where) where `low` (one flag
        per constrained row)."""
        rows = plan.mask_rows  # None: every row is constrained
        er, b = self._allowed_exp(src.clone() if rows is None else src[rows], bitmask,
                                  scale if rows is None or scale is None else scale[rows])
        sel = (slice(None),) if rows is None else (rows,)
        e[sel] = torch.where(low[:, None], er, e[sel])
        bsum[sel] = torch.where(low[:, None], b, bsum[sel])
        total[sel] = torch.where(low, b.sum(-1), total[sel])

    def _allowed_exp(self, z: torch.Tensor, bitmask: torch.Tensor,
                     scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The one recomputation of both rescues, on rows z (R, padded) of the logits that it owns (a copy): under
        the rows' masks, exp(z − the max allowed z) (R, padded) and its block sums (R, n_blocks)."""
        apply_bitmask(z, bitmask, self.vocab_size)
        if scale is not None:
            z.mul_(scale)
        top = z.amax(-1, keepdim=True).clamp_(min=torch.finfo(z.dtype).min)  # (no allowed token: e stays 0)
        er = z.sub_(top).exp_()  # (exp's slow path on the -inf entries: rare rows)
        return er, er.unflatten(1, (-1, self.block)).sum(-1)
