"""``coop``: Coop's layout-aware eviction: free one contiguous block at the lowest cost.

When an allocation fails, one pass over the allocator's address-ordered layout finds the
contiguous run of blocks whose bytes cover the request and whose summed h(t) = c(t)/staleness
is lowest (c is dtr-eq's union-find cost); free blocks cost 0, and blocks of storages that are
not candidates (pinned, locked by the running op, just touched) are barriers, as are segment
boundaries. Every storage in the run is evicted at once, after which the request fits.

The search is vectorized: with prefix sums S (bytes) and H (cost), the cheapest run ending at
block j starts at the largest i with S[j+1] − S[i] ≥ request (costs are >= 0, so a shorter
run never costs more), which is one ``searchsorted`` for all j. Runs whose prefix-sum cost is
within rounding error of the best are re-summed exactly, so the choice equals brute force.
When no run fits (every run crosses a barrier, or the request needs a new segment), coop
falls back to evicting dtr-eq's single best candidate and is asked again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from operator import attrgetter

import numpy as np

from membudget.core.allocators.block import Block
from membudget.core.policies.cost import CostPolicy
from membudget.core.policies.dtr_eq import DTREq
from membudget.core.pool import CandidatePool
from membudget.core.records import Storage

FREE = -1
BARRIER = -2
_size = attrgetter("size")
_storage = attrgetter("storage")
_segment = attrgetter("segment")


def covering_runs(sizes: np.ndarray, barrier: np.ndarray, need: int,
                  segments: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For every block j that can end a run, the start i of the shortest run [i, j] of
    non-barrier blocks of one segment whose sizes sum to >= ``need``. With costs >= 0 that
    run is the cheapest ending at j, whatever the costs, so this is computed once per search.
    """
    n = sizes.shape[0]
    S = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    idx = np.arange(n)
    stretch = np.where(barrier, idx + 1, 0)  # first index of the barrier-free stretch
    if segments is not None and n > 1:
        new_seg = np.flatnonzero(segments[1:] != segments[:-1]) + 1
        stretch[new_seg] = np.maximum(stretch[new_seg], new_seg)
    first = np.maximum.accumulate(stretch) if n else stretch
    start = np.searchsorted(S, S[1:] - need, side="right") - 1
    ends = np.flatnonzero((~barrier) & (start >= first) & (S[1:] >= need))
    return start[ends], ends


def _cheapest(costs: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Indices of the runs whose summed cost is the lowest, up to prefix-sum rounding."""
    H = np.concatenate(([0.0], np.cumsum(costs)))
    approx = H[ends + 1] - H[starts]
    slack = 4 * costs.shape[0] * np.finfo(float).eps * float(H[-1])
    return np.flatnonzero(approx <= approx.min() + slack)


def _exact_best(costs: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                near: np.ndarray) -> int:
    """Among the runs ``near``, the one with the lowest exactly summed cost (lowest start)."""
    if near.size == 1:
        return int(near[0])
    return min((math.fsum(costs[starts[k]: ends[k] + 1]), int(starts[k]), int(k))
               for k in near.tolist())[2]


def cheapest_window(sizes: np.ndarray, costs: np.ndarray, barrier: np.ndarray, need: int,
                    segments: np.ndarray | None = None, pending: np.ndarray | None = None,
                    exact: Callable[[int], float] | None = None) -> tuple[int, int] | None:
    """The run [i, j] of non-barrier blocks of one segment with summed size >= ``need`` and
    the lowest summed cost (the lowest start among equals), or None. ``costs`` must be >= 0
    and finite where ``barrier`` is False.

    Where ``pending`` is set, a cost is only a lower bound and ``exact(k)`` gives the true
    one: the cheapest run is made exact block by block until it is exact throughout, and
    then no other run can be cheaper (branch and bound), so few exact costs are computed.
    """
    starts, ends = covering_runs(sizes, barrier, need, segments)
    if ends.size == 0:
        return None
    c = np.where(barrier, 0.0, costs)
    while True:
        near = _cheapest(c, starts, ends)
        todo = [] if pending is None else [
            k for r in near.tolist() for k in range(int(starts[r]), int(ends[r]) + 1)
            if pending[k]]
        if not todo:
            k = _exact_best(c, starts, ends, near)
            return int(starts[k]), int(ends[k])
        assert exact is not None and pending is not None
        for k in todo:
            if pending[k]:
                c[k] = exact(k)
                pending[k] = False


class Coop(DTREq):
    name = "coop"
    needs_layout = True
    default_allocator = "two-sided"
    default_inplace = "remat"

    def victims(self, pool: CandidatePool, clock: float, request: Storage) -> list[Storage]:
        alloc = self.engine.allocator
        if not alloc.has_layout:  # a lifted budget is a fungible pool: no window to free
            return [self.choose(pool, clock)]
        blocks = alloc.layout(request)
        run = cheapest_eviction_window(self, pool, clock, blocks,
                                       alloc.block_bytes(request.nbytes))
        if run is None:
            return [self.choose(pool, clock)]
        i, j = run
        return [b.storage for b in blocks[i: j + 1] if b.storage is not None]


def cheapest_eviction_window(policy: CostPolicy, pool: CandidatePool, clock: float,
                             blocks: list[Block], need: int) -> tuple[int, int] | None:
    """The run of ``blocks`` (the layout) to evict whose summed h is lowest under
    ``policy``'s cost (own cost plus evicted neighbourhood, over staleness). Every block's
    h starts as a lower bound (its own cost plus the cached bound of its neighbourhood
    cost) and is made exact only where the branch and bound of ``cheapest_window`` needs it."""
    if not blocks:
        return None
    size_a = np.fromiter(map(_size, blocks), dtype=np.int64, count=len(blocks))
    slots = [FREE if s is None else s.slot if s.slot >= 0 else BARRIER
             for s in map(_storage, blocks)]
    slot_a = np.array(slots, dtype=np.int64)
    seg_a = (None if blocks[0].segment == blocks[-1].segment else  # segments are ordered
             np.fromiter(map(_segment, blocks), dtype=np.int64, count=len(blocks)))
    cand = slot_a >= 0
    cs = slot_a[cand]
    if pool.bound_epoch != policy.epoch:
        pool.bound[: len(pool.bound)] = 0.0
        pool.bound_epoch = policy.epoch
    stale = clock - pool.last[cs]
    inv = np.zeros(cs.shape[0])
    np.divide(1.0, stale, out=inv, where=stale > 0)
    pos = np.flatnonzero(cand)
    barrier = slot_a == BARRIER
    barrier[pos[stale <= 0]] = True  # touched at this very clock: never worth evicting
    own = pool.cost[cs]
    costs = np.zeros(len(blocks))
    costs[pos] = (own + pool.bound[cs]) * inv
    pending = np.zeros(len(blocks), dtype=bool)  # lower bounds not yet made exact
    pending[pos] = (pool.ev_parents[cs] + pool.ev_children[cs]) > 0
    items = pool.items

    def exact(k: int) -> float:
        slot = slots[k]
        nc = policy.neighbour_cost(items[slot])
        pool.bound[slot] = nc
        return (pool.cost[slot] + nc) / (clock - pool.last[slot])

    return cheapest_window(size_a, costs, barrier, need, seg_a, pending, exact)
