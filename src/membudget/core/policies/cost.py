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

import numpy as np

from membudget.core.policies.base import Policy
from membudget.core.pool import CandidatePool
from membudget.core.records import Storage


class CostPolicy(Policy):
    """h(S) = (c(S) + neighbour_cost(S)) / (m(S) · staleness(S)); evict the minimum.

    A zero denominator (no bytes, or touched at the current clock) scores +inf, as in simrd.
    """

    staleness: bool = True
    use_parents: bool = False  # neighbour_cost depends on evicted parents
    use_children: bool = False  # ... and on evicted children
    epoch: int = 0  # bumped whenever a neighbourhood cost may have decreased

    def neighbour_cost(self, s: Storage) -> float:
        """Extra recompute cost of evicting ``s`` given its evicted neighbours (>= 0)."""
        return 0.0

    def choose(self, pool: CandidatePool, clock: float) -> Storage:
        n = len(pool.items)
        cost = pool.cost[:n]
        denom = pool.nbytes[:n] * (clock - pool.last[:n]) if self.staleness else pool.nbytes[:n]
        if not (self.use_parents or self.use_children):
            with np.errstate(divide="ignore", invalid="ignore"):
                return pool.items[pool.argmin(np.where(denom > 0, cost / denom, math.inf))]
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
            lb = np.where(denom > 0, (cost + bound) / denom, math.inf)
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
                score = (cost[i] + nc) / d if d > 0 else math.inf
                if score < best or (score == best and seq[i] > seq[best_i]):
                    best, best_i = score, i
        return pool.items[best_i]

    def on_remat(self, s: Storage) -> None:
        self.epoch += 1

    def on_forget(self, s: Storage) -> None:
        self.epoch += 1


def evicted_region_cost(s: Storage, forward: bool) -> float:
    """Summed cost of the evicted storages reachable from ``s`` through evicted storages only,
    along child edges (``forward``) or parent edges: the cost of one side of e*(S)."""
    total = 0.0
    seen: set[Storage] = set()
    stack = [n for n in (s.children if forward else s.parents) if n.evicted]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        total += n.cost
        for m in (n.children if forward else n.parents):
            if m.evicted and m not in seen:
                stack.append(m)
    return total
