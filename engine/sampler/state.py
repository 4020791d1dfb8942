"""Every slot's sampling state on the model's device, as tensors indexed by KV-cache slot (`SlotState`), and what
each slot's request needs on the host (`Kind`): written once when a request is admitted, so a decode step builds
nothing from Python lists."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.params import SamplingParams, bad_token
from engine.sampler.noise import seed_keys
from model.kv_cache import device_index

MIN_TOP_P = 1e-6  # smaller top_p (5e-324 is valid JSON) keeps only the most likely token, as this does


@dataclass(frozen=True)
class Kind:
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
    sharpened: bool = False  # temperature below 1: d / T reaches exp's slow path sooner (see Sampler._sample)


class SlotState:
    """Every slot's sampling state on the device, as tensors indexed by KV-cache slot: the parameters, the seed's
    key, the token history (prompt + output) with its first occurrences and seen set, the newest token, and
    (allocated on first use) logit bias and min_tokens suppression.

    `admit` writes a request into a slot, `move` follows requests to other slots, `release` empties one,
    `record` appends a step's tokens. `kinds` holds what each slot's request needs, on the host; `version`
    counts the admits, moves and releases (a batch plan, engine/sampler/plan.py, is valid for one version). The
    `Sampler` holds one and draws from it.
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
        self.cols = torch.arange(max_len, **i64)  # history's column indices (constant)
        self.eos_id = eos_id  # suppressed under min_tokens (with stop_at_eos)
        self.min_tokens = torch.zeros(n, **i64)
        # allocated on first use (most servers never see them): logit_bias as a dense (n, padded) row per slot,
        # and the ids min_tokens suppresses, (n, S) with V (the -inf sink column) for an empty entry
        self.bias: torch.Tensor | None = None
        self.suppress: torch.Tensor | None = None
        self._tensors = ["inv_temp", "top_k", "top_p", "repetition", "presence", "frequency", "seed_key",
                         "history", "length", "prompt_len", "first", "seen", "last", "min_tokens"]  # what move carries
        self.kinds: list[Kind | None] = [None] * n  # what each slot's request needs (None: empty)
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
        self.kinds[slot] = Kind(
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

    def record(self, rows: slice | torch.Tensor, index: torch.Tensor, token: torch.Tensor,
               first_occurrences: bool = True) -> None:
        """Record a step's tokens (B,) for the slots `rows` (a view or an index; `index`: always an index):
        history, length, next input, and with `first_occurrences` the first occurrences and seen set, which only
        presence/frequency penalties read (a batch plan's `presence_frequency`: some row of it has them; a slot's
        are reset at admit, so a slot that has them is recorded at every step it takes part in). Skipping them
        skips 7.7 of its 14 us at batch 1 (docs/performance.md)."""
        at = self.length[rows]
        self.history[index, at] = token
        if first_occurrences:
            self.first[index, at] = ~self.seen[index, token]
            self.seen[index, token] = True
        self.length[rows] += 1
        self.last[rows] = token

    def record_runs(self, slots: list[int], tokens: list[list[int]]) -> None:
        """Record several tokens a slot at once (a verification's kept draws, at least one a slot): history,
        length and next input, as `record` would one by one, without first occurrences (slots with
        presence/frequency penalties draw position by position)."""
        counts, dev = [len(t) for t in tokens], self.device
        index = device_index(slots, dev)
        each = device_index([s for s, c in zip(slots, counts) for _ in range(c)], dev)
        at = self.length[each] + device_index([j for c in counts for j in range(c)], dev)
        self.history[each, at] = device_index([t for run in tokens for t in run], dev)
        self.length[index] += device_index(counts, dev)
        self.last[index] = device_index([run[-1] for run in tokens], dev)
