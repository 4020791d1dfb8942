"""How many tokens a request proposes next (`AdaptiveK`), from how its proposals fared and what verifying costs.

A verification pass of a row yields 1 + the tokens it accepts and costs 1 + `extra` plain decode steps, so it pays
while the row accepts more than `extra` tokens a pass. `extra` is measured where the engine core has timed its steps
(engine.spec_decode.costs: on a CPU at batch 1 a compiled pass with its draws costs 2-3 compiled steps, not the
~1.25 of an eager pass); until then it is `RATE_FLOOR` a proposed token (the bundled model, 1 thread, eager: a pass
over 2-5 positions took ~1.2-1.3x a plain decode step, so a proposal had to hold about a quarter of its tokens).
A request's first proposal is `START_K` tokens long (a failed probe is a cheap pass), after a partial acceptance of
a tokens the next proposal is a + 1 long (the run that was right, and one more); after a full acceptance it doubles
back up to k. A request stops proposing for `backoff` steps when `patience` verifications in a row accepted nothing
or its moving average of accepted tokens falls below that of the passes' extra cost; then it probes once again.
Each pause that follows another without a recovery in between doubles (up to `MAX_BACKOFF`); a request back at
twice the cost starts over.
"""

from __future__ import annotations

PATIENCE = 3
FIRST_BACKOFF = 8
MAX_BACKOFF = 256
RATE_FLOOR = 0.25  # a proposed token's cost in steps where none is measured: below this share accepted, it loses
WEIGHT = 0.25  # of the newest verification in the moving averages
RATE_START = 0.5  # accepted share assumed at first: twice what pays
# A first proposal of 2 instead of k: sampled chat turns 0.951/0.963x of speculation off vs 0.960/0.910x, the copy
# workload 1.87/1.94x vs 1.85/1.71x (bench.speculative --repeats 8 --workloads chat,copy --methods off,ngram,
# interleaved pairs, 2026-11-25 EPYC, 1 thread): within run-to-run noise, not worse on either
START_K = 2


class AdaptiveK:
    __slots__ = ("k_max", "k", "misses", "paused", "backoff", "gained", "cost")

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.k = min(k_max, START_K)
        self.misses = 0  # verifications in a row that accepted nothing
        self.paused = 0  # steps left without proposals
        self.backoff = FIRST_BACKOFF
        self.cost = RATE_FLOOR * self.k  # moving average of a pass's extra cost, in plain steps
        self.gained = RATE_START * self.k  # moving average of the tokens a pass accepted

    def budget(self) -> int:
        """Tokens to propose this step (0 while paused; counts the pause down)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def observe(self, proposed: int, accepted: int, extra: float | None = None) -> None:
        """`proposed` 0: a proposer that costs a pass (a draft model) came back with nothing: a miss too. `extra`:
        what the pass cost beyond a plain step, in plain steps (None: RATE_FLOOR a proposed token)."""
        if proposed > 0:
            if accepted >= proposed:
                self.k = min(self.k_max, 2 * self.k)
            else:
                self.k = max(1, min(self.k_max, accepted + 1))
        if extra is None:
            extra = RATE_FLOOR * max(proposed, 1)
        self.gained += WEIGHT * (accepted - self.gained)
        self.cost += WEIGHT * (extra - self.cost)
        self.misses = 0 if accepted else self.misses + 1
        if self.misses >= PATIENCE or self.gained < self.cost:
            self.paused = self.backoff
            self.backoff = min(MAX_BACKOFF, 2 * self.backoff)
            self.misses = PATIENCE - 1  # the probe after the pause decides: one more miss pauses again,
            self.gained = self.cost  # and so does a pass whose tokens do not lift the average above its cost
        elif accepted and self.gained >= 2 * self.cost:
            self.backoff = FIRST_BACKOFF
