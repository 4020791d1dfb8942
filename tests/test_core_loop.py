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


class CompilingCore(FakeCore):
    """Idle, with a background compile that finishes after `polls_left` polls."""

    def __init__(self, polls_left: int) -> None:
        super().__init__()
        self.polls_left, self.compiled = polls_left, False
        self.warmup_error = None

    def stats(self) -> dict:
        return super().stats() | {"compiling": not self.compiled, "compiled_decode": self.compiled}

    def has_work(self) -> bool:
        return False

    def poll_compiled(self) -> bool:
        self.polls_left -= 1
        if self.compiled or self.polls_left > 0:
            return False
        self.compiled = True
        return True

    def shutdown(self) -> list:
        return []


class IdleTransport(Recorder):
    """No messages for `rounds` receives, then a Shutdown."""

    def __init__(self, rounds: int) -> None:
        super().__init__()
        self.rounds = rounds

    def recv(self, timeout: float) -> list:
        from engine.wire import Shutdown

        self.rounds -= 1
        return [] if self.rounds >= 0 else [("a", Shutdown())]


def test_a_compile_that_finishes_while_the_server_is_idle_is_installed_and_every_front_told():
    # the decode step compiles in the background for minutes; on an idle server /info said "compiling" until the
    # next request arrived, because the steps were installed (and the stats sent) only at a step
    core, transport = CompilingCore(polls_left=3), IdleTransport(rounds=5)
    loop = CoreLoop(core, transport, warmup=False)
    loop.clients |= {"a", "b"}
    loop.warm = True
    loop.run()
    told = [(c, m.stats) for c, m in transport.sent if isinstance(m, Outputs) and m.stats.get("compiled_decode")]
    assert {c for c, _ in told} == {"a", "b"} and all(not s["compiling"] for _, s in told)
