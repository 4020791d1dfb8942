"""How often the engine core sends running requests' tokens to their front: at most once per interval, in time
(SGLang's and vLLM's `--stream-interval` count tokens; a time bound only acts where steps are fast).

Each message from the core wakes the front, which then receives, decodes and streams it: ~150 µs of a CPU per
message for the bundled model through HTTP (docs/performance.md, 2026-12-06), as much as a third of its decode
step, on the same two CPUs the step would use. So a step's outputs are held and merged with the next steps' while
the interval since the last send has not passed, and sent together: a request's tokens still arrive in order, each
one at most `seconds` (plus a step) late. A request's first token, its last (finished or failed) and every output
of a step that ends the core's work are sent at once, so time to first token and a request's end are unchanged. A
step slower than the interval (GPT-2 124M on a CPU: ~10 ms) is never held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # engine.build reads DEFAULT_MS before torch may load (engine/core_process.py)
    from engine.request import RequestOutput

DEFAULT_MS = 4.0


def merge(held: RequestOutput, later: RequestOutput) -> None:
    """Append `later`'s tokens (and how it ended) to `held`, a request's output from an earlier step."""
    held.token_ids.extend(later.token_ids)
    held.logprobs.extend(later.logprobs)
    if held.top is not None and later.top is not None:
        held.top.extend(later.top)
    held.finish, held.error, held.message = later.finish, later.error, later.message


class StreamInterval:
    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds, self.clock = seconds, clock
        self.held: dict[str, RequestOutput] = {}
        self.last = float("-inf")  # when the last outputs were sent

    def take(self, outputs: list[RequestOutput], flush: bool = False) -> list[RequestOutput]:
        """What to send after a step with these outputs: nothing while they can wait, else everything held. `flush`:
        the core has nothing left to compute (or is paused), so nothing may wait."""
        if self.seconds <= 0 and not self.held:
            return outputs
        urgent = flush
        for out in outputs:
            held = self.held.get(out.request_id)
            if held is None:
                self.held[out.request_id] = out
                urgent = urgent or out.queue_s is not None  # the request's first output (engine.scheduler)
            else:
                merge(held, out)
            urgent = urgent or out.done
        now = self.clock()
        if not (urgent or now - self.last >= self.seconds) or not self.held:
            return []
        self.last = now
        sent, self.held = list(self.held.values()), {}
        return sent

    def drop(self, request_ids) -> None:
        """Forget what is held for requests the front aborted."""
        for rid in request_ids:
            self.held.pop(rid, None)
