"""The eviction candidates, kept in numpy arrays so that policies score them all at once.

A storage is a candidate while it is resident, unpinned, unlocked, holds bytes and has a
producer. The engine adds and removes candidates (O(1), swap-remove) and writes through every
field a policy reads, so a search is a handful of vector operations instead of a Python loop.
"""

from __future__ import annotations

import numpy as np

from membudget.core.records import Storage


class CandidatePool:
    """Array-backed set of evictable storages: slot i holds ``items[i]``."""

    __slots__ = ("_added", "bound", "bound_epoch", "cost", "ev_children", "ev_parents",
                 "free_adj", "items", "last", "nbytes", "remats", "seq")
    _ARRAYS = ("cost", "nbytes", "last", "ev_parents", "ev_children", "free_adj", "remats", "seq",
               "bound")

    def __init__(self, capacity: int = 1024) -> None:
        self.items: list[Storage] = []
        self.cost = np.zeros(capacity)
        self.nbytes = np.zeros(capacity)
        self.last = np.zeros(capacity)
        self.ev_parents = np.zeros(capacity)
        self.ev_children = np.zeros(capacity)
        self.free_adj = np.zeros(capacity)  # free bytes around the block (layout-aware pools)
        self.remats = np.zeros(capacity)
        self.seq = np.zeros(capacity)  # order of entry: ties go to the latest (as in simrd)
        self._added = 0
        # A policy's cached lower bound of each candidate's neighbourhood cost, valid while
        # ``bound_epoch`` equals the policy's epoch (see policies/cost.py).
        self.bound = np.zeros(capacity)
        self.bound_epoch = -1

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, s: Storage) -> bool:
        return s.slot >= 0

    def _grow(self) -> None:
        size = 2 * self.cost.shape[0]
        for name in self._ARRAYS:
            old = getattr(self, name)
            new = np.zeros(size)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def add(self, s: Storage) -> None:
        i = len(self.items)
        if i == self.cost.shape[0]:
            self._grow()
        self.items.append(s)
        s.slot = i
        self.cost[i] = s.cost
        self.nbytes[i] = s.nbytes
        self.last[i] = s.last_access
        self.ev_parents[i] = s.ev_parents
        self.ev_children[i] = s.ev_children
        self.free_adj[i] = s.free_adj
        self.remats[i] = s.remats
        self._added += 1
        self.seq[i] = self._added
        self.bound[i] = 0.0

    def remove(self, s: Storage) -> None:
        i = s.slot
        last = self.items.pop()
        s.slot = -1
        if last is not s:
            self.items[i] = last
            last.slot = i
            j = len(self.items)
            self.cost[i] = self.cost[j]
            self.nbytes[i] = self.nbytes[j]
            self.last[i] = self.last[j]
            self.ev_parents[i] = self.ev_parents[j]
            self.ev_children[i] = self.ev_children[j]
            self.free_adj[i] = self.free_adj[j]
            self.remats[i] = self.remats[j]
            self.seq[i] = self.seq[j]
            self.bound[i] = self.bound[j]

    def argmin(self, scores: np.ndarray) -> int:
        """Slot of the lowest score; among ties the latest entrant wins, except that among
        zero scores the earliest does (simrd's scan keeps ``<=`` and stops at the first 0)."""
        i = int(np.argmin(scores))
        ties = np.flatnonzero(scores == scores[i])
        if ties.size <= 1:
            return i
        seq = self.seq[ties]
        return int(ties[np.argmin(seq) if scores[i] == 0 else np.argmax(seq)])
