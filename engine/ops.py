"""What the scheduler and the engine core hand each other in a step: the slot operations the scheduler records
(scheduler → core, applied in order before the step computes) and the draws the core samples (core → scheduler).
Plain frozen dataclasses, dispatched by type (`match`); no torch."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import EngineRequest


# ---------------------------------------------------------------------------------------------- scheduler → core
@dataclass(frozen=True)
class Admit:
    """Keep the slot's first `keep` cached tokens (0: reset it), write the request's sampling state and prompt."""

    slot: int
    request: EngineRequest
    keep: int = 0


@dataclass(frozen=True)
class Copy:
    """dst's cache holds src's first n tokens (prefix caching)."""

    src: int
    dst: int
    n: int


@dataclass(frozen=True)
class Move:
    """Move what the slots hold (cache entries and sampler state) from src[i] to dst[i]; swaps work."""

    src: list[int]
    dst: list[int]


@dataclass(frozen=True)
class Free:
    """The slot holds nothing now."""

    slot: int


@dataclass(frozen=True)
class Idle:
    """The slot's request left; its cache entries stay for reuse (prefix caching)."""

    slot: int


Op = Admit | Copy | Move | Free | Idle


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
