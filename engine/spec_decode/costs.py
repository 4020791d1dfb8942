"""What verifying costs here (`StepCosts`): the engine core's own wall times of its decode steps, as moving
averages per batch size, plain and by a verification pass's positions, so a row speculates while what it accepts
pays for its pass (engine.spec_decode.adaptive).

    costs.plain(n, seconds)        # a plain decode step of n rows (its proposals' look-up included)
    costs.verify(n, T, seconds)    # a speculative step of n rows and T positions a row (proposals, pass, draws)
    costs.extra(n, T)              # what that pass costs beyond a plain step, in plain steps (None: not timed yet)

Each kind's first step is not counted (one-time costs: a compiled pass's first run); a compiled pass is priced by
its padded width (the core passes it as T).

A pass's price depends on the machine, the model and the path: on the bundled model at batch 1 (AVX2, 2 threads)
an eager pass cost ~1.25 eager steps, a compiled one with its draws 2-3 compiled steps (docs/performance.md,
"Speculation that pays for itself"): a constant cannot hold both, a timing of the steps the core runs can.
"""

from __future__ import annotations

WEIGHT = 0.1  # of the newest step in a moving average
SPIKE_CAP = 3.0  # a step above this multiple of its average counts as this multiple (a page fault, a preemption)


class StepCosts:
    def __init__(self) -> None:
        self._plain: dict[int, float] = {}
        self._verify: dict[tuple[int, int], float] = {}
        # keys timed once: a kind's first step pays one-time costs (a package's first run) and is not counted
        self._first_plain: set[int] = set()
        self._first_verify: set[tuple[int, int]] = set()

    @staticmethod
    def _update(avg: dict, first: set, key, seconds: float) -> None:
        old = avg.get(key)
        if old is not None:
            avg[key] = old + WEIGHT * (min(seconds, SPIKE_CAP * old) - old)
        elif key in first:
            avg[key] = seconds
        else:
            first.add(key)

    def plain(self, n: int, seconds: float) -> None:
        self._update(self._plain, self._first_plain, n, seconds)

    def verify(self, n: int, positions: int, seconds: float) -> None:
        self._update(self._verify, self._first_verify, (n, positions), seconds)

    def extra(self, n: int, positions: int) -> float | None:
        """A pass of n rows and `positions` positions a row beyond a plain step of n rows, in plain steps (≥ 0), or
        None while either is untimed."""
        plain, verify = self._plain.get(n), self._verify.get((n, positions))
        if plain is None or verify is None or plain <= 0:
            return None
        return max(0.0, verify / plain - 1)

    def as_dict(self) -> dict:
        """/info: each timed pass's cost in plain steps of its batch size, keyed "rows x positions"."""
        return {f"{n}x{t}": round(v / self._plain[n], 2) for (n, t), v in sorted(self._verify.items())
                if self._plain.get(n)}
