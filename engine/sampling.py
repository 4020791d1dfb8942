"""Next-token selection on the model's device, vectorized over the batch.

`SlotState` keeps every request's sampling state as tensors indexed by KV-cache slot (temperature,
top-k, top-p, penalties, seed, the token history), written once when the request is admitted, so a
decode step builds nothing from Python lists; `Sampler` draws each step's tokens from it and reads back
one small tensor.

Randomness is counter-based, as in vLLM's GPU sampler (`vllm/v1/worker/gpu/sample/gumbel.py`):
the Gumbel noise of token t at step n of a request with seed s is a hash of (s, n, t). It belongs to
the token id, not to a rank or a batch row, so a seeded request gives the same tokens alone or in any
batch, and a filtered row needs noise only for its candidates. Sampling is exact (Gumbel-max:
argmax(z + G) is distributed as softmax(z)) and hierarchical, so no full vocabulary of noise is drawn:

    block b  ~ softmax over blocks of logsumexp(z[b])      (noise keyed by block id)
    token t  ~ softmax(z) within block b                   (noise keyed by token id)

which is softmax(z) exactly, since P(b) = Σ_{t∈b} p_t. The block sums are the full-vocabulary pass
that the log-probabilities need anyway; the noise is a few hundred hashes per row.

Order of logit processing (Hugging Face's and vLLM's): logit bias and min_tokens (EOS and stop token ids
at -inf until a request has min_tokens tokens) → penalties (repetition on prompt + output, presence and
frequency on output) → temperature → top-k → top-p. Temperature 0 is greedy argmax. Rows of a batch that
use none of these pay nothing for them: each is a flag of the slot's kind and of the batch's plan.
- top-k: `topk(max k)` over the batch and a per-row cut (TGI's heterogeneous top-k); no full sort.
- top-p, exact and sort-free, by rejection (FlashInfer's scheme): draw from the row's distribution;
  the token is in the nucleus iff the mass of strictly more likely tokens is < top_p, checked in one
  pass. The nucleus holds mass ≥ top_p, so a draw is accepted with probability ≥ top_p; a rejected
  draw raises a pivot (only tokens more likely than it can be in the nucleus) and the row is drawn
  again from above the pivot with fresh noise. The accepted token is distributed exactly as the
  renormalized nucleus. Rows whose first draw is rejected (probability ≤ 1 − top_p each) are
  finished after the step's read-back, on those rows only.

- grammar masks (structured output): a constrained row's exp(z − max z) is multiplied by its 0/1 mask
  before the block sums, so its draw, top-p and greedy choice see only allowed tokens while every
  other pass stays that of an unconstrained row; top-k rows take a masked copy of their logits.

Reported log-probabilities are under the model's own distribution (raw logits, temperature 1), as
TGI and OpenAI report them, whatever the sampling parameters were (a grammar's mask included).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from model.kv_cache import device_index

BLOCK_SIZE = 256  # tokens per block of the hierarchical draw (√V-ish for GPT-2's 50257)

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # Thomas Mueller's 32-bit mixer; < 2^27, so int64 products never overflow
STREAM_TOKEN, STREAM_BLOCK = 0, 1  # + 2 · round for the top-p redraws


# Temperatures below this decode greedily (as vLLM's _SAMPLING_EPS): 1/T would overflow float32 long before
# T reaches 0 (T = 5e-324 is a valid JSON number), and the distribution is already one-hot.
GREEDY_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 0.01  # dividing logits by less overflows; the APIs refuse it
# Seeds (asked for, or drawn when a request has none and reported back) are at most 2^53 - 1, the largest integer
# every JSON reader holds exactly (a JavaScript number; a JSON Schema validator compares as doubles, so a larger
# bound would let it call 2^63 + 100 "valid"): any client can send the same seed back exactly.
RANDOM_SEED_BITS = 53
MAX_SEED = 2**RANDOM_SEED_BITS - 1
MIN_TOP_P = 1e-6  # smaller top_p (5e-324 is valid JSON) keeps only the most likely token, as this does
# A constrained row whose allowed tokens carry less mass than this, relative to its most likely token overall, is
# recomputed relative to its most likely allowed token (Sampler._rescue_underflow). Above it, the tokens whose exp
# underflowed (< 1.2e-38) weigh < 1e-21 of the allowed mass each: nothing in float32.
MASK_MASS_FLOOR = 2.0 ** -40
# devices where _rescue_underflow reads its flags back (no device to wait for); elsewhere it stays on the device
READBACK_DEVICES = ("cpu",)
# exp(EXP_FLOOR) ≈ 1.6e-38, the smallest normal float32's neighbourhood: what lies further below the max weighs nothing
EXP_FLOOR = -87.0
# The logit min_tokens gives EOS and the stop ids: finite, far below any real logit (even times 1e5, the largest
# inverse temperature, and 100, the largest repetition penalty), so they are never drawn beside another token, but a
# grammar that allows nothing else (one complete at the start) still gets them: the grammar outranks min_tokens, as
# it does once it is complete (the core ends the request there). At -inf that row had no token left and drew token 0.
SUPPRESSED_LOGIT = -1e30


@dataclass(frozen=True)
class Bound:
    """An interval of allowed values (None: unbounded on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def __contains__(self, v) -> bool:  # NaN is in no interval
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le))

    def text(self) -> str:
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        if low is None or self.le is None:
            return f">= {self.ge}" if self.ge is not None else f"> {self.gt}" if self.gt is not None \
                else f"<= {self.le}"
        return f"in {low}, {self.le}]"

    def field(self, **override) -> dict:
        """The bound as pydantic `Field` keyword arguments; `override` states where an API differs in range (and
        why, at the call)."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None} | override


# The one table of sampling bounds: SamplingParams.errors checks it and the HTTP request models take their `Field`
# limits from it (app/protocol), so the library, the engine and both APIs accept the same values.
BOUNDS: dict[str, Bound] = {
    "max_new_tokens": Bound(ge=1),  # (the engine core also runs 0: a request that only scores its prompt)
    "temperature": Bound(ge=0, le=100),
    "top_k": Bound(ge=0),
    "top_p": Bound(gt=0, le=1),
    "repetition_penalty": Bound(ge=MIN_REPETITION_PENALTY, le=100),
    "presence_penalty": Bound(ge=-2, le=2),
    "frequency_penalty": Bound(ge=-2, le=2),
    "seed": Bound(ge=0, le=MAX_SEED),
    "logit_bias": Bound(ge=-100, le=100),  # each value
    # min_tokens above max_new_tokens means what it says (no stop before max_new_tokens): vLLM refuses it, but no
    # JSON schema can state the comparison and /openapi.json must describe every refusal
    "min_tokens": Bound(ge=0),
}
_INTEGER = ("max_new_tokens", "top_k", "seed", "min_tokens")


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 → greedy
    top_k: int = 0  # 0 → off
    top_p: float = 1.0  # 1 → off; else the smallest set of tokens with probability ≥ top_p
    repetition_penalty: float = 1.0  # 1 → off; > 1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per time a token was generated
    seed: int | None = None  # None → a random seed, reported back so the result can be reproduced
    stop: list[str] = field(default_factory=list)  # stop strings, matched on decoded text
    stop_at_eos: bool = True
    # OpenAI's logit_bias: token id → added to its logit before penalties and temperature (in [-100, 100])
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # vLLM's: EOS (when stop_at_eos) and stop_token_ids cannot be drawn before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: drawing one ends the request (finish STOP)

    def errors(self) -> list[str]:
        """Problems with the parameters, each naming its field (empty when valid)."""
        e = []
        for name, bound in BOUNDS.items():
            if name == "logit_bias":
                if any(v not in bound for v in self.logit_bias.values()):
                    e.append(f"logit_bias values must be {bound.text()}")
                continue
            v = getattr(self, name)
            if name == "seed" and v is None:
                continue
            if name in _INTEGER and not isinstance(v, int):
                e.append(f"{name} must be an integer {bound.text()}, got {v!r}")
            elif v not in bound:
                e.append(f"{name} must be {'an integer ' if name in _INTEGER else ''}{bound.text()}, got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            e.append("stop must be a list of non-empty strings")
        return e

    def validate(self) -> None:
        if errs := self.errors():
            raise ValueError("; ".join(errs))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def bad_token(ids: Iterable[int], vocab_size: int) -> tuple[int, int] | None:
    """The first (position, id) of `ids` outside the vocabulary [0, vocab_size), or None: the one token-id range
    check (prompts, stop_token_ids, logit_bias keys; validation, the core and the sampler)."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            return i, t
    return None


def draw_seed() -> int:
    """A random seed for a request that names none: the one place seeds are drawn (at validation: the
    server's app/validation.py, the library's engine.generate.make_sequences); everything after requires one."""
    return secrets.randbits(RANDOM_SEED_BITS)


# ---------------------------------------------------------------------------------------------- noise
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer on int64 tensors holding values in [0, 2^32)."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def seed_keys(seed: torch.Tensor) -> torch.Tensor:
    """A request seed (int64, < 2^63) folded into 32 well-mixed bits; computed once per request."""
    return _mix32(_mix32(seed & _M32) ^ ((seed >> 32) & _M32))


def row_keys(seed_key: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """(B,) keys of the random stream `stream` at generated position `position` of requests with these seed keys."""
    return _mix32(_mix32(seed_key ^ (position & _M32)) ^ (stream & _M32))


def gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise (B, N) float32 for ids (B, N) or (N,) under per-row keys (B,): a pure function."""
    x = _mix32(keys[:, None] ^ ids)
    x = _mix32(x ^ (keys[:, None] >> 7))
    u = (x.to(torch.float64) + 0.5) * 2.0**-32  # in (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).float()


# ---------------------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class _Kind:
    """What a slot's parameters need, on the host (decides which code runs; no device reads)."""

    greedy: bool
    top_k: int
    top_p: bool
    repetition: bool
    presence_frequency: bool
    unit_temperature: bool
    top_n: int
    bias: bool = False  # logit_bias
    min_tokens: bool = False  # EOS / stop token ids suppressed for the first min_tokens tokens
    constrained: bool = False  # a grammar masks its tokens (engine/structured_output.py)
    sharpened: bool = False  # temperature below 1: d / T reaches exp's slow path sooner (see _sample)


@dataclass
class _Plan:
    """The host-side view of one batch composition, cached until a slot changes."""

    n: int
    rows: slice | torch.Tensor  # the slots as a view (contiguous) or an index
    index: torch.Tensor  # the slots as an index (B,)
    greedy: torch.Tensor | None  # (B,) bool where greedy, None when no row or every row is
    all_greedy: bool
    any_sampled: bool  # temperature rows without top-k
    topk_rows: torch.Tensor | None  # batch rows with top-k (None: none; all rows: topk_all)
    topk_all: bool
    k_max: int
    top_p: bool  # some temperature row (not top-k) has top-p
    top_p_in_k: bool
    repetition: bool
    presence_frequency: bool
    z_is_raw: bool  # no penalty, temperature 1 everywhere: processed logits == raw logits
    top_n: int
    bias: bool = False
    min_tokens: bool = False
    masked: bool = False  # some row is constrained: step() takes a bitmask for those rows
    mask_rows: torch.Tensor | None = None  # their batch rows (None: every row is)
    mask_greedy: torch.Tensor | None = None  # the batch rows of the constrained greedy ones
    mask_topk: tuple[torch.Tensor, torch.Tensor] | None = None  # constrained top-k rows: in topk_rows, in the bitmask
    clamp: bool = False  # clamp d / T at EXP_FLOOR before its exp (a CPU and some row with temperature < 1)


@dataclass
class Draw:
    """One token per row as the host sees it."""

    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None  # the top_n most likely (id, logprob) under the raw distribution
    stop: bool = False  # set by the engine core: the request's grammar is complete (structured output)
    failed: str = ""  # set by the engine core: the grammar refused this token (the library's reason)


class SlotState:
    """Every slot's sampling state on the device, as tensors indexed by KV-cache slot: the parameters, the seed's
    key, the token history (prompt + output) with its first occurrences and seen set, the newest token, and
    (allocated on first use) logit bias and min_tokens suppression.

    `admit` writes a request into a slot, `move` follows requests to other slots, `release` empties one,
    `record` appends a step's tokens. `kinds` holds what each slot's request needs, on the host; `version`
    counts the admits, moves and releases (the batch plans of `Sampler`, which draws from this state, are valid
    for one version).
    """

    def __init__(self, n_slots: int, vocab_size: int, max_len: int, padded: int, device: torch.device,
                 eos_id: int | None = None) -> None:
        self.n_slots, self.vocab_size, self.max_len, self.padded = n_slots, vocab_size, max_len, padded
        self.device = device
        dev, n = device, n_slots
        f32 = dict(dtype=torch.float32, device=dev)
        i64 = dict(dtype=torch.long, device=dev)
        self.inv_temp = torch.ones(n, **f32)
        self.top_k = torch.zeros(n, **i64)
        self.top_p = torch.ones(n, **f32)
        self.repetition = torch.ones(n, **f32)
        self.presence = torch.zeros(n, **f32)
        self.frequency = torch.zeros(n, **f32)
        self.seed_key = torch.zeros(n, **i64)  # seed_keys(seed)
        self.history = torch.full((n, max_len), vocab_size, **i64)  # prompt + output ids; V = empty
        self.length = torch.zeros(n, **i64)  # entries used in history
        self.prompt_len = torch.zeros(n, **i64)
        self.first = torch.zeros(n, max_len, dtype=torch.bool, device=dev)  # output token new at that position
        self.seen = torch.zeros(n, padded, dtype=torch.bool, device=dev)  # tokens output so far
        self.last = torch.zeros(n, **i64)  # the newest token of each slot: the next decode step's input
        self.eos_id = eos_id  # suppressed under min_tokens (with stop_at_eos)
        self.min_tokens = torch.zeros(n, **i64)
        # allocated on first use (most servers never see them): logit_bias as a dense (n, padded) row per slot,
        # and the ids min_tokens suppresses, (n, S) with V (the -inf sink column) for an empty entry
        self.bias: torch.Tensor | None = None
        self.suppress: torch.Tensor | None = None
        self._tensors = ["inv_temp", "top_k", "top_p", "repetition", "presence", "frequency", "seed_key",
                         "history", "length", "prompt_len", "first", "seen", "last", "min_tokens"]  # what move carries
        self.kinds: list[_Kind | None] = [None] * n  # what each slot's request needs (None: empty)
        self.version = 0  # counts the changes to the slots (admit, move, release)

    def admit(self, slot: int, params: SamplingParams, prompt: list[int], seed: int, top_n: int = 0,
              constrained: bool = False) -> None:
        """Write a request's parameters, seed and prompt into `slot` (the seed was drawn at validation).
        `top_n`: also report the top_n most likely tokens at every step (logprobs alternatives).
        `constrained`: a grammar restricts its tokens; every step() then gives this slot's row of the bitmask.
        """
        n = len(prompt)
        if not 0 < n <= self.max_len:
            raise ValueError(f"prompt of {n} tokens does not fit the sampler's {self.max_len} positions")
        greedy = params.greedy
        self.inv_temp[slot] = 1.0 if greedy else 1.0 / params.temperature
        self.top_k[slot] = params.top_k if params.top_k > 0 else self.vocab_size
        # floor: p · (block mass) must stay > 0 in float32, or even the most likely token is never accepted
        self.top_p[slot] = max(params.top_p, MIN_TOP_P)
        self.repetition[slot] = params.repetition_penalty
        self.presence[slot] = params.presence_penalty
        self.frequency[slot] = params.frequency_penalty
        self.seed_key[slot] = seed_keys(torch.tensor([seed]))[0]
        self.history[slot, :n] = device_index(prompt, self.device)
        self.history[slot, n:] = self.vocab_size
        self.length[slot] = n
        self.prompt_len[slot] = n
        self.first[slot] = False
        self.seen[slot] = False
        self.last[slot] = prompt[-1]
        top_k = params.top_k if not greedy and 0 < params.top_k < self.vocab_size else 0
        bias, suppress = self._admit_bias(slot, params)
        self.kinds[slot] = _Kind(
            greedy=greedy, top_k=top_k, top_p=not greedy and params.top_p < 1.0,
            repetition=params.repetition_penalty != 1.0,
            presence_frequency=params.presence_penalty != 0.0 or params.frequency_penalty != 0.0,
            unit_temperature=greedy or params.temperature == 1.0, top_n=top_n, bias=bias, min_tokens=suppress,
            constrained=constrained, sharpened=not greedy and params.temperature < 1.0)
        self.version += 1

    def _admit_bias(self, slot: int, params: SamplingParams) -> tuple[bool, bool]:
        """Write the slot's logit bias and min_tokens suppression (clearing a previous request's)."""
        V = self.vocab_size
        if params.logit_bias:
            if self.bias is None:
                self.bias = torch.zeros(self.n_slots, self.padded, dtype=torch.float32, device=self.device)
            if bad_token(params.logit_bias, V):  # (the core refused these already)
                raise ValueError(f"logit_bias: token ids must be in [0, {V})")
            self.bias[slot] = 0.0
            self.bias[slot, device_index(list(params.logit_bias), self.device)] = device_index(
                list(params.logit_bias.values()), self.device, torch.float32)
        elif self.bias is not None:
            self.bias[slot] = 0.0
        ids = list(dict.fromkeys(params.stop_token_ids))
        if params.stop_at_eos and self.eos_id is not None and self.eos_id not in ids:
            ids.append(self.eos_id)
        ids = [i for i in ids if 0 <= i < V] if params.min_tokens > 0 else []
        self.min_tokens[slot] = params.min_tokens if ids else 0
        if ids:
            if self.suppress is None or self.suppress.size(1) < len(ids):
                grown = torch.full((self.n_slots, max(4, 1 << (len(ids) - 1).bit_length())), V, dtype=torch.long,
                                   device=self.device)
                if self.suppress is not None:
                    grown[:, :self.suppress.size(1)] = self.suppress
                self.suppress = grown
            self.suppress[slot] = V
            self.suppress[slot, :len(ids)] = device_index(ids, self.device)
        return bool(params.logit_bias), bool(ids)

    def release(self, slot: int) -> None:
        self.kinds[slot] = None
        self.version += 1

    def move(self, src: list[int], dst: list[int]) -> None:
        """Move the requests in slots `src` to slots `dst` (a permutation of them is fine: swaps work)."""
        s = device_index(src, self.device)
        d = device_index(dst, self.device)
        for name in self._tensors:
            t = getattr(self, name)
            t[d] = t[s]  # the right side is gathered into a new tensor first
        for t in (self.bias, self.suppress):
            if t is not None:
                t[d] = t[s]
        kinds = [self.kinds[i] for i in src]
        for i, k in zip(dst, kinds):
            self.kinds[i] = k
        for i in set(src) - set(dst):
            self.kinds[i] = None
        self.version += 1

    def prompt_slice(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Prompt tokens [start, stop) of a slot, already on the device (prefill input)."""
        return self.history[slot, start:stop]

    def record(self, rows: slice | torch.Tensor, index: torch.Tensor, token: torch.Tensor) -> None:
        """Record a step's tokens (B,) for the slots `rows` (a view or an index; `index`: always an index):
        history, first occurrences, seen set, length, next input."""
        at = self.length[rows]
        self.history[index, at] = token
        self.first[index, at] = ~self.seen[index, token]
        self.seen[index, token] = True
        self.length[rows] += 1
        self.last[rows] = token


class Sampler(SlotState):
    """The batched, seeded next-token choice, over the slots' sampling state it extends (`SlotState`).

    `admit` a request into a slot (writes its parameters and prompt), `step(logits, slots)` picks one
    token per row, reads the batch back once and records the tokens; `last` holds each slot's newest
    token for the next decode step. `move` follows a request to another slot.
    """

    def __init__(self, n_slots: int, vocab_size: int, max_len: int, device: torch.device | str = "cpu",
                 block_size: int = BLOCK_SIZE, eos_id: int | None = None) -> None:
        self.block = block_size
        self.n_blocks = (vocab_size + 1 + block_size - 1) // block_size  # +1: column V is a -inf sink
        super().__init__(n_slots, vocab_size, max_len, self.n_blocks * block_size, torch.device(device), eos_id)
        dev, n = self.device, n_slots
        f32 = dict(dtype=torch.float32, device=dev)
        i64 = dict(dtype=torch.long, device=dev)
        # workspaces (rows are batch rows, not slots); padding columns stay -inf
        self._z = torch.full((n, self.padded), float("-inf"), **f32)
        self._e = torch.empty(n, self.padded, **f32)
        self._tmp = torch.full((n, self.padded), float("-inf"), **f32)
        self._block_ids = torch.arange(self.n_blocks, **i64)
        self._in_block = torch.arange(block_size, **i64)
        self._cols = torch.arange(max_len, **i64)
        self._plans: dict = {}  # batch plans, for the slots' state at version _plans_version
        self._plans_version = self.version
        self._mask_ws: tuple[torch.Tensor, torch.Tensor] | None = None  # grammar masks' workspaces (_mask)
        self.read_backs = 0  # device→host copies made (tests count them)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self, logits: torch.Tensor, slots: range | list[int], bitmask: torch.Tensor | None = None) -> list[Draw]:
        """Pick one token per row of logits (B, ≥ vocab) for `slots`, record them, return them on the host.
        `bitmask`: on the device, the packed int32 masks (engine/structured_output.py) of the constrained slots
        among them, in slot order; required when some slot is constrained, else None."""
        plan = self._plan(slots)
        if plan.masked != (bitmask is not None):
            raise ValueError("a bitmask is required exactly when a slot is constrained")
        token, logprob, accepted, top_ids, top_lp, ctx = self._sample(logits, plan, bitmask)
        parts = [token.double()[:, None], logprob.double()[:, None]]
        if accepted is not None:
            parts.append(accepted.double()[:, None])
        if top_ids is not None:
            parts += [top_ids.double(), top_lp.double()]
        rows = torch.cat(parts, 1).tolist()  # the one device→host copy of the step
        self.read_backs += 1
        if accepted is not None and not all(r[2] for r in rows):
            rejected = [i for i, r in enumerate(rows) if not r[2]]
            fixed = self._redraw_top_p(rejected, token, plan, ctx)
            for i, (t, lp) in zip(rejected, fixed):
                rows[i][0], rows[i][1] = t, lp
            token = token.clone()
            token[device_index(rejected, self.device)] = device_index([t for t, _ in fixed], self.device)
        self.record(plan.rows, plan.index, token)
        n = plan.top_n
        first_top = 3 if accepted is not None else 2
        out = []
        for r in rows:
            top = None
            if n:
                ids, lps = r[first_top:first_top + n], r[first_top + n:first_top + 2 * n]
                top = [(int(i), lp) for i, lp in zip(ids, lps)]
            out.append(Draw(int(r[0]), r[1], top))
        return out

    def plain_kind(self, slots: range | list[int]) -> str | None:
        """The kind of engine.plain_draw that draws these slots' rows exactly as `step` would (greedy; T = 1;
        T < 1), or None when some row needs more (top-k / top-p, penalties, bias, min_tokens, a grammar, top-n)."""
        kinds = [self.kinds[s] for s in slots]
        if any(k is None or k.top_k or k.top_p or k.repetition or k.presence_frequency or k.top_n or k.bias
               or k.min_tokens or k.constrained for k in kinds):
            return None
        if all(k.greedy for k in kinds):
            return "greedy"
        if any(k.greedy for k in kinds):
            return None
        if all(k.unit_temperature for k in kinds):
            return "sample"
        return "sample_sharpened" if all(k.sharpened for k in kinds) and self.device.type == "cpu" else None

    def plain_inputs(self, n: int) -> tuple[torch.Tensor, ...]:
        """What engine.plain_draw reads of slots 0..n-1 (views): 1/T, the seed keys, the history lengths and the
        prompt lengths (their difference: the index of the token drawn)."""
        return self.inv_temp[:n], self.seed_key[:n], self.length[:n], self.prompt_len[:n]

    @torch.inference_mode()
    def take(self, slots: range | list[int], token: torch.Tensor, logprob: torch.Tensor) -> list[Draw]:
        """Record tokens drawn outside `step` (engine.plain_draw, inside a compiled decode step) and return them
        as `step` would: one device→host copy."""
        plan = self._plan(slots)
        rows = torch.stack([token.double(), logprob.double()], 1).tolist()
        self.read_backs += 1
        self.record(plan.rows, plan.index, token)
        return [Draw(int(t), lp) for t, lp in rows]

    def _plan(self, slots: range | list[int]) -> _Plan:
        if self._plans_version != self.version:  # a slot changed since the plans were made
            self._plans.clear()
            self._plans_version = self.version
        key = ("range", slots.start, slots.stop) if isinstance(slots, range) and slots.step == 1 else tuple(slots)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(list(slots))
        return plan

    def _make_plan(self, slots: list[int]) -> _Plan:
        kinds = [self.kinds[s] for s in slots]
        if any(k is None for k in kinds):
            raise ValueError(f"a slot in {slots} holds no request")
        dev, n = self.device, len(slots)
        contiguous = slots == list(range(slots[0], slots[0] + n))
        index = device_index(slots, dev)
        rows = slice(slots[0], slots[0] + n) if contiguous else index
        greedy = [k.greedy for k in kinds]
        topk = [i for i, k in enumerate(kinds) if k.top_k]
        sampled = [i for i, k in enumerate(kinds) if not k.greedy and not k.top_k]
        constrained = [i for i, k in enumerate(kinds) if k.constrained]
        mask_greedy = [i for i in constrained if kinds[i].greedy]
        mask_topk = [i for i in constrained if kinds[i].top_k]
        return _Plan(
            n=n, rows=rows, index=index,
            greedy=device_index(greedy, dev, torch.bool) if 0 < sum(greedy) < n else None,
            all_greedy=all(greedy), any_sampled=bool(sampled),
            topk_rows=device_index(topk, dev) if topk else None, topk_all=len(topk) == n,
            k_max=max((kinds[i].top_k for i in topk), default=0),
            top_p=any(kinds[i].top_p for i in sampled), top_p_in_k=any(kinds[i].top_p for i in topk),
            repetition=any(k.repetition for k in kinds),
            presence_frequency=any(k.presence_frequency for k in kinds),
            z_is_raw=all(k.unit_temperature and not k.repetition and not k.presence_frequency and not k.bias
                         and not k.min_tokens for k in kinds),
            top_n=max(k.top_n for k in kinds), bias=any(k.bias for k in kinds),
            min_tokens=any(k.min_tokens for k in kinds), masked=bool(constrained),
            mask_rows=device_index(constrained, dev) if 0 < len(constrained) < n else None,
            mask_greedy=device_index(mask_greedy, dev) if mask_greedy else None,
            clamp=dev.type == "cpu" and any(k.sharpened for k in kinds),
            mask_topk=(device_index([topk.index(i) for i in mask_topk], dev),
                       device_index([constrained.index(i) for i in mask_topk], dev)) if mask_topk else None)

    def _sample(self, logits: torch.Tensor, plan: _Plan, bitmask: torch.Tensor | None = None):
        B, V, P, NB, BS = plan.n, self.vocab_size, self.padded, self.n_blocks, self.block
        if logits.size(0) != B or logits.size(1) < V:
            raise ValueError(f"logits {tuple(logits.shape)} for {B} slots and a vocabulary of {V}")
        rows = plan.rows
        raw = logits[:, :V].float()  # a padded model vocabulary is never sampled
        inv_t = self.inv_temp[rows][:, None]
        penalized = plan.repetition or plan.presence_frequency or plan.bias or plan.min_tokens
        masked = bitmask is not None
        if penalized:
            # z = biased, penalized logits / temperature, in the workspace
            src = self._z[:B]
            src[:, :V].copy_(raw)
            if plan.bias or plan.min_tokens:
                self._bias(src, plan)
            if plan.repetition or plan.presence_frequency:
                self._penalize(src, plan)
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
        # torch's CPU exp (and exp2) take a 10-100x slower path where the result is subnormal or 0, which low
        # temperatures make common (64 rows of GPT-2's vocabulary, logits ~ N(0, 4²), at T = 0.2: 36 ms a step
        # unclamped, 4.1 ms clamped, against 3.6 at T = 0.7). The clamp is one more pass (~4% of the stack-ceiling
        # model's step at 64 rows), so the other passes (raw normalizer, T ≥ 1) go without: a raw spread of 87 nats
        # is rare. (A GPU's exp has no such path.)
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
        if masked:  # the grammar's mask multiplies e: z and the log-probabilities stay unmasked (see _mask)
            self._mask(e, plan, bitmask)
        bsum = e.unflatten(1, (NB, BS)).sum(-1)  # (B, NB) block masses (unnormalized)
        total = bsum.sum(-1)  # (B,)
        if masked:
            self._rescue_underflow(e, bsum, total, src, scale, plan, bitmask)
        if lse is None:
            lse = m[:, 0] + total.log()

        seed_key = self.seed_key[rows]
        position = self.length[rows] - self.prompt_len[rows]  # index of the token being generated
        token = None
        if plan.all_greedy or plan.greedy is not None:
            token = self._block_argmax(srcb, bmax.argmax(-1))
            if plan.mask_greedy is not None:  # constrained greedy rows: the best allowed token, where e is largest
                g = plan.mask_greedy
                token = token.index_copy(0, g, e[g].argmax(-1))
        if plan.any_sampled:
            key_b = row_keys(seed_key, position, STREAM_BLOCK)
            key_t = row_keys(seed_key, position, STREAM_TOKEN)
            block = (bsum.log() + gumbel(key_b, self._block_ids)).argmax(-1)
            sampled = self._block_draw(srcb, block, key_t, scale, e if masked else None, plan.mask_rows)
            token = sampled if token is None else torch.where(plan.greedy, token, sampled)
        if plan.topk_rows is not None:
            tk = self._top_k_draw(src, scale, plan, seed_key, position, bitmask)
            if plan.topk_all:
                token = tk
            else:
                token = token.clone() if token is not None else torch.zeros(B, dtype=torch.long, device=src.device)
                token[plan.topk_rows] = tk
        logprob = raw.gather(1, token[:, None])[:, 0] - lse

        accepted = None
        if plan.top_p:
            # membership in the nucleus: mass of strictly more likely tokens < top_p · total, in one
            # pass over e / e_s: Σ_j e_j [e_j > e_s] = e_s · Σ_j threshold(e_j / e_s, 1, 0). Boolean
            # tensors and torch.where cost several times more on a CPU.
            e_s = e.gather(1, token[:, None]).clamp_(min=1e-30)
            r = torch.nn.functional.threshold_(torch.div(e, e_s, out=self._tmp[:B]), 1.0, 0.0)
            above = e_s[:, 0] * r.sum(-1)
            top_p = self.top_p[rows]
            accepted = (above < top_p * total) | (top_p >= 1.0)
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
            cand_ids = (blocks[:, :, None] * BS + self._in_block).view(B, -1)
            vals, pos = cand.topk(n, -1)
            top_ids, top_lp = cand_ids.gather(1, pos), vals - lse[:, None]
        ctx = (raw, src, scale, e, total, lse, seed_key, position)
        return token, logprob, accepted, top_ids, top_lp, ctx

    def _block_argmax(self, zb: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """Greedy: the best block by its max, then the best token in it (first index on ties, as argmax)."""
        within = zb.gather(1, block[:, None, None].expand(-1, 1, self.block))[:, 0]  # (B, BS)
        return block * self.block + within.argmax(-1)

    def _block_draw(self, zb: torch.Tensor, block: torch.Tensor, key: torch.Tensor, scale: torch.Tensor | None,
                    e: torch.Tensor | None = None, e_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The token of the chosen block: argmax of z + Gumbel noise keyed by token id (z = zb · scale).
        With `e` (the masked exp, constrained rows `e_rows`, None: all), those rows read log e instead: z plus a
        row's constant where the grammar allows a token, −inf where it does not."""
        at = block[:, None, None].expand(-1, 1, self.block)
        within = zb.gather(1, at)[:, 0]  # (B, BS)
        if scale is not None:
            within = within * scale
        if e is not None:
            log_e = e.unflatten(1, (self.n_blocks, self.block)).gather(1, at)[:, 0].log()
            within = log_e if e_rows is None else within.index_copy(0, e_rows, log_e[e_rows])
        ids = block[:, None] * self.block + self._in_block  # (B, BS)
        return block * self.block + (within + gumbel(key, ids)).argmax(-1)

    def _top_k_draw(self, src: torch.Tensor, scale: torch.Tensor | None, plan: _Plan, seed_key: torch.Tensor,
                    position: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """Rows with top-k: their k best (one topk(max k) for the batch), top-p inside them, Gumbel-max. The
        constrained ones among them choose among their allowed tokens (a masked copy of their rows)."""
        sel, K, BS = plan.topk_rows, plan.k_max, self.block
        z = src if plan.topk_all else src[sel]
        if plan.mask_topk is not None:
            at, mask_at = plan.mask_topk  # their rows in z, their rows of the bitmask
            z = z.clone() if z is src else z
            sub = z[at]
            apply_bitmask(sub, bitmask[mask_at], self.vocab_size)
            z[at] = sub
        zb = z.unflatten(1, (self.n_blocks, BS))
        # the k best tokens lie in the k blocks with the best maxima: topk over those k · BS candidates
        blocks = zb.amax(-1).topk(min(K, self.n_blocks), -1).indices  # (Bk, K')
        cand = zb.gather(1, blocks[:, :, None].expand(-1, -1, BS)).flatten(1)
        vals, pos = cand.topk(K, -1)  # sorted, best first (the order of z = src · scale too)
        ids = (blocks[:, :, None] * BS + self._in_block).flatten(1).gather(1, pos)
        if scale is not None:
            vals = vals * (scale if plan.topk_all else scale[sel])
        k = self.top_k[plan.rows][sel]
        vals = vals.masked_fill(self._cols_k(plan.k_max)[None, :] >= k[:, None], float("-inf"))
        if plan.top_p_in_k:
            p = self.top_p[plan.rows][sel]
            probs = torch.softmax(vals, -1)
            before = torch.cumsum(probs, -1) - probs
            # a token stays while the mass of the better ones is < p; the best one always stays
            vals = vals.masked_fill((before >= p[:, None]) & (p[:, None] < 1.0), float("-inf"))
        key = row_keys(seed_key[sel], position[sel], STREAM_TOKEN)
        return ids.gather(1, (vals + gumbel(key, ids)).argmax(-1, keepdim=True))[:, 0]

    def _cols_k(self, k: int) -> torch.Tensor:
        return self._in_block[:k] if k <= self.block else torch.arange(k, device=self.device)

    def _redraw_top_p(self, rejected: list[int], token: torch.Tensor, plan: _Plan, ctx) -> list[tuple[int, float]]:
        """Rows whose draw fell outside the nucleus: draw again above the pivot until accepted (exact).

        Runs on the rejected rows only. Each round draws from the tokens strictly more likely than the
        last rejected one (hierarchically, with the round's own noise streams) and checks membership.
        Within a block, log e = z + a per-row constant, so e alone carries the distribution.
        """
        raw, _src, _scale, e, total, lse, seed_key, position = ctx
        idx = device_index(rejected, self.device)
        e = e[idx]  # (R, padded): exp of processed logits, shifted; 0 where impossible
        total, seed_key, position = total[idx], seed_key[idx], position[idx]
        p = self.top_p[plan.rows][idx]
        R, BS, NB = len(rejected), self.block, self.n_blocks
        pivot = e.gather(1, token[idx][:, None])  # (R, 1)
        result: list[int | None] = [None] * R
        live = list(range(R))
        rnd = 0
        threshold = torch.nn.functional.threshold_
        while live:
            rnd += 1
            li = device_index(live, self.device)
            el = e if len(live) == R else e[li]
            # the tokens strictly more likely than the pivot: threshold on e / pivot (no masked_fill / where,
            # several times slower on a CPU), scaled back
            kept = threshold(el / pivot[li], 1.0, 0.0)
            key_b = row_keys(seed_key[li], position[li], STREAM_BLOCK + 2 * rnd)
            key_t = row_keys(seed_key[li], position[li], STREAM_TOKEN + 2 * rnd)
            kb = kept.unflatten(1, (NB, BS))
            block = (kb.sum(-1).log() + gumbel(key_b, self._block_ids)).argmax(-1)
            within = kb.gather(1, block[:, None, None].expand(-1, 1, BS))[:, 0].log()  # log e = z + const
            ids = block[:, None] * BS + self._in_block
            tok = block * BS + (within + gumbel(key_t, ids)).argmax(-1)
            e_s = el.gather(1, tok[:, None])
            above = e_s[:, 0] * threshold(el / e_s, 1.0, 0.0).sum(-1)
            ok = (above < p[li] * total[li]).tolist()
            self.read_backs += 1
            toks = tok.tolist()
            still = []
            for j, (i, a) in enumerate(zip(live, ok)):
                if a:
                    result[i] = toks[j]
                else:
                    pivot[i] = e_s[j]
                    still.append(i)
            live = still
        ids = device_index(result, self.device)
        lps = (raw[idx, ids] - lse[idx]).tolist()
        return list(zip(result, lps))

    def _bias(self, z: torch.Tensor, plan: _Plan) -> None:
        """logit_bias (dense rows, 0 where a request has none), then min_tokens: the suppressed ids of each row
        still short of its min_tokens at SUPPRESSED_LOGIT (sparse, over at most a few ids per row; an empty entry
        points at the -inf sink column V, which stays -inf)."""
        rows = plan.rows
        if plan.bias:
            z.add_(self.bias[rows])
        if plan.min_tokens:
            ids = self.suppress[rows]
            short = (self.length[rows] - self.prompt_len[rows]) < self.min_tokens[rows]
            active = short[:, None] & (ids < self.vocab_size)
            z.scatter_(1, ids, torch.where(active, SUPPRESSED_LOGIT, z.gather(1, ids)))

    def _mask(self, e: torch.Tensor, plan: _Plan, bitmask: torch.Tensor) -> None:
        """The grammar's mask on the constrained rows of e = exp(z − max z) (B, padded): a disallowed token's e
        becomes 0 (one index_select of 0/1 rows from the packed bits, one multiply).

        Masking e rather than z (−inf before the exp) leaves every other pass that of an unconstrained batch:
        the raw normalizer of the log-probabilities comes from the same exp, and no exp of −inf (a slow path on
        CPUs) is taken. Measured (stack-ceiling model, 64 rows all constrained, 2 CPU threads, timing the sampler in
        the engine): 7.1 ms a step with −inf added to z, 5.3-5.9 ms this way (1.45 of it here), against 3.2-3.6
        unconstrained. The max is over all tokens, not the allowed ones:
        _rescue_underflow handles the rows whose allowed tokens all lie far below it."""
        V = self.vocab_size
        if self._mask_ws is None:  # (k, 8 · bytes) float rows and (k, bytes) indices, kept: no allocation per step
            nbytes = (V + 7) // 8
            self._mask_ws = (torch.empty(self.n_slots, 8 * nbytes, device=self.device),
                             torch.empty(self.n_slots, nbytes, dtype=torch.long, device=self.device))
        idx = mask_bytes(bitmask, V, self._mask_ws[1])
        allowed = bitmask_rows(idx, V, e.device, self._mask_ws[0], multiply=True)  # (k, V) 1 / 0
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

    def _rescue_underflow(self, e: torch.Tensor, bsum: torch.Tensor, total: torch.Tensor, src: torch.Tensor,
                          scale: torch.Tensor | None, plan: _Plan, bitmask: torch.Tensor) -> None:
        """Constrained rows whose allowed mass in e (relative to the max over all tokens) is below MASK_MASS_FLOOR
        (the grammar allows only tokens the model finds far less likely: their exp may have underflowed) get e,
        bsum and total again relative to the max over their allowed tokens: exact. A read-back of one flag per
        constrained row; the recomputation runs on those rows only (rare: a gap of ~28 nats · T). On a GPU the
        read-back would stall the step: there every constrained row is recomputed and kept where its mass is low."""
        mass = total if plan.mask_rows is None else total[plan.mask_rows]
        if e.device.type not in READBACK_DEVICES:
            self._rescue_underflow_all_rows(e, bsum, total, src, scale, plan, bitmask, mass < MASK_MASS_FLOOR)
            return
        low = (mass < MASK_MASS_FLOOR).nonzero()[:, 0]
        if not low.numel():
            return
        rows = low if plan.mask_rows is None else plan.mask_rows[low]
        z = src[rows]  # (R, padded), a copy
        apply_bitmask(z, bitmask[low], self.vocab_size)
        if scale is not None:
            z.mul_(scale[rows])
        top = z.amax(-1, keepdim=True).clamp_(min=torch.finfo(z.dtype).min)  # (no allowed token: e stays 0)
        er = z.sub_(top).exp_()  # (exp's slow path on the -inf entries: rare rows)
        e[rows] = er
        b = er.unflatten(1, (self.n_blocks, self.block)).sum(-1)
        bsum[rows] = b
        total[rows] = b.sum(-1)

    def _rescue_underflow_all_rows(self, e: torch.Tensor, bsum: torch.Tensor, total: torch.Tensor, src: torch.Tensor,
                                   scale: torch.Tensor | None, plan: _Plan, bitmask: torch.Tensor,
                                   low: torch.Tensor) -> None:
        """_rescue_underflow without a read-back: every constrained row recomputed, kept (torch.where) where `low`
        (one flag per constrained row)."""
        rows = plan.mask_rows  # None: every row is constrained
        z = src.clone() if rows is None else src[rows]
        apply_bitmask(z, bitmask, self.vocab_size)
        if scale is not None:
            z.mul_(scale if rows is None else scale[rows])
        top = z.amax(-1, keepdim=True).clamp_(min=torch.finfo(z.dtype).min)
        er = z.sub_(top).exp_()
        b = er.unflatten(1, (self.n_blocks, self.block)).sum(-1)
        sel = (slice(None),) if rows is None else (rows,)
        e[sel] = torch.where(low[:, None], er, e[sel])
        bsum[sel] = torch.where(low[:, None], b, bsum[sel])
        total[sel] = torch.where(low, b.sum(-1), total[sel])

    def _penalize(self, z: torch.Tensor, plan: _Plan) -> None:
        """Penalties on the raw logits in z (B, padded), sparse: over each row's history, not the vocabulary."""
        rows = plan.rows
        hist = self.history[rows]  # (B, L); empty entries point at the -inf sink column V
        if plan.repetition:
            rp = self.repetition[rows][:, None]
            g = z.gather(1, hist)
            z.scatter_(1, hist, torch.where(g > 0, g / rp, g * rp))  # duplicates write the same value
        if plan.presence_frequency:
            length, start = self.length[rows][:, None], self.prompt_len[rows][:, None]
            output = (self._cols[None, :] >= start) & (self._cols[None, :] < length)
            w = self.frequency[rows][:, None] + self.presence[rows][:, None] * self.first[rows]
            z.scatter_add_(1, hist, -(w * output))



# ---------------------------------------------------------------------------------------------- grammar masks
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
    in place. For the few rows that need masked logits (top-k, _rescue_underflow); the step masks e."""
    z[:, :vocab_size].add_(bitmask_rows(mask_bytes(bitmask, vocab_size), vocab_size, z.device))
