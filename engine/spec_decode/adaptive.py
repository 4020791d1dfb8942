"""How many tokens a request proposes next (`AdaptiveK`), from how its proposals fared.

A rejected proposal costs the positions it added to the verification pass; at batch 1 on a CPU that is ~1.4x a
plain decode step for 4 extra positions (the bundled model, 1 thread). So: after a partial acceptance of a tokens
the next proposal is a + 1 long (the run that was right, and one more); after a full acceptance it doubles back up
to k. After `patience` verifications in a row that accepted nothing, the request stops proposing for `backoff`
steps, then probes once again; each failed probe doubles the pause (up to `max_backoff`), any acceptance resets it.
"""

from __future__ import annotations

PATIENCE = 3
FIRST_BACKOFF = 8
MAX_BACKOFF = 256


class AdaptiveK:
    __slots__ = ("k_max", "k", "misses", "paused", "backoff")

    def __init__(self, k_max: int) -> None:
        self.k_max = self.k = k_max
        self.misses = 0  # verifications in a row that accepted nothing
        self.paused = 0  # steps left without proposals
        self.backoff = FIRST_BACKOFF

    def budget(self) -> int:
        """Tokens to propose this step (0 while paused; counts the pause down)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def observe(self, proposed: int, accepted: int) -> None:
        """`proposed` 0: a proposer that costs a pass (a draft model) came back with nothing: a miss too."""
        if proposed <= 0:
            self._miss()
            return
        if accepted >= proposed:
            self.k = min(self.k_max, 2 * self.k)
        else:
            self.k = max(1, min(self.k_max, accepted + 1))
        if accepted:
            self.misses, self.backoff = 0, FIRST_BACKOFF
            return
        self._miss()

    def _miss(self) -> None:
        self.misses += 1
        if self.misses >= PATIENCE:
            self.paused = self.backoff
            self.backoff = min(MAX_BACKOFF, 2 * self.backoff)
            self.misses = PATIENCE - 1  # one more miss after the pause (the probe) pauses again
