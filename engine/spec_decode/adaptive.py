"""How many tokens a request proposes next (`AdaptiveK`), from how its proposals fared.

A rejected proposal costs the positions it added to the verification pass: on a CPU at batch 1 a pass over 2-5
positions took ~1.2-1.3x a plain decode step (the bundled model, 1 thread), so a proposal must hold about a
quarter of the time to pay. So: a request's first proposal is `START_K` tokens long (a failed probe is a cheap
pass), after a partial acceptance of a tokens the next proposal is a + 1 long (the run
that was right, and one more); after a full acceptance it doubles back up to k. A request stops proposing for
`backoff` steps when `patience` verifications in a row accepted nothing or its acceptance rate (a moving average
of accepted / proposed) falls below `RATE_FLOOR`; then it probes once again. Each pause that follows another
without a recovery in between doubles (up to `MAX_BACKOFF`); a request back above the floor starts over.
"""

from __future__ import annotations

PATIENCE = 3
FIRST_BACKOFF = 8
MAX_BACKOFF = 256
RATE_FLOOR = 0.25  # below this share of proposed tokens accepted, verifying costs more than it saves
RATE_WEIGHT = 0.25  # of the newest verification in the moving average
RATE_START = 0.5
# A first proposal of 2 instead of k: sampled chat turns 0.951/0.963x of speculation off vs 0.960/0.910x, the copy
# workload 1.87/1.94x vs 1.85/1.71x (bench.speculative --repeats 8 --workloads chat,copy --methods off,ngram,
# interleaved pairs, 2026-11-25 EPYC, 1 thread): within run-to-run noise, not worse on either
START_K = 2


class AdaptiveK:
    __slots__ = ("k_max", "k", "misses", "paused", "backoff", "rate")

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.k = min(k_max, START_K)
        self.misses = 0  # verifications in a row that accepted nothing
        self.paused = 0  # steps left without proposals
        self.backoff = FIRST_BACKOFF
        self.rate = RATE_START  # moving average of accepted / proposed

    def budget(self) -> int:
        """Tokens to propose this step (0 while paused; counts the pause down)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def observe(self, proposed: int, accepted: int) -> None:
        """`proposed` 0: a proposer that costs a pass (a draft model) came back with nothing: a miss too."""
        if proposed > 0:
            if accepted >= proposed:
                self.k = min(self.k_max, 2 * self.k)
            else:
                self.k = max(1, min(self.k_max, accepted + 1))
        self.rate += RATE_WEIGHT * ((accepted / proposed if proposed > 0 else 0.0) - self.rate)
        self.misses = 0 if accepted else self.misses + 1
        if self.misses >= PATIENCE or self.rate < RATE_FLOOR:
            self.paused = self.backoff
            self.backoff = min(MAX_BACKOFF, 2 * self.backoff)
            self.misses = PATIENCE - 1  # the probe after the pause decides: one more miss pauses again,
            self.rate = RATE_FLOOR  # and so does a rate that a hit does not lift
        elif accepted and self.rate >= 2 * RATE_FLOOR:
            self.backoff = FIRST_BACKOFF
