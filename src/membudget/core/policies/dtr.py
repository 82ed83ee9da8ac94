"""``dtr``: the DTR paper's h_DTR with the exact evicted neighbourhood e*(S).

h(S) = (c(S) + c(evicted ancestors region) + c(evicted descendants region)) / (m(S) · s(S)).

A region entered through one evicted neighbour that is a chain (each link has one evicted
neighbour on that side) costs one addition per link, kept (until the evicted set changes)
for every candidate that enters the same chain: scoring the candidates around a long
evicted chain (a recurrent model's) walked the chain once per candidate. A
rematerialization resets the cached bounds of the candidates around the regions it shrinks
only (``_unbound``).
"""

from __future__ import annotations

from membudget.core.policies.cost import CostPolicy, evicted_region_cost
from membudget.core.records import Storage


class DTR(CostPolicy):
    name = "dtr"
    use_parents = True
    use_children = True

    def __init__(self) -> None:
        super().__init__()
        # the cost of an evicted storage and its region, along parent or child edges
        self._up: dict[Storage, float] = {}
        self._down: dict[Storage, float] = {}

    def neighbour_cost(self, s: Storage) -> float:
        return self._side(s, False) + self._side(s, True)

    def _side(self, s: Storage, forward: bool) -> float:
        """``evicted_region_cost(s, forward)``."""
        entry = None
        for n in (s.children if forward else s.parents):
            if n.evicted:
                if entry is not None:  # two ways in: the regions may overlap
                    return evicted_region_cost(s, forward)
                entry = n
        if entry is None:
            return 0.0
        total = self._chain(entry, forward)
        return evicted_region_cost(s, forward) if total is None else total

    def _chain(self, e: Storage, forward: bool) -> float | None:
        """The cost of evicted ``e`` and of its region on that side if that region is a
        chain (each link one evicted neighbour on that side, the last none); else None."""
        memo = self._down if forward else self._up
        chain: list[Storage] = []
        on: set[Storage] = set()
        n = e
        while True:
            total = memo.get(n)
            if total is not None:
                break
            on.add(n)
            nxt = None
            for m in (n.children if forward else n.parents):
                if m.evicted:
                    if nxt is not None:
                        return None  # a branch
                    nxt = m
            if nxt is None:  # the end of the chain
                total = memo[n] = n.cost
                break
            if nxt in on:
                return None  # a cycle (a version written in place of its input)
            chain.append(n)
            n = nxt
        for n in reversed(chain):
            total = memo[n] = n.cost + total
        return total

    def on_evict(self, s: Storage) -> None:
        self._up.clear()  # (regions only grow: the cached bounds stay lower bounds)
        self._down.clear()

    def on_remat(self, s: Storage) -> None:
        self._unbound(s)

    def on_forget(self, s: Storage) -> None:
        self._unbound(s)

    def _unbound(self, s: Storage) -> None:
        """``s`` leaves the evicted set: only the regions that held it shrink, so reset the
        cached bound of the candidates around them (found by walking from ``s`` through
        evicted storages) instead of every bound, which cost a long evicted chain's
        candidates an exact score each in every search."""
        self._up.clear()
        self._down.clear()
        pool = self.engine.pool
        if pool.bound_epoch != self.epoch:
            return  # (no bound cached yet)
        bound = pool.bound
        for forward in (True, False):
            seen: set[Storage] = set()
            stack = [s]
            while stack:
                n = stack.pop()
                for m in (n.children if forward else n.parents):
                    if m in seen:
                        continue
                    seen.add(m)
                    if m.evicted:
                        stack.append(m)
                    elif m.slot >= 0:
                        bound[m.slot] = 0.0
