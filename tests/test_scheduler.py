"""The scheduler on its own (model/scheduler.py): admission order, the prefill budget, grouped prefill, slot
compaction, aborts and deadlines. Pure bookkeeping: no model, no threads, no sleeps."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from model.engine_io import EngineRequest, ErrorKind
from model.sampling import SamplingParams
from model.scheduler import Scheduler
from model.stopping import FinishReason

EOS = 0


@dataclass
class D:  # a draw as the sampler returns it
    token: int
    logprob: float = -1.0
    top: list | None = None


def req(rid: str, n_prompt: int, max_new: int = 4, deadline: float | None = None, eos: bool = True) -> EngineRequest:
    return EngineRequest(rid, [7] * n_prompt, SamplingParams(max_new_tokens=max_new, stop_at_eos=eos), seed=1,
                         arrival=0.0, deadline=deadline)


def run_step(s: Scheduler, now: float = 0.0, token: int = 5):
    step = s.schedule(now)
    outs = s.update(step, [D(token) for _ in step.sampled])
    return step, outs


def apply(slots: dict, ops) -> None:
    """What the core does with the ops, on a dict slot → request id: the moves must keep each request's data."""
    for op in ops:
        if op[0] == "admit":
            slots[op[1]] = op[2].request_id
        elif op[0] == "move":
            moved = {d: slots.get(src) for src, d in zip(op[1], op[2])}
            for src in op[1]:
                slots.pop(src, None)
            slots.update({d: v for d, v in moved.items() if v is not None})
        else:
            slots.pop(op[1], None)


def check_invariants(s: Scheduler, slots: dict) -> None:
    assert [r.slot for r in s.decoding] == list(range(len(s.decoding)))
    held = [r.slot for r in s.prefilling + s.decoding]
    assert len(set(held)) == len(held) and not set(held) & set(s.free)
    assert sorted(held + s.free) == list(range(s.n_slots))
    assert all(f >= len(s.decoding) for f in s.free)
    for r in s.prefilling + s.decoding:
        assert slots.get(r.slot) == r.id


def test_admission_is_fifo_into_free_slots_and_the_rest_waits():
    s = Scheduler(2, prefill_chunk=100, eos_id=EOS)
    for i in range(4):
        s.add(req(f"r{i}", 3))
    step = s.schedule(0.0)
    assert [op[0] for op in step.ops] == ["admit", "admit"]
    assert [op[2].request_id for op in step.ops] == ["r0", "r1"]
    assert [r.id for r in s.waiting] == ["r2", "r3"]
    assert s.n_running == 2 and s.n_waiting == 2


def test_equal_whole_prompts_prefill_in_one_pass_within_the_budget():
    s = Scheduler(8, prefill_chunk=10, eos_id=EOS)
    for i, n in enumerate([3, 3, 3, 3, 2]):
        s.add(req(f"r{i}", n))
    step = s.schedule(0.0)
    assert [(len(c.reqs), c.start, c.n) for c in step.prefills] == [(3, 0, 3), (1, 0, 1)]  # 9 tokens, then 1 left
    assert step.prefills[0].completes and not step.prefills[1].completes


def test_a_long_prompt_is_chunked_by_the_budget_and_decoding_goes_on_meanwhile():
    s = Scheduler(4, prefill_chunk=4, eos_id=EOS)
    s.add(req("short", 2, max_new=10))
    run_step(s)  # short's prompt completes, first token sampled
    s.add(req("long", 10))
    chunks = []
    for _ in range(3):
        step, _ = run_step(s)
        assert [r.id for r in step.decode] == ["short"]  # the running stream gets a token every step
        chunks += [(c.start, c.n) for c in step.prefills]
    assert chunks == [(0, 4), (4, 4), (8, 2)]


def test_finished_requests_give_their_slots_and_the_batch_stays_contiguous():
    s = Scheduler(4, prefill_chunk=100, eos_id=EOS)
    slots: dict = {}
    for i, m in enumerate([5, 2, 4, 3]):
        s.add(req(f"r{i}", 2, max_new=m))
    for _ in range(6):
        step = s.schedule(0.0)
        apply(slots, step.ops)
        check_invariants(s, slots)  # what the step computes on: each request's own slot, decoding in 0..n-1
        s.update(step, [D(5) for _ in step.sampled])
    assert not s.has_work()
    assert s.free == [0, 1, 2, 3]


def test_outputs_end_at_eos_or_max_new_tokens():
    s = Scheduler(2, eos_id=EOS)
    s.add(req("eos", 1, max_new=10))
    s.add(req("len", 1, max_new=2))
    step = s.schedule(0.0)
    outs = {o.request_id: o for o in s.update(step, [D(EOS), D(5)])}
    assert outs["eos"].finish == FinishReason.EOS and outs["len"].finish is None
    step = s.schedule(0.0)
    (out,) = s.update(step, [D(5)])
    assert out.request_id == "len" and out.finish == FinishReason.LENGTH and out.token_ids == [5]


def test_eos_does_not_end_a_request_that_ignores_it():
    s = Scheduler(1, eos_id=EOS)
    s.add(req("r", 1, max_new=2, eos=False))
    _, outs = run_step(s, token=EOS)
    assert outs[0].finish is None


def test_abort_mid_prefill_frees_the_slot_and_yields_nothing():
    s = Scheduler(2, prefill_chunk=4, eos_id=EOS)
    slots: dict = {}
    s.add(req("long", 12))
    s.add(req("other", 2, max_new=5))
    step = s.schedule(0.0)
    apply(slots, step.ops)
    assert step.prefills[0].reqs[0].id == "long" and not step.prefills[0].completes
    s.update(step, [D(5) for _ in step.sampled])
    s.abort(["long"])
    step = s.schedule(0.0)
    apply(slots, step.ops)
    check_invariants(s, slots)
    outs = s.update(step, [D(5) for _ in step.sampled])
    assert all(o.request_id != "long" for o in outs) and "long" not in slots.values()
    s.abort(["long", "unknown"])  # twice, or an unknown id: ignored


def test_abort_of_a_waiting_request():
    s = Scheduler(1, eos_id=EOS)
    s.add(req("a", 1, max_new=5))
    s.add(req("b", 1))
    s.schedule(0.0)
    s.abort(["b"])
    assert s.n_waiting == 0


def test_deadlines_end_waiting_and_running_requests_with_timeout():
    s = Scheduler(1, eos_id=EOS)
    s.add(req("running", 1, max_new=50, deadline=10.0))
    s.add(req("waiting", 1, deadline=5.0))
    run_step(s, now=1.0)
    step = s.schedule(now=11.0)
    kinds = {o.request_id: o.error for o in step.ended}
    assert kinds == {"running": ErrorKind.TIMEOUT, "waiting": ErrorKind.TIMEOUT}
    assert not s.has_work()


def test_a_failed_step_fails_the_running_requests_and_keeps_the_waiting_ones():
    s = Scheduler(1, eos_id=EOS)
    s.add(req("a", 1, max_new=5))
    s.add(req("b", 1))
    step = s.schedule(0.0)
    outs = s.fail_step(step, "boom")
    assert [(o.request_id, o.error) for o in outs] == [("a", ErrorKind.FAILED)]
    assert s.n_waiting == 1 and s.free == [0]


def test_duplicate_ids_are_refused():
    s = Scheduler(1)
    s.add(req("a", 1))
    with pytest.raises(ValueError):
        s.add(req("a", 1))


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_keeps_every_invariant(seed):
    import random

    rng = random.Random(seed)
    s = Scheduler(6, prefill_chunk=rng.choice([3, 8, 32]), eos_id=EOS)
    slots: dict = {}
    n = 0
    for t in range(200):
        for _ in range(rng.randint(0, 2)):
            s.add(req(f"r{n}", rng.randint(1, 12), max_new=rng.randint(1, 8)))
            n += 1
        if rng.random() < 0.1 and s.by_id:
            s.abort([rng.choice(list(s.by_id))])
        step = s.schedule(float(t))
        apply(slots, step.ops)
        check_invariants(s, slots)
        s.update(step, [D(EOS if rng.random() < 0.05 else 5) for _ in step.sampled])
