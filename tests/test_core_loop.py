"""The engine core's busy loop (engine/core_loop.py): what each front is sent after a step."""

from __future__ import annotations

from engine.core_loop import CoreLoop
from engine.request import FinishReason, RequestOutput
from engine.wire import Outputs


class FakeCore:
    def __init__(self) -> None:
        self.running = 0

    def stats(self) -> dict:
        return {"running": self.running, "queued": 0}


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Outputs]] = []

    def send(self, client, msg) -> None:
        self.sent.append((client, msg))


def test_every_front_learns_the_counts_when_another_fronts_request_empties_the_batch():
    # two HTTP fronts (GPT_API_SERVERS=2): the step that finishes the last running request carries outputs for
    # front "a" only; front "b" must still be told the batch is empty, or its /info and gpt_batch_size keep
    # reporting the last count it saw (running=2 on an idle server)
    core, transport = FakeCore(), Recorder()
    loop = CoreLoop(core, transport, warmup=False)
    loop.clients |= {"a", "b"}
    loop.owners.update({"ra": "a", "rb": "b"})
    core.running = 2
    loop.deliver([RequestOutput("ra", [1], [0.0]), RequestOutput("rb", [1], [0.0])])
    assert {c for c, _ in transport.sent} == {"a", "b"}

    transport.sent.clear()
    core.running = 1
    loop.deliver([RequestOutput("rb", [2], [0.0], finish=FinishReason.LENGTH)])
    assert {c: m.stats["running"] for c, m in transport.sent} == {"a": 1, "b": 1}
    assert next(m for c, m in transport.sent if c == "a").outputs == []

    transport.sent.clear()
    core.running = 0
    loop.deliver([RequestOutput("ra", [2], [0.0], finish=FinishReason.LENGTH)])
    assert {c: m.stats["running"] for c, m in transport.sent} == {"a": 0, "b": 0}

    transport.sent.clear()  # nothing moved: no message to anyone
    loop.deliver([])
    assert transport.sent == []
