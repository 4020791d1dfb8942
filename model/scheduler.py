"""The scheduler: which requests hold KV-cache slots, what each engine step computes, and the slot moves
that keep the decoding batch contiguous. Pure bookkeeping (no torch, no threads, no clock of its own),
so it is tested directly: `tests/test_scheduler.py`.

One step, as vLLM V1's `EngineCore.step` runs it: `schedule(now)` → the core executes the `Step` →
`update(step, draws)`.

- Admission: waiting requests (FIFO) take free slots; a slot is reset and the request's sampling state
  written there (`("admit", slot, request)`).
- Prefill: a budget of `prefill_chunk` prompt tokens per step, oldest admitted first. A long prompt takes
  several steps, so running streams wait at most one chunk between tokens. Whole prompts of equal length
  that fit the budget together go in one forward pass (one read of the weights for all of them).
- Decode: every decoding request, one token each, in slots 0..n-1: the step reads the cache and the
  sampler's state through views, never a gather.
- Contiguity: a request whose prompt completes samples its first token, then takes slot n (moving there,
  or swapping with the prompt being prefilled there); a request that ends hands its slot to the last
  decoding one. Moves are recorded as ops, applied by the core in order before the next step computes.
- Ends: EOS (when the request stops at EOS) or max_new_tokens, decided from the sampled token ids, or a grammar
  that is complete (the core sets `stop` on the draw: FinishReason.STOP, or EOS if it took <|endoftext|>); a
  deadline passed (`ErrorKind.TIMEOUT`); `abort(ids)` from whoever reads the outputs (a stop string, a
  client gone) frees the slot with no output.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from model.engine_io import EngineRequest, ErrorKind, RequestOutput
from model.stopping import FinishReason


@dataclass(eq=False)
class Running:
    """The scheduler's record of one request."""

    request: EngineRequest
    slot: int | None = None
    prefilled: int = 0  # prompt tokens scheduled into the cache
    generated: int = 0
    admitted_at: float | None = None

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)


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


# Slot operations, applied in order before the step computes:
#   ("admit", slot, EngineRequest)  reset the slot and write the request's sampling state and prompt
#   ("move", [src...], [dst...])    move what the slots hold (cache entries and sampler state)
#   ("free", slot)                  the slot holds nothing now
Op = tuple


@dataclass
class Step:
    ops: list[Op] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)
    decode: list[Running] = field(default_factory=list)  # decode[i] is in slot i
    ended: list[RequestOutput] = field(default_factory=list)  # ended before computing (deadlines)

    @property
    def sampled(self) -> list[Running]:
        """The requests that get a token this step, in the order the core samples them."""
        out = [r for c in self.prefills if c.completes for r in c.reqs]
        return out + self.decode

    @property
    def computes(self) -> bool:
        return bool(self.prefills or self.decode)


class Scheduler:
    def __init__(self, n_slots: int, prefill_chunk: int | None = None, eos_id: int | None = None) -> None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.n_slots = n_slots
        self.prefill_chunk = prefill_chunk  # None: no budget (every admitted prompt in one step)
        self.eos_id = eos_id
        self.waiting: deque[Running] = deque()
        self.prefilling: list[Running] = []  # admission order
        self.decoding: list[Running] = []  # decoding[i].slot == i
        self.free: list[int] = list(range(n_slots))  # sorted; every free slot is >= len(decoding)
        self.by_id: dict[str, Running] = {}
        self._ops: list[Op] = []  # recorded since the last schedule()

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
        while self.waiting and self.free:
            r = self.waiting.popleft()
            r.slot = self.free.pop(0)
            r.admitted_at = now
            self.prefilling.append(r)
            self._ops.append(("admit", r.slot, r.request))
        self._plan_prefill(step)
        step.decode = list(self.decoding)
        step.ops, self._ops = self._ops, []
        return step

    def update(self, step: Step, draws) -> list[RequestOutput]:
        """Record the sampled tokens (`draws[i]` for `step.sampled[i]`: .token, .logprob, .top); end the requests
        that are done and move those whose prompt completed into the decoding batch."""
        outputs = list(step.ended)
        joining: list[Running] = []
        completed = {id(r) for c in step.prefills if c.completes for r in c.reqs}
        for r, d in zip(step.sampled, draws):
            if self.by_id.get(r.id) is not r:  # ended meanwhile (cannot happen within one step; kept safe)
                continue
            r.generated += 1
            params = r.request.params
            finish = None
            stop = getattr(d, "stop", False)  # its grammar is complete (model/structured_output.py)
            if d.token == self.eos_id and (params.stop_at_eos or stop):
                finish = FinishReason.EOS
            elif stop:
                finish = FinishReason.STOP
            elif r.generated >= params.max_new_tokens:
                finish = FinishReason.LENGTH
            out = RequestOutput(r.id, [d.token], [d.logprob], [d.top] if r.request.top_n else None, finish)
            if r.generated == 1:
                out.queue_s = max(0.0, (r.admitted_at or r.request.arrival) - r.request.arrival)
            outputs.append(out)
            if finish is not None:
                del self.by_id[r.id]
                self._release(r)
            elif id(r) in completed:
                joining.append(r)
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
        budget = self.prefill_chunk if self.prefill_chunk is not None else math.inf
        pending = self.prefilling
        i = 0
        while i < len(pending) and budget > 0:
            r = pending[i]
            n = int(min(budget, r.prompt_len - r.prefilled))
            group = [r]
            if r.prefilled == 0 and n == r.prompt_len:
                for q in pending[i + 1:]:
                    if q.prefilled or q.prompt_len != n or (len(group) + 1) * n > budget:
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
            if holder is None:  # the target is free: move
                self._ops.append(("move", [src], [target]))
                self.free.remove(target)
                bisect.insort(self.free, src)
                self._ops.append(("free", src))
            else:  # a prompt being prefilled holds it: swap the two
                self._ops.append(("move", [src, target], [target, src]))
                holder.slot = src
            r.slot = target
        self.decoding.append(r)

    def _release_all(self) -> list[Running]:
        """Every request holding a slot leaves it (no moves: nothing stays to be kept contiguous)."""
        holders = self.prefilling + self.decoding
        for r in holders:
            self._ops.append(("free", r.slot))
            r.slot = None
        self.prefilling, self.decoding = [], []
        self.free = list(range(self.n_slots))
        return holders

    def _release(self, r: Running) -> None:
        """r leaves its slot; the last decoding request takes the freed slot so slots stay 0..n-1."""
        freed = r.slot
        if r in self.prefilling:
            self.prefilling.remove(r)
        elif freed < len(self.decoding) and self.decoding[freed] is r:
            last = len(self.decoding) - 1
            if freed != last:
                moved = self.decoding[last]
                self._ops.append(("move", [last], [freed]))
                moved.slot = freed
                self.decoding[freed] = moved
                freed = last
            self.decoding.pop()
        self._ops.append(("free", freed))
        bisect.insort(self.free, freed)
        r.slot = None
