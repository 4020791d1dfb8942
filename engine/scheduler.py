"""The scheduler: which requests hold KV-cache slots, what each engine step computes, and the slot moves
that keep the decoding batch contiguous. Pure bookkeeping (no torch, no threads, no clock of its own),
so it is tested directly: `tests/test_scheduler.py`.

One step, as vLLM V1's `EngineCore.step` runs it: `schedule(now)` → the core executes the `Step` →
`update(step, draws)`.

- Admission: waiting requests (FIFO) take free slots; a slot is reset and the request's sampling state
  written there (`Admit`; the ops are engine/ops.py's).
- Prefill: a budget of `prefill_chunk` prompt tokens per step, oldest admitted first. A long prompt takes
  several steps, so running streams wait at most one chunk between tokens. With no request decoding nobody
  waits for a token, so the budget is `idle_prefill_chunk` (larger: a long prompt in one pass reads the weights
  once, not once per chunk). Requests whose whole remaining prompts start at the same position and have the
  same length (equal fresh prompts; a burst reusing one cached prefix) go in one forward pass within the budget
  (one read of the weights for all of them).
- Decode: every decoding request, one token each, in slots 0..n-1: the step reads the cache and the
  sampler's state through views, never a gather.
- Contiguity: a request whose prompt completes samples its first token, then takes slot n (moving there,
  or swapping with the prompt being prefilled there); a request that ends hands its slot to the last
  decoding one. Moves are recorded as ops, applied by the core in order before the next step computes.
- Prefix caching (`prefix_cache=True`; the server's default, `GPT_PREFIX_CACHE`): a slot keeps its keys and
  values when its request ends, and `engine.prefix_cache.PrefixIndex` remembers which tokens every slot holds. A
  new prompt takes the slot with the longest common prefix when that slot is idle (only the rest is prefilled, as
  llama.cpp's server does), or a free slot into which that prefix is copied from a running one (`Copy(src,
  dst, n)`: a copy of n tokens costs far less than their prefill); with no match, the least recently used idle
  slot is overwritten. Reuse needs at least `min_prefix` tokens and always leaves the last prompt token to be
  computed (its logits are sampled). The moves that keep the decoding batch contiguous become swaps, so what an
  ending request leaves behind survives. Sampling state (seed, penalty history, positions) is always the new
  request's own: the sampler is written at admission whatever was reused.
- Ends: EOS (when the request stops at EOS), one of its stop_token_ids (both only once it has min_tokens
  tokens), a grammar that is complete (the core sets `stop` on the draw: FinishReason.STOP, or EOS if it took
  <|endoftext|>), or max_new_tokens, decided from the sampled token ids; a request with max_new_tokens 0 (it only
  scores its prompt: prompt log-probabilities) ends with LENGTH right after its prefill, nothing sampled; a
  deadline passed (`ErrorKind.TIMEOUT`); a grammar that refused its sampled token, a limit of the library met
  while decoding (the core sets `failed` on the draw: `ErrorKind.INVALID`, the token dropped); `abort(ids)` from
  whoever reads the outputs (a stop string, a client gone) frees the slot with no output.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from engine.ops import Admit, Copy, Draw, Free, Idle, Move, Op, RowDraws
from engine.params import SamplingParams
from engine.prefix_cache import DEFAULT_BLOCK, PrefixIndex
from engine.request import EngineRequest, ErrorKind, RequestOutput
from engine.stopping import FinishReason


def finish_reason(params: SamplingParams, eos_id: int | None, generated: int, draw: Draw) -> FinishReason | None:
    """How a request ends when `draw` (.token; .stop: its grammar is complete, engine/structured_output.py) is its
    `generated`-th token, or None: EOS (when it stops at EOS) or one of its stop_token_ids, both only past min_tokens
    (the sampler suppresses them until then); a complete grammar (FinishReason.EOS if it took EOS); max_new_tokens.
    The one rule: `Scheduler.update` ends requests by it, and the engine core stops verifying a row's proposal at
    the token it ends (EngineCore._verify)."""
    stop = draw.stop
    may_stop = generated > params.min_tokens
    if draw.token == eos_id and ((params.stop_at_eos and may_stop) or stop):
        return FinishReason.EOS
    if stop or (params.stop_token_ids and draw.token in params.stop_token_ids and may_stop):
        return FinishReason.STOP
    if generated >= params.max_new_tokens:
        return FinishReason.LENGTH
    return None


@dataclass(eq=False)
class Running:
    """The scheduler's record of one request."""

    request: EngineRequest
    slot: int | None = None
    prefilled: int = 0  # prompt tokens scheduled into the cache
    generated: int = 0
    admitted_at: float | None = None
    cached: int = 0  # prompt tokens reused from the prefix cache (not computed)
    out: list[int] = field(default_factory=list)  # generated token ids (kept only with prefix caching)
    chain: list[int] | None = None  # the prompt's block hashes (prefix caching)

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def queue_s(self) -> float:
        """Seconds from arrival to admission into a slot (reported with the first output)."""
        return max(0.0, (self.admitted_at or self.request.arrival) - self.request.arrival)

    @property
    def kv_len(self) -> int:
        """Tokens whose keys and values are in the slot between steps: the prompt scheduled so far (computed by
        then) and every generated token but the newest (it is the next decode step's input)."""
        return self.prefilled + max(0, self.generated - 1)

    def kv_tokens(self, start: int, stop: int) -> list[int]:
        """Token ids at KV positions [start, stop)."""
        p = self.prefilled
        head = self.request.prompt[start:min(stop, p)] if start < p else []
        return head + self.out[max(0, start - p):max(0, stop - p)]


@dataclass
class Chunk:
    """One prefill forward pass: prompt tokens [start, start + n) of each request (several only when whole
    prompts of equal length go together)."""

    reqs: list[Running]
    start: int
    n: int

    @property
    def completes(self) -> bool:
        return self.start + self.n == self.reqs[0].prompt_len

    @property
    def slots(self) -> list[int]:
        return [r.slot for r in self.reqs]

    @property
    def sampled(self) -> list[int]:
        """Indices into reqs of the requests that sample a token after this chunk (none unless it completes;
        a request with max_new_tokens 0 never does)."""
        if not self.completes:
            return []
        return [i for i, r in enumerate(self.reqs) if r.request.params.max_new_tokens > 0]


@dataclass
class Step:
    ops: list[Op] = field(default_factory=list)  # slot operations (engine/ops.py), applied in order first
    prefills: list[Chunk] = field(default_factory=list)
    decode: list[Running] = field(default_factory=list)  # decode[i] is in slot i
    ended: list[RequestOutput] = field(default_factory=list)  # ended before computing (deadlines)

    @property
    def sampled(self) -> list[Running]:
        """The requests that get a token this step, in the order the core samples them."""
        out = [c.reqs[i] for c in self.prefills for i in c.sampled]
        return out + self.decode

    @property
    def computes(self) -> bool:
        return bool(self.prefills or self.decode)


class Scheduler:
    def __init__(self, n_slots: int, prefill_chunk: int | None = None, eos_id: int | None = None, *,
                 prefix_cache: bool = False, min_prefix: int = DEFAULT_BLOCK,
                 prefix_block: int = DEFAULT_BLOCK, idle_prefill_chunk: int | None = None) -> None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if min_prefix < 1:
            raise ValueError(f"min_prefix must be >= 1, got {min_prefix}")
        self.n_slots = n_slots
        self.prefill_chunk = prefill_chunk  # None: no budget (every admitted prompt in one step)
        # the budget while nothing decodes (None: prefill_chunk)
        self.idle_prefill_chunk = max(idle_prefill_chunk, prefill_chunk) if idle_prefill_chunk and prefill_chunk \
            else prefill_chunk
        self.eos_id = eos_id
        self.waiting: deque[Running] = deque()
        self.prefilling: list[Running] = []  # admission order
        self.decoding: list[Running] = []  # decoding[i].slot == i
        self.free: list[int] = list(range(n_slots))  # sorted; every free slot is >= len(decoding)
        self.by_id: dict[str, Running] = {}
        self._ops: list[Op] = []  # recorded since the last schedule()
        # prefix caching: what every slot holds, and when it was last used (LRU eviction)
        self.prefix = PrefixIndex(n_slots, prefix_block) if prefix_cache else None
        self.min_prefix = min_prefix
        self.used_at = [0] * n_slots
        self._clock = 0
        self.hit_tokens = 0  # prompt tokens reused, since start

    # ------------------------------------------------------------------ state
    @property
    def n_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    # ------------------------------------------------------------------ requests
    def add(self, request: EngineRequest) -> None:
        if request.request_id in self.by_id:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        r = Running(request)
        self.by_id[r.id] = r
        self.waiting.append(r)

    def abort(self, request_ids) -> None:
        """End requests without an output (their reader asked). Unknown or finished ids are ignored."""
        for rid in request_ids:
            r = self.by_id.pop(rid, None)
            if r is None:
                continue
            if r.slot is None:
                self.waiting.remove(r)
            else:
                self._release(r)

    def end_all(self, kind: ErrorKind, message: str) -> list[RequestOutput]:
        """End every request (waiting and running) with an error: the core is stopping or a step failed."""
        out = [RequestOutput(r.id, [], [], error=kind, message=message) for r in self.by_id.values()]
        self._release_all()
        self.waiting.clear()
        self.by_id.clear()
        return out

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float) -> Step:
        step = Step(ended=self.expire(now))
        if self.waiting and self.free and self.prefix is not None:
            self._sync_prefix()
        held_back: list[Running] = []
        while self.waiting and self.free:
            r = self.waiting.popleft()
            if self.prefix is None:
                r.slot = self.free.pop(0)
                self._ops.append(Admit(r.slot, r.request))
            elif not self._admit_reusing(r):
                held_back.append(r)
                continue
            r.admitted_at = now
            self.prefilling.append(r)
        self.waiting.extendleft(reversed(held_back))
        self._plan_prefill(step)
        step.decode = list(self.decoding)
        step.ops, self._ops = self._ops, []
        return step

    def update(self, step: Step, draws: list[RowDraws]) -> list[RequestOutput]:
        """Record the sampled tokens (`draws[i]` for `step.sampled[i]`: .token, .logprob, .top, or a list of them for
        a row that verified proposals); end the requests that are done and move those whose prompt completed into
        the decoding batch."""
        outputs = list(step.ended)
        joining: list[Running] = []
        completed = {id(r) for c in step.prefills if c.completes for r in c.reqs}
        done: list[Running] = []
        for r, ds in zip(step.sampled, draws):
            if self.by_id.get(r.id) is not r:  # ended meanwhile (cannot happen within one step; kept safe)
                continue
            # a list: the tokens of a row whose proposals were verified (engine/core.py), in order; those after
            # one that ends the request are dropped
            ds = ds if isinstance(ds, list) else [ds]
            params = r.request.params
            finish = None
            out = RequestOutput(r.id, [], [], [] if r.request.top_n else None)
            for d in ds:
                if d.failed:  # its grammar refused the token: the request ends with an error
                    out = RequestOutput(r.id, [], [], error=ErrorKind.INVALID, message=(
                        f"structured output failed at generated token {r.generated + 1}: {d.failed}"))
                    break
                r.generated += 1
                if self.prefix is not None:
                    r.out.append(d.token)
                finish = finish_reason(params, self.eos_id, r.generated, d)
                out.token_ids.append(d.token)
                out.logprobs.append(d.logprob)
                if out.top is not None:
                    out.top.append(d.top)
                if finish is not None:
                    break
            out.finish = finish
            if r.generated == 1:
                out.queue_s = r.queue_s
                out.cached_tokens = r.cached
            outputs.append(out)
            if finish is not None or out.error is not None:
                del self.by_id[r.id]
                done.append(r)
            elif id(r) in completed:
                joining.append(r)
        self._release_many(done)
        for c in step.prefills:  # prompts scored only: done once prefilled
            if c.completes:
                for r in c.reqs:
                    if r.request.params.max_new_tokens == 0 and self.by_id.get(r.id) is r:
                        out = RequestOutput(r.id, [], [], None, FinishReason.LENGTH)
                        out.queue_s = r.queue_s
                        outputs.append(out)
                        del self.by_id[r.id]
                        self._release(r)
        for i, r in enumerate(joining):
            self._join_decoding(r, joining[i + 1:])
        return outputs

    def fail_step(self, step: Step, message: str) -> list[RequestOutput]:
        """The step's computation raised: every request holding a slot ends with ErrorKind.FAILED (the step may
        have stopped half-way through its slot ops; each slot is reset when it is admitted again). Waiting
        requests stay queued."""
        out = list(step.ended)
        for r in self._release_all():
            del self.by_id[r.id]
            out.append(RequestOutput(r.id, [], [], error=ErrorKind.FAILED, message=message))
        return out

    # ------------------------------------------------------------------ internals
    def expire(self, now: float) -> list[RequestOutput]:
        """End the requests past their deadline (ErrorKind.TIMEOUT); schedule() does this first."""
        ended = []
        late = [r for r in self.by_id.values() if r.request.deadline is not None and now > r.request.deadline]
        for r in late:
            where = (f"after {r.generated} generated tokens" if r.slot is not None else "while waiting in the queue")
            del self.by_id[r.id]
            if r.slot is None:
                self.waiting.remove(r)
            else:
                self._release(r)
            ended.append(RequestOutput(r.id, [], [], error=ErrorKind.TIMEOUT,
                                       message=f"the request exceeded its time limit ({where})"))
        return ended

    def _plan_prefill(self, step: Step) -> None:
        chunk = self.prefill_chunk if self.decoding else self.idle_prefill_chunk
        budget = chunk if chunk is not None else math.inf
        pending = self.prefilling
        i = 0
        while i < len(pending) and budget > 0:
            r = pending[i]
            n = int(min(budget, r.prompt_len - r.prefilled))
            group = [r]
            if n == r.prompt_len - r.prefilled:  # the rest of r's prompt: others at the same point may join it
                for q in pending[i + 1:]:
                    if q.prefilled != r.prefilled or q.prompt_len - q.prefilled != n or (len(group) + 1) * n > budget:
                        break
                    group.append(q)
            step.prefills.append(Chunk(group, r.prefilled, n))
            for q in group:
                q.prefilled += n
            budget -= n * len(group)
            i += len(group)

    def _join_decoding(self, r: Running, later: list[Running]) -> None:
        """r's prompt is complete: it takes slot n (n = requests decoding). `later`: requests of the same step
        that join after it (they still hold their prefill slots)."""
        self.prefilling.remove(r)
        target, src = len(self.decoding), r.slot
        if src != target:
            holder = next((q for q in [*self.prefilling, *later] if q.slot == target), None)
            if holder is not None:  # a prompt being prefilled holds it: swap the two
                self._ops.append(Move([src, target], [target, src]))
                holder.slot = src
            elif self.prefix is None:  # the target is free: move
                self._ops.append(Move([src], [target]))
                self._ops.append(Free(src))
            else:  # free but maybe caching a prefix: swap, so what it holds survives in src
                self._ops.append(Move([src, target], [target, src]))
            if holder is None:
                self.free.remove(target)
                bisect.insort(self.free, src)
            if self.prefix is not None:
                self.prefix.swap(src, target)
            r.slot = target
        self.decoding.append(r)

    def _release_all(self) -> list[Running]:
        """Every request holding a slot leaves it (no moves: nothing stays to be kept contiguous). The prefix cache
        is emptied too: a failed step may have stopped half-way through its copies and swaps."""
        holders = self.prefilling + self.decoding
        if self.prefix is None:
            freed = [r.slot for r in holders]
        else:
            freed = list(range(self.n_slots))
            self.prefix.clear()
        for slot in freed:
            self._ops.append(Free(slot))
        for r in holders:
            r.slot = None
        self.prefilling, self.decoding = [], []
        self.free = list(range(self.n_slots))
        return holders

    def _release_many(self, done: list[Running]) -> None:
        """The requests of one step that end leave with the fewest moves: a leaving request in the last decoding
        slot goes first (nothing moves); otherwise the lowest one leaves and the last request, which stays, moves
        into its slot. In step order, a request moved down could leave next and move again: copies of caches that were
        leaving anyway, charged to the next step (docs/performance.md, "Measurements moved out of code comments")."""
        decoding = {id(q) for q in self.decoding}
        for r in done:
            if id(r) not in decoding:  # prefilling: nothing moves
                self._release(r)
        done = sorted((q for q in done if id(q) in decoding), key=lambda q: q.slot)
        while done:  # (done[-1] holds the highest decoding slot of those leaving)
            self._release(done.pop() if done[-1] is self.decoding[-1] else done.pop(0))

    def _release(self, r: Running) -> None:
        """r leaves its slot; the last decoding request takes the freed slot so slots stay 0..n-1 (with prefix
        caching the two swap, so r's cache entries stay behind in the slot it leaves free)."""
        freed = r.slot
        if self.prefix is not None:
            self._sync(r)
        if r in self.prefilling:
            self.prefilling.remove(r)
        elif freed < len(self.decoding) and self.decoding[freed] is r:
            last = len(self.decoding) - 1
            if freed != last:
                moved = self.decoding[last]
                if self.prefix is None:
                    self._ops.append(Move([last], [freed]))
                else:
                    self._ops.append(Move([last, freed], [freed, last]))
                    self.prefix.swap(last, freed)
                moved.slot = freed
                self.decoding[freed] = moved
                freed = last
            self.decoding.pop()
        if self.prefix is None:
            self._ops.append(Free(freed))
        else:
            self._ops.append(Idle(freed))
            self._clock += 1
            self.used_at[freed] = self._clock
        bisect.insort(self.free, freed)
        r.slot = None

    # ------------------------------------------------------------------ prefix caching
    def _reusable(self, r: Running) -> bool:
        """Whether r may start from a cached prefix: not when it asks for its prompt's log-probabilities (they
        need the logits of every prompt position, computed; as vLLM). Its own prompt is cached for others."""
        return r.request.prompt_logprobs is None

    def _sync(self, r: Running) -> None:
        """Bring the index up to what r's slot holds now (it grows as r is prefilled and decodes)."""
        have, want = len(self.prefix.tokens[r.slot]), r.kv_len
        if want > have:
            self.prefix.extend(r.slot, r.kv_tokens(have, want))

    def _sync_prefix(self) -> None:
        for r in self.prefilling:
            self._sync(r)
        for r in self.decoding:
            self._sync(r)

    def _admit_reusing(self, r: Running) -> bool:
        """Admit r into a slot, reusing the longest cached prefix of its prompt found in any slot; or hold it back
        (False) while a request being prefilled is computing a longer prefix of it (a burst of requests sharing a
        system prompt then prefills it once, not once per request)."""
        prompt = r.request.prompt
        reusable = self._reusable(r)
        if reusable and r.chain is None:
            r.chain = self.prefix.chain(prompt)
        k, cands = self.prefix.match(prompt, r.chain) if reusable else (0, [])
        k = min(k, len(prompt) - 1)  # the last prompt token is always computed: its logits are sampled
        if reusable and self._pending_prefix(r) - k >= max(self.min_prefix, self.prefix.block):
            return False
        free = set(self.free)
        src = None
        if k >= self.min_prefix:
            # idle slots first (reused in place), then running ones (copied); the first that truly holds the prefix
            src = next((s for s in sorted(cands, key=lambda s: s not in free) if self.prefix.holds(s, prompt, k)),
                       None)
        if src is None:
            k = 0
        self._clock += 1
        if src in free:
            slot = src
            self.prefix.truncate(slot, k)
        else:
            # no reusable idle slot: overwrite an empty one, else the least recently used
            slot = min(self.free, key=lambda s: (len(self.prefix.tokens[s]) > 0, self.used_at[s]))
            if src is not None:
                self._ops.append(Copy(src, slot, k))
                self.prefix.copy(src, slot, k)
                self.used_at[src] = self._clock
            else:
                self.prefix.truncate(slot, 0)
        self.free.remove(slot)
        self.used_at[slot] = self._clock
        r.slot, r.prefilled, r.cached = slot, k, k
        self.hit_tokens += k
        self._ops.append(Admit(slot, r.request, k))
        return True

    def _pending_prefix(self, r: Running) -> int:
        """The longest prefix of r's prompt (whole blocks, below its last token) that a request being prefilled will
        have computed once its prompt is in, beyond what it holds now."""
        best = 0
        limit = (len(r.request.prompt) - 1) // self.prefix.block
        for q in self.prefilling:
            if q.chain is None:  # it does not reuse, so its prompt was never hashed
                continue
            n = 0
            for a, b in zip(r.chain[:limit], q.chain):
                if a != b:
                    break
                n += 1
            best = max(best, n * self.prefix.block)
        return best
