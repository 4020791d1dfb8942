"""How often the core sends running requests' tokens (engine/stream_interval.py): held and merged while the interval
has not passed, first and last tokens at once, nothing lost or reordered; through the core loop, the same tokens as
a message per step in fewer messages."""

from __future__ import annotations

from engine.core import EngineCore
from engine.core_loop import CoreLoop
from engine.params import SamplingParams
from engine.request import EngineRequest, ErrorKind, FinishReason, RequestOutput
from engine.stream_interval import StreamInterval
from engine.wire import Abort, Add, Hello, Outputs, Shutdown
from tests.helpers import tiny_model


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def out(rid: str, tokens: list[int], first: bool = False, **kw) -> RequestOutput:
    o = RequestOutput(rid, list(tokens), [-float(t) for t in tokens], **kw)
    if first:
        o.queue_s = 0.01  # the scheduler marks a request's first output so
    return o


def test_tokens_wait_at_most_the_interval_and_arrive_merged_in_order():
    clock = Clock()
    s = StreamInterval(0.004, clock)
    assert [o.token_ids for o in s.take([out("a", [1], first=True)])] == [[1]]  # a first token: at once
    clock.t += 0.001
    assert s.take([out("a", [2])]) == []  # within the interval: held
    clock.t += 0.001
    assert s.take([out("a", [3, 4]), out("b", [7], first=True)]) != []  # b's first token sends a's held ones too
    clock.t += 0.001
    assert s.take([out("a", [5]), out("b", [8])]) == []
    clock.t += 0.0031  # the interval since the last send has passed
    sent = s.take([out("a", [6]), out("b", [9])])
    assert {o.request_id: (o.token_ids, o.logprobs) for o in sent} == {"a": ([5, 6], [-5.0, -6.0]),
                                                                         "b": ([8, 9], [-8.0, -9.0])}
    assert s.take([out("a", [10])]) == []
    sent = s.take([out("a", [11], finish=FinishReason.LENGTH)])  # the end: at once, with what was held
    assert [(o.token_ids, o.finish) for o in sent] == [([10, 11], FinishReason.LENGTH)]
    assert s.take([out("b", [12])]) == [] and [o.token_ids for o in s.take([], flush=True)] == [[12]]
    assert s.take([], flush=True) == []


def test_a_failure_ends_the_held_output_and_an_abort_forgets_it():
    clock = Clock()
    s = StreamInterval(0.004, clock)
    s.take([out("a", [1], first=True), out("b", [1], first=True)])
    assert s.take([out("a", [2]), out("b", [2])]) == []
    s.drop(["b"])
    sent = s.take([out("a", [], error=ErrorKind.FAILED, message="boom")])
    assert [(o.request_id, o.token_ids, o.error, o.message) for o in sent] == [("a", [2], ErrorKind.FAILED, "boom")]


def test_top_logprobs_are_merged_per_token():
    s = StreamInterval(1.0, Clock())
    s.take([out("a", [1], first=True, top=[[(1, -0.1)]])])
    s.take([out("a", [2], top=[[(2, -0.2)]])])
    (o,) = s.take([out("a", [3], top=[[(3, -0.3)]], finish=FinishReason.EOS)])
    assert o.top == [[(2, -0.2)], [(3, -0.3)]] and o.token_ids == [2, 3]


def test_no_interval_sends_every_step():
    s = StreamInterval(0.0, Clock())
    o = out("a", [2])
    assert s.take([o]) == [o]


class OneFront:
    """A front that sends its requests, then Shutdown once every one has finished; records what it was sent."""

    def __init__(self, requests: list[EngineRequest], abort_after: str | None = None) -> None:
        self.pending = [("f", Hello())] + [("f", Add(r)) for r in requests]
        self.open = {r.request_id for r in requests}
        self.messages: list[Outputs] = []
        self.abort_after = abort_after

    def recv(self, timeout: float) -> list:
        msgs, self.pending = self.pending, []
        return msgs if msgs or self.open else [("f", Shutdown())]

    def send(self, client, msg) -> None:
        if not isinstance(msg, Outputs):
            return
        self.messages.append(msg)
        for o in msg.outputs:
            if o.done:
                self.open.discard(o.request_id)
            if o.request_id == self.abort_after and o.token_ids:
                self.pending.append(("f", Abort([o.request_id])))
                self.open.discard(o.request_id)

    def tokens(self) -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        for m in self.messages:
            for o in m.outputs:
                got.setdefault(o.request_id, []).extend(o.token_ids)
        return got


def serve(seconds: float, abort_after: str | None = None) -> OneFront:
    core = EngineCore(tiny_model(0, vocab_size=96, block_size=64), n_slots=4, vocab_size=96)
    reqs = [EngineRequest("greedy", list(range(5, 17)), SamplingParams(max_new_tokens=20, temperature=0.0), seed=1),
            EngineRequest("sampled", list(range(9, 30)), SamplingParams(max_new_tokens=30, temperature=0.9,
                                                                        top_p=0.9), seed=7)]
    front = OneFront(reqs, abort_after)
    loop = CoreLoop(core, front, warmup=False, stream_interval_s=seconds)
    loop.interval.clock = lambda: 0.0  # time stands still: only first tokens, ends and flushes are sent
    loop.run()
    return front


def test_through_the_core_loop_the_same_tokens_arrive_in_fewer_messages():
    every = serve(0.0)
    held = serve(0.004)
    assert held.tokens() == every.tokens() and sorted(map(len, every.tokens().values())) == [20, 30]
    with_tokens = [m for m in held.messages if m.outputs]
    # the two first tokens (one step), then the greedy request's end with its 19 others, then the sampled one's
    assert [sorted((o.request_id, len(o.token_ids)) for o in m.outputs) for m in with_tokens] == [
        [("greedy", 1), ("sampled", 1)], [("greedy", 19), ("sampled", 19)], [("sampled", 10)]]
    assert len([m for m in every.messages if m.outputs]) == 30


def test_an_aborted_requests_held_tokens_are_not_sent():
    front = serve(0.004, abort_after="greedy")
    assert front.tokens()["greedy"] == serve(0.0).tokens()["greedy"][:1]  # its first token, nothing held after
