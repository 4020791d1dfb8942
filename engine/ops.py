"""What the scheduler and the engine core hand each other in a step: the draws the core samples (core → scheduler).
No torch."""

from __future__ import annotations

from dataclasses import dataclass


# ---------------------------------------------------------------------------------------------- core → scheduler
@dataclass
class Draw:
    """One token per row as the host sees it."""

    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None  # the top_n most likely (id, logprob) under the raw distribution
    stop: bool = False  # set by the engine core: the request's grammar is complete (structured output)
    failed: str = ""  # set by the engine core: the grammar refused this token (the library's reason)


# A sampled request's draws in one step: one Draw, or a list of them for a row that verified proposals (speculative
# decoding, EngineCore._verify), in order.
RowDraws = Draw | list[Draw]
