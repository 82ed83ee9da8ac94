"""Baselines with no cost model: ``lru`` (oldest access), ``size`` (largest), ``random``."""

from __future__ import annotations

import numpy as np

from membudget.core.policies.base import Policy
from membudget.core.pool import CandidatePool
from membudget.core.records import Storage


class LRU(Policy):
    """Evict the storage accessed longest ago."""

    name = "lru"

    def choose(self, pool: CandidatePool, clock: float) -> Storage:
        return pool.items[pool.argmin(pool.last[: len(pool.items)])]


class Size(Policy):
    """Evict the largest storage."""

    name = "size"

    def choose(self, pool: CandidatePool, clock: float) -> Storage:
        return pool.items[pool.argmin(-pool.nbytes[: len(pool.items)])]


class Random(Policy):
    """Evict a uniformly random storage (seeded, so runs are reproducible)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def choose(self, pool: CandidatePool, clock: float) -> Storage:
        return pool.items[int(self.rng.integers(len(pool.items)))]
