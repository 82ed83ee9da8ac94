"""Cost-per-byte-per-staleness policies, scored exactly with a cheap branch and bound.

Every score here is ``(c(S) + n(S)) / (m(S) · s(S))`` (or without staleness), where n(S) >= 0
is a neighbourhood cost that is zero unless S has evicted neighbours. The local part is scored
for all candidates at once with numpy; n(S) is evaluated only for candidates with evicted
neighbours whose lower bound is below the best score found so far.

The lower bound uses n(S) as last evaluated: evictions only ever grow a neighbourhood cost,
so a cached value stays a lower bound until something leaves the evicted set (a
rematerialization or a free), which starts a new epoch and resets the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from membudget.core.policies.base import Policy
from membudget.core.pool import CandidatePool
from membudget.core.records import Storage


class CostPolicy(Policy):
    """h(S) = (c(S) + neighbour_cost(S)) / (m(S) · staleness(S)); evict the minimum.

    A zero denominator (no bytes, or touched at the current clock) scores +inf, as in simrd.
    Subclasses change the terms through the hooks below; the score must stay increasing in
    the neighbour cost, which is what makes the cached bound a lower bound.
    """

    staleness: ClassVar[bool] = True
    use_parents: ClassVar[bool] = False  # neighbour_cost depends on evicted parents
    use_children: ClassVar[bool] = False  # ... and on evicted children
    epoch: int = 0  # bumped whenever a neighbourhood cost may have decreased

    def neighbour_cost(self, s: Storage) -> float:
        """Extra recompute cost of evicting ``s`` given its evicted neighbours (>= 0)."""
        return 0.0

    def memory(self, pool: CandidatePool, n: int) -> np.ndarray:
        """The bytes term m(S) of the first ``n`` candidates."""
        return pool.nbytes[:n]

    def denominator(self, pool: CandidatePool, n: int, clock: float) -> np.ndarray:
        m = self.memory(pool, n)
        return m * (clock - pool.last[:n]) if self.staleness else m

    def own_cost(self, pool: CandidatePool, n: int) -> np.ndarray:
        """The cost term before the neighbourhood is added: c(S) of each candidate."""
        return pool.cost[:n]

    def numerator(self, pool: CandidatePool, idx: slice | int, c: np.ndarray | float):
        """Score numerator from the total cost term ``c`` of the candidates ``idx``."""
        return c

    def mask(self, pool: CandidatePool, n: int) -> np.ndarray | None:
        """Which candidates this search considers (None: all)."""
        return None

    def choose(self, pool: CandidatePool, clock: float) -> Storage:
        n = len(pool.items)
        denom = self.denominator(pool, n, clock)
        cost = self.own_cost(pool, n)
        keep = self.mask(pool, n)
        if keep is not None:
            denom = np.where(keep, denom, 0.0)  # a zero denominator scores +inf
        whole = slice(0, n)
        if not (self.use_parents or self.use_children):
            with np.errstate(divide="ignore", invalid="ignore"):
                scores = np.where(denom > 0, self.numerator(pool, whole, cost) / denom, math.inf)
            return pool.items[pool.argmin(scores)]
        if self.use_parents and self.use_children:
            has = (pool.ev_parents[:n] + pool.ev_children[:n]) > 0
        elif self.use_parents:
            has = pool.ev_parents[:n] > 0
        else:
            has = pool.ev_children[:n] > 0
        if pool.bound_epoch != self.epoch:
            pool.bound[: len(pool.bound)] = 0.0
            pool.bound_epoch = self.epoch
        bound = pool.bound[:n]
        with np.errstate(divide="ignore", invalid="ignore"):
            lb = np.where(denom > 0, self.numerator(pool, whole, cost + bound) / denom, math.inf)
        plain = np.where(has, math.inf, lb)
        best_i = pool.argmin(plain)
        best = float(plain[best_i])
        cand = np.flatnonzero(has & (lb <= best))
        if cand.size:
            items, seq = pool.items, pool.seq
            for i in cand[np.argsort(lb[cand], kind="stable")].tolist():
                if lb[i] > best:
                    break
                nc = self.neighbour_cost(items[i])
                bound[i] = nc
                d = denom[i]
                score = self.numerator(pool, i, cost[i] + nc) / d if d > 0 else math.inf
                if score < best or (score == best and seq[i] > seq[best_i]):
                    best, best_i = score, i
        return pool.items[best_i]

    def on_remat(self, s: Storage) -> None:
        self.epoch += 1

    def on_forget(self, s: Storage) -> None:
        self.epoch += 1


def evicted_region_cost(s: Storage, forward: bool,
                        swapped: Callable[[Storage], float] | None = None) -> float:
    """Summed cost of the evicted storages reachable from ``s`` through evicted storages only,
    along child edges (``forward``) or parent edges: the cost of one side of e*(S). With
    ``swapped``, each swapped storage at the region's edge adds ``swapped(n)`` (on the parent
    side, what recomputing through the region pays to copy it back)."""
    total = 0.0
    seen: set[Storage] = set()
    with_swapped = swapped is not None
    stack = [n for n in (s.children if forward else s.parents)
             if n.evicted or (with_swapped and n.swapped)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if not n.evicted:
            total += swapped(n) if swapped is not None else 0.0
            continue
        total += n.cost
        for m in (n.children if forward else n.parents):
            if (m.evicted or (with_swapped and m.swapped)) and m not in seen:
                stack.append(m)
    return total
