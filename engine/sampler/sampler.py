"""The step: one token per row from a batch's logits, over the slots' sampling state (engine/sampler/state.py).
Logit bias and min_tokens → penalties → temperature → the grammar's mask → the draw (greedy, hierarchical
Gumbel-max, top-k) → top-p's membership check; one read-back; the top-p redraws of the rows it rejected."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ops import Draw
from engine.params import SamplingParams
from engine.sampler import penalties
from engine.sampler.bitmask import Masker
from engine.sampler.draw import BLOCK_SIZE, TOP_K_MAX, Blocks, top_k_draw
from engine.sampler.noise import STREAM_BLOCK, STREAM_TOKEN, gumbel, row_keys
from engine.sampler.plan import Plan, Plans
from engine.sampler.state import SlotState
from engine.sampler.top_p import Ctx, in_nucleus, redraw
from model.kv_cache import device_index

# exp(EXP_FLOOR) ≈ 1.6e-38, the smallest normal float32's neighbourhood: what lies further below the max weighs nothing
EXP_FLOOR = -87.0


@dataclass
class _Sampled:
    """What `Sampler._sample` leaves on the device for the step's one read-back."""

    token: torch.Tensor  # (B,) long
    logprob: torch.Tensor  # (B,) under the raw distribution
    accepted: torch.Tensor | None  # (B,) bool: in the nucleus (None: no row has top-p)
    top_ids: torch.Tensor | None  # (B, top_n): the most likely tokens (None: no row asked)
    top_lp: torch.Tensor | None
    ctx: Ctx | None  # for the top-p redraws (None: no row has top-p)


class Sampler:
    """The batched, seeded next-token choice over the slots' sampling state (`state`, a `SlotState`).

    `admit` a request into a slot (writes its parameters and prompt), `step(logits, slots)` picks one
    token per row, reads the batch back once and records the tokens; `last` holds each slot's newest
    token for the next decode step. `move` follows a request to another slot.
    """

    def __init__(self, n_slots: int, vocab_size: int, max_len: int, device: torch.device | str = "cpu",
                 block_size: int = BLOCK_SIZE, eos_id: int | None = None) -> None:
        device = torch.device(device)
        self.blocks = Blocks(vocab_size, block_size, device)
        self.state = SlotState(n_slots, vocab_size, max_len, self.blocks.padded, device, eos_id)
        self.plans = Plans(self.state)
        self.vocab_size, self.device = vocab_size, device
        f32 = dict(dtype=torch.float32, device=device)
        # workspaces (rows are batch rows, not slots); padding columns stay -inf
        self._z = torch.full((n_slots, self.padded), float("-inf"), **f32)
        self._e = torch.empty(n_slots, self.padded, **f32)
        self._tmp = torch.full((n_slots, self.padded), float("-inf"), **f32)
        self._masker: Masker | None = None  # grammar masks' workspaces, made with the first constrained step
        self.read_backs = 0  # device→host copies made (tests count them)

    # ------------------------------------------------------------------ the slots (engine/sampler/state.py)
    @property
    def padded(self) -> int:
        """Columns of a step's workspaces: the vocabulary and its -inf sink column in whole blocks (a model's
        vocabulary padded to this is read in place, GPT.pad_vocab)."""
        return self.blocks.padded

    @property
    def n_slots(self) -> int:
        return self.state.n_slots

    @property
    def block(self) -> int:
        """Tokens per block of the hierarchical draw (engine/plain_draw.py draws with the same blocks)."""
        return self.blocks.size

    @property
    def history(self) -> torch.Tensor:
        """(n_slots, max_len) each slot's prompt + output ids (the prompts are prefilled from here)."""
        return self.state.history

    @property
    def last(self) -> torch.Tensor:
        """(n_slots,) each slot's newest token: the next decode step's input."""
        return self.state.last

    def admit(self, slot: int, params: SamplingParams, prompt: list[int], seed: int, top_n: int = 0,
              constrained: bool = False) -> None:
        self.state.admit(slot, params, prompt, seed, top_n, constrained)

    def move(self, src: list[int], dst: list[int]) -> None:
        self.state.move(src, dst)

    def release(self, slot: int) -> None:
        self.state.release(slot)

    def prompt_slice(self, slot: int, start: int, stop: int) -> torch.Tensor:
        return self.state.prompt_slice(slot, start, stop)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self, logits: torch.Tensor, slots: range | list[int], bitmask: torch.Tensor | None = None) -> list[Draw]:
        """Pick one token per row of logits (B, ≥ vocab) for `slots`, record them, return them on the host.
        `bitmask`: on the device, the packed int32 masks (engine/structured_output.py) of the constrained slots
        among them, in slot order; required when some slot is constrained, else None."""
        plan = self.plans.get(slots)
        if plan.masked != (bitmask is not None):
            raise ValueError("a bitmask is required exactly when a slot is constrained")
        token, out = self._read_back(self._sample(logits, plan, bitmask), plan.top_n)
        self.state.record(plan.rows, plan.index, token, plan.presence_frequency)
        return out

    @torch.inference_mode()
    def draw_ahead(self, logits: torch.Tensor, slots: range | list[int]) -> list[list[Draw]] | None:
        """A verification pass's draws in one go: for logits (n, T, ≥ vocab) of `slots`, each row's draw at each of
        its T positions, as `step` draws them position after position when every earlier position's token is
        recorded first (a draw reads its position, not the tokens before it, where no row has penalties, bias,
        min_tokens or a grammar; else None: those rows draw one position a step). Records nothing: the caller
        keeps what holds (`record_ahead`). One read-back, and top-p's redraws, for the n x T draws."""
        plan = self.plans.get(slots)
        if plan.repetition or plan.presence_frequency or plan.bias or plan.min_tokens or plan.masked:
            return None
        n, T = logits.shape[:2]
        flat = self.plans.get([s for s in slots for _ in range(T)])
        self._grow(n * T)
        ahead = torch.arange(T, device=self.device).repeat(n)
        _, draws = self._read_back(self._sample(logits.reshape(n * T, -1), flat, ahead=ahead), flat.top_n)
        return [draws[i * T:(i + 1) * T] for i in range(n)]

    def record_ahead(self, slots: range | list[int], tokens: list[list[int]]) -> None:
        """Record the tokens each slot keeps of its `draw_ahead` draws (at least one each), as `step` would have one
        by one."""
        self.state.record_runs(list(slots), tokens)

    def _grow(self, rows: int) -> None:
        """Workspaces of at least `rows` rows (a verification pass's draws: rows x positions)."""
        if rows > self._z.size(0):
            self._z = torch.full((rows, self.padded), float("-inf"), dtype=torch.float32, device=self.device)
            self._e = torch.empty_like(self._z)
            self._tmp = torch.full_like(self._z, float("-inf"))

    def _read_back(self, s: _Sampled, top_n: int) -> tuple[torch.Tensor, list[Draw]]:
        """The step's one device→host copy of what `_sample` drew (and top-p's redraws): the tokens on the device
        and the draws on the host."""
        token = s.token
        parts = [token.double()[:, None], s.logprob.double()[:, None]]
        if s.accepted is not None:
            parts.append(s.accepted.double()[:, None])
        if s.top_ids is not None:
            parts += [s.top_ids.double(), s.top_lp.double()]
        rows = torch.cat(parts, 1).tolist()
        self.read_backs += 1
        if s.accepted is not None:
            token = self._redraw_rejected(rows, token, s.ctx)
        first_top = 3 if s.accepted is not None else 2
        out = []
        for r in rows:
            top = None
            if top_n:
                ids, lps = r[first_top:first_top + top_n], r[first_top + top_n:first_top + 2 * top_n]
                top = [(int(i), lp) for i, lp in zip(ids, lps)]
            out.append(Draw(int(r[0]), r[1], top))
        return token, out

    def plain_kind(self, slots: range | list[int]) -> str | None:
        """The kind of engine.plain_draw that draws these slots' rows exactly as `step` would (greedy; T = 1;
        T < 1; each with or without top-p; top-k up to TOP_K_MAX), or None when some row needs more (a larger
        top-k, penalties, bias, min_tokens, a grammar, top-n)."""
        kinds = [self.state.kinds[s] for s in slots]
        if any(k is None or k.repetition or k.presence_frequency or k.top_n or k.bias or k.min_tokens
               or k.constrained for k in kinds):
            return None
        if any(k.top_k for k in kinds):
            return "top_k" if all(0 < k.top_k <= TOP_K_MAX for k in kinds) else None
        if all(k.greedy for k in kinds):
            return "greedy"
        if any(k.greedy for k in kinds):
            return None
        if all(k.unit_temperature for k in kinds):
            return "sample"
        return "sample_sharpened" if all(k.sharpened for k in kinds) and self.device.type == "cpu" else None

    def plain_inputs(self, n: int) -> tuple[torch.Tensor, ...]:
        """What engine.plain_draw reads of slots 0..n-1 (views): 1/T, top-k, top-p, the seed keys, the history
        lengths and the prompt lengths (their difference: the index of the token drawn)."""
        s = self.state
        return s.inv_temp[:n], s.top_k[:n], s.top_p[:n], s.seed_key[:n], s.length[:n], s.prompt_len[:n]

    @torch.inference_mode()
    def take(self, slots: range | list[int], token: torch.Tensor, logprob: torch.Tensor,
             *nucleus: torch.Tensor) -> list[Draw]:
        """Record tokens drawn outside `step` (engine.plain_draw, inside a compiled decode step) and return them
        as `step` would: one device→host copy. `nucleus`: a sampled kind's (accepted, raw, e, total, lse), whose
        rejected rows are drawn again here as `step` draws them (top-p's redraw)."""
        plan = self.plans.get(slots)
        parts = [token.double(), logprob.double()]
        if nucleus:
            parts.append(nucleus[0].double())
        rows = torch.stack(parts, 1).tolist()
        self.read_backs += 1
        if nucleus and not all(r[2] for r in rows):  # the redraw's inputs only when a draw left its nucleus
            _, raw, e, total, lse = nucleus
            st, rs = self.state, plan.rows
            ctx = Ctx(raw, e, total, lse, st.seed_key[rs], st.length[rs] - st.prompt_len[rs], st.top_p[rs])
            token = self._redraw_rejected(rows, token, ctx)
        self.state.record(plan.rows, plan.index, token, plan.presence_frequency)
        return [Draw(int(r[0]), r[1]) for r in rows]

    def _redraw_rejected(self, rows: list[list[float]], token: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """Top-p's second half: the rows whose draw fell outside the nucleus (rows[i][2] false) are drawn again
        (`top_p.redraw`); their token and logprob are written into `rows`. Returns the batch's tokens."""
        rejected = [i for i, r in enumerate(rows) if not r[2]]
        if not rejected:
            return token
        fixed, rounds = redraw(rejected, token, ctx, self.blocks)
        self.read_backs += rounds
        for i, (t, lp) in zip(rejected, fixed):
            rows[i][0], rows[i][1] = t, lp
        token = token.clone()
        token[device_index(rejected, self.device)] = device_index([t for t, _ in fixed], self.device)
        return token

    def _sample(self, logits: torch.Tensor, plan: Plan, bitmask: torch.Tensor | None = None,
                ahead: torch.Tensor | None = None) -> _Sampled:
        """`ahead` (B,): positions past each row's next (`draw_ahead`)."""
        B, V, P, NB, BS = plan.n, self.vocab_size, self.padded, self.blocks.n, self.blocks.size
        state = self.state
        if logits.size(0) != B or logits.size(1) < V:
            raise ValueError(f"logits {tuple(logits.shape)} for {B} slots and a vocabulary of {V}")
        rows = plan.rows
        raw = logits[:, :V].float()  # a padded model vocabulary is never sampled
        inv_t = state.inv_temp[rows][:, None]
        penalized = plan.repetition or plan.presence_frequency or plan.bias or plan.min_tokens
        masked = bitmask is not None
        if penalized:
            # z = biased, penalized logits / temperature, in the workspace
            src = self._z[:B]
            src[:, :V].copy_(raw)
            if plan.bias or plan.min_tokens:
                penalties.bias(state, src, plan)
            if plan.repetition or plan.presence_frequency:
                penalties.penalize(state, src, plan)
            if not plan.z_is_raw:
                src[:, :V].mul_(inv_t)
            scale = None  # src already holds z
        elif logits.size(1) >= P and logits.dtype == torch.float32 and logits.stride(1) == 1:
            # the model's vocabulary is padded to whole blocks (GPT.pad_vocab): its logits serve as they are,
            # no copy; the padding columns become -inf in place
            src = logits[:, :P]
            if P > V:
                src[:, V:] = float("-inf")
            scale = None if plan.z_is_raw else inv_t  # z = src · scale, never materialized
        else:
            src = self._z[:B]
            src[:, :V].copy_(raw)
            scale = None if plan.z_is_raw else inv_t
        srcb = src.unflatten(1, (NB, BS))
        bmax = srcb.amax(-1)  # (B, NB)
        m = bmax.amax(-1, keepdim=True)  # (B, 1)
        d = torch.sub(src, m, out=self._e[:B])
        # On a CPU, d · temperature⁻¹ is clamped at EXP_FLOOR before its exp when some row has a temperature below 1:
        # torch's CPU exp (and exp2) take a far slower path where the result is subnormal or 0, which low
        # temperatures make common (docs/performance.md, "Measurements moved out of code comments"). The clamp is one
        # more pass, so the other passes (raw normalizer, T ≥ 1) go without: a raw spread of 87 nats is rare. (A GPU's
        # exp has no such path.)
        clamp = (lambda x: x.clamp_(min=EXP_FLOOR)) if plan.clamp else (lambda x: x)
        if penalized:
            e = clamp(d).exp_()  # exp(z - max z)
            m_raw = raw.amax(-1, keepdim=True)
            lse = m_raw[:, 0] + torch.sub(raw, m_raw, out=self._tmp[:B, :V]).exp_().sum(-1).log()
        elif scale is None:  # temperature 1 everywhere: z = raw
            e = d.exp_()
            lse = m[:, 0] + e.sum(-1).log() if masked else None  # (masked: the raw normalizer, before the mask)
        else:  # raw normalizer from exp(raw − max), then exp((raw − max) / T) for the draw
            lse = m[:, 0] + torch.exp(d, out=self._tmp[:B]).sum(-1).log()
            e = clamp(d.mul_(scale)).exp_()
        if masked:  # the grammar's mask multiplies e: z and the log-probabilities stay unmasked (see Masker.apply)
            if self._masker is None:
                self._masker = Masker(state.n_slots, V, BS, self.device)
            self._masker.apply(e, plan, bitmask)
        bsum = e.unflatten(1, (NB, BS)).sum(-1)  # (B, NB) block masses (unnormalized)
        total = bsum.sum(-1)  # (B,)
        if masked:
            self._masker.rescue(e, bsum, total, src, scale, plan, bitmask)
        if lse is None:
            lse = m[:, 0] + total.log()

        seed_key = state.seed_key[rows]
        position = state.length[rows] - state.prompt_len[rows]  # index of the token being generated
        if ahead is not None:
            position = position + ahead
        token = None
        if plan.all_greedy or plan.greedy is not None:
            token = self.blocks.argmax(srcb, bmax.argmax(-1))
            if plan.mask_greedy is not None:  # constrained greedy rows: the best allowed token, where e is largest
                g = plan.mask_greedy
                token = token.index_copy(0, g, e[g].argmax(-1))
        if plan.any_sampled:
            key_b = row_keys(seed_key, position, STREAM_BLOCK)
            key_t = row_keys(seed_key, position, STREAM_TOKEN)
            block = (bsum.log() + gumbel(key_b, self.blocks.ids)).argmax(-1)
            sampled = self.blocks.draw(srcb, block, key_t, scale, e if masked else None, plan.mask_rows)
            token = sampled if token is None else torch.where(plan.greedy, token, sampled)
        if plan.topk_rows is not None:
            tk = top_k_draw(self.blocks, state, src, scale, plan, seed_key, position, bitmask)
            if plan.topk_all:
                token = tk
            else:
                token = token.clone() if token is not None else torch.zeros(B, dtype=torch.long, device=src.device)
                token[plan.topk_rows] = tk
        logprob = raw.gather(1, token[:, None])[:, 0] - lse

        accepted = ctx = None
        if plan.top_p:
            top_p = state.top_p[rows]
            accepted = in_nucleus(e, token, total, top_p, self._tmp[:B])
            ctx = Ctx(raw, e, total, lse, seed_key, position, top_p)
            if plan.greedy is not None:
                accepted |= plan.greedy
            if plan.topk_rows is not None:
                accepted[plan.topk_rows] = True

        top_ids = top_lp = None
        if plan.top_n:
            if not penalized:  # src holds the raw logits (a grammar's mask went into e, not src)
                rb, rbmax = srcb, bmax
            else:
                self._tmp[:B, :V] = raw
                self._tmp[:B, V:] = float("-inf")
                rb = self._tmp[:B].unflatten(1, (NB, BS))
                rbmax = rb.amax(-1)
            n = min(plan.top_n, V)
            blocks = rbmax.topk(min(n, NB), -1).indices  # the n best tokens lie in the n best blocks
            cand = rb.gather(1, blocks[:, :, None].expand(-1, -1, BS)).view(B, -1)
            cand_ids = (blocks[:, :, None] * BS + self.blocks.in_block).view(B, -1)
            vals, pos = cand.topk(n, -1)
            top_ids, top_lp = cand_ids.gather(1, pos), vals - lse[:, None]
        return _Sampled(token, logprob, accepted, top_ids, top_lp, ctx)
