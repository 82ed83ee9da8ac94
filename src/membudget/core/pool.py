"""The eviction candidates, kept in numpy arrays so that policies score them all at once.

A storage is a candidate while it is resident, unpinned, unlocked, holds bytes and has a
producer. The engine adds and removes candidates (O(1), swap-remove); a storage locked by a
running op stays in the pool until a search is about to start (most ops end with none), so
searches only ever see unlocked ones. The arrays mirror fields
of the storages and are brought up to date lazily: whoever changes a field a policy reads marks
the storage stale (``stale.append``), and ``sync()`` writes the stale rows just before a search.
Between searches an op then costs a list append instead of numpy writes, and a run that never
searches (a budget nothing comes close to) never writes them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from membudget.core.records import Storage


class CandidatePool:
    """Array-backed set of evictable storages: slot i holds ``items[i]``; row i of the arrays
    is current for every storage not in ``stale`` (``sync()`` makes them all current)."""

    __slots__ = ("_added", "_stale_cap", "_synced", "bound", "bound_epoch", "cost",
                 "ev_children", "ev_parents", "free_adj", "items", "last", "nbytes", "price",
                 "remats", "seq", "stale", "track_free_adj")
    _ARRAYS = ("cost", "nbytes", "last", "ev_parents", "ev_children", "free_adj", "remats", "seq",
               "bound")
    #: A pool that is never searched compacts its stale list once this many marks beyond its
    #: members have piled up, so the list holds no storage long after it left the pool.
    STALE_LIMIT = 4096

    def __init__(self, capacity: int = 1024, *, track_free_adj: bool = False) -> None:
        # whether ``free_adj`` is kept (only policies that score free neighbours read it; the
        # allocator then marks the rows whose free neighbours change)
        self.track_free_adj = track_free_adj
        # what evicting a storage costs to undo, for the ``cost`` column (None: its
        # recomputation, ``Storage.cost``; the engine sets it when it may swap instead)
        self.price: Callable[[Storage], float] | None = None
        self.items: list[Storage] = []
        self.stale: list[Storage] = []  # rows to rewrite (duplicates and non-members allowed)
        self._stale_cap = self.STALE_LIMIT  # compact the list once it is longer than this
        self.cost = np.zeros(capacity)
        self.nbytes = np.zeros(capacity)
        self.last = np.zeros(capacity)
        self.ev_parents = np.zeros(capacity)
        self.ev_children = np.zeros(capacity)
        self.free_adj = np.zeros(capacity)  # free bytes around the block (layout-aware pools)
        self.remats = np.zeros(capacity)
        self.seq = np.zeros(capacity)  # order of entry: ties go to the latest (as in simrd)
        self._added = 0
        self._synced = 0  # entries up to this one have had their ``bound`` row reset
        # A policy's cached lower bound of each candidate's neighbourhood cost, valid while
        # ``bound_epoch`` equals the policy's epoch (see policies/cost.py). Only policies write
        # it; a new entrant's row is reset to 0 (always a valid lower bound) by ``sync()``.
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
        items = self.items
        i = s.slot = len(items)
        if i == self.cost.shape[0]:
            self._grow()
        items.append(s)
        self._added += 1  # touch(s), inlined: every new output comes here
        s.seq = self._added
        stale = self.stale
        stale.append(s)
        if len(stale) > self._stale_cap:
            self._compact()

    def touch(self, s: Storage) -> None:
        """``s`` becomes the latest entrant, its row stale: what ``add`` does once it has a
        slot, and all that a lock no search saw needs (as if ``s`` had been removed and added
        again)."""
        self._added += 1
        s.seq = self._added
        stale = self.stale
        stale.append(s)
        if len(stale) > self._stale_cap:
            self._compact()

    def _compact(self) -> None:
        """Marks piled up with no search in between: mark every member once instead (a
        superset of the stale rows, so ``sync`` stays right) and let go of the storages that
        left the pool. Cheaper than a sync (no hashing, no row written), and it happens at
        most once per ``STALE_LIMIT`` marks."""
        stale = self.stale
        stale.clear()  # in place: callers may hold the list
        stale.extend(self.items)
        self._stale_cap = len(stale) + self.STALE_LIMIT

    def remove(self, s: Storage) -> None:
        i = s.slot
        items = self.items
        last = items.pop()
        s.slot = -1
        if last is not s:
            items[i] = last
            last.slot = i
            self.stale.append(last)
            if self.bound_epoch >= 0:  # the policy's cache, once it has one, moves too
                bound = self.bound
                bound[i] = bound[len(items)]

    def sync(self) -> None:
        """Write the stale rows (every field a policy reads) from their storages."""
        stale = [s for s in dict.fromkeys(self.stale) if s.slot >= 0]
        self.stale.clear()  # in place: callers may hold the list
        self._stale_cap = self.STALE_LIMIT
        if not stale:
            return
        idx = [s.slot for s in stale]
        price = self.price
        self.cost[idx] = [s.cost for s in stale] if price is None else [price(s) for s in stale]
        self.nbytes[idx] = [s.nbytes for s in stale]
        self.last[idx] = [s.last_access for s in stale]
        self.ev_parents[idx] = [s.ev_parents for s in stale]
        self.ev_children[idx] = [s.ev_children for s in stale]
        if self.track_free_adj:
            self.free_adj[idx] = [s.free_adj for s in stale]
        self.remats[idx] = [s.remats for s in stale]
        self.seq[idx] = [s.seq for s in stale]
        synced = self._synced
        new = [s.slot for s in stale if s.seq > synced]
        if new:
            self.bound[new] = 0.0
        self._synced = self._added

    def argmin(self, scores: np.ndarray) -> int:
        """Slot of the lowest score; among ties the latest entrant wins, except that among
        zero scores the earliest does (simrd's scan keeps ``<=`` and stops at the first 0)."""
        i = int(np.argmin(scores))
        ties = np.flatnonzero(scores == scores[i])
        if ties.size <= 1:
            return i
        seq = self.seq[ties]
        return int(ties[np.argmin(seq) if scores[i] == 0 else np.argmax(seq)])
