"""Which training examples each step draws (task and chat fine-tuning): shuffled epochs, a pure function of
(seed, rank, step, micro-step), so that resume is exact with nothing to save but the step."""

from __future__ import annotations

import numpy as np


class ExampleSampler:
    """Training examples in shuffled epochs, a pure function of (seed, rank, step, micro-step): example number
    ((step · grad_accum + micro) · world + rank) · batch_size + j of the run is entry (that mod n) of epoch
    (that div n)'s permutation. Nothing to save but the step; ranks draw disjoint examples."""

    def __init__(self, n: int, batch_size: int, grad_accum: int, seed: int, rank: int = 0, world: int = 1) -> None:
        self.n, self.batch_size, self.grad_accum, self.seed, self.rank, self.world = (
            n, batch_size, grad_accum, seed, rank, world)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.clear()
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def indices(self, step: int, micro: int) -> np.ndarray:
        first = ((step * self.grad_accum + micro) * self.world + self.rank) * self.batch_size
        pos = np.arange(first, first + self.batch_size)
        return np.asarray([self._perm(int(p // self.n))[p % self.n] for p in pos], dtype=np.int64)

    def epoch(self, step: int) -> float:
        """Epochs of training data seen after `step` steps."""
        return step * self.grad_accum * self.world * self.batch_size / self.n
