"""``megengine``: the score of MegEngine's eager DTR (``DynamicSublinear``).

h(S) = (c + 1e-3)^α · γ^r / (((m + f) / 2^20)^β · (T − t_last + 1e-3)^δ), evict the minimum:
c is the cost of the evicted neighbourhood only (MegEngine leaves the candidate's own cost
out), r how often S was recomputed, f the free bytes directly around S. Candidates of at
most ``min_bytes`` (1 MiB) are skipped; where none is larger, all are considered (MegEngine
would defragment instead). With ``sqrt_sampling`` only ⌊√N⌋ random candidates are scored.

Deviation: the neighbourhood is dtr-eq's union-find over evicted parents and children (the
DTR paper's), each class counted once as max(class cost, member cost); MegEngine walks the
producer's inputs and sibling outputs.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import cast

import numpy as np

from membudget.core.policies.dtr_eq import DTREq, _find, _Node
from membudget.core.pool import CandidatePool
from membudget.core.records import Storage

MIB = 2**20


class MegEngine(DTREq):
    name = "megengine"
    default_allocator = "best-fit"
    reads_free_adj = True

    def __init__(self, seed: int = 0, *, alpha: float = 1.0, beta: float = 1.0,
                 gamma: float = 1.0001, delta: float = 1.0, sqrt_sampling: bool = False,
                 min_bytes: int = MIB, own_cost: bool = False) -> None:
        self.alpha, self.beta, self.gamma, self.delta = alpha, beta, gamma, delta
        self.sqrt_sampling = sqrt_sampling
        self.min_bytes = min_bytes
        self.include_own = own_cost
        self.rng = np.random.default_rng(seed)

    def neighbour_cost(self, s: Storage) -> float:
        best: dict[object, float] = {}
        for n in chain(s.parents, s.children):
            if n.evicted:
                root = _find(cast(_Node, n.uf))
                best[root] = max(best.get(root, 0.0), root.val, n.cost)
        return sum(best.values())

    def own_cost(self, pool: CandidatePool, n: int) -> np.ndarray:
        return pool.cost[:n] if self.include_own else np.zeros(n)

    def numerator(self, pool: CandidatePool, idx: slice | int, c: np.ndarray | float):
        return (c + 1e-3) ** self.alpha * self.gamma ** pool.remats[idx]

    def denominator(self, pool: CandidatePool, n: int, clock: float) -> np.ndarray:
        mem = (pool.nbytes[:n] + pool.free_adj[:n]) / MIB
        return mem ** self.beta * (clock - pool.last[:n] + 1e-3) ** self.delta

    def mask(self, pool: CandidatePool, n: int) -> np.ndarray | None:
        big = pool.nbytes[:n] > self.min_bytes
        keep = big if big.any() else None
        if self.sqrt_sampling and n > 1:
            sample = np.zeros(n, dtype=bool)
            sample[self.rng.choice(n, size=math.isqrt(n), replace=False)] = True
            keep = sample if keep is None else keep & sample
            if not keep.any():
                keep = sample
        return keep
