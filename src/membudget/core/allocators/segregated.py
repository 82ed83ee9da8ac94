"""``segregated``: best fit, with pinned storages packed from the top of the pool.

Pinned storages (parameters, optimizer state, batches, outputs unsafe to recompute) never
leave, so wherever they land they split the space that activations are evicted from and moved
in. Here they take the highest-address hole that fits and everything else the best fit from
the bottom, so long-lived state stays together at one end. (A live session adopts parameters
when an op first reads them, in the middle of the step: on a plain best-fit pool they land
between activations.)
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import islice

from membudget.core.allocators.best_fit import BestFitAllocator
from membudget.core.allocators.block import Block
from membudget.core.records import Storage


class SegregatedAllocator(BestFitAllocator):
    """Best fit at the low end of the hole; pinned storages in the topmost hole, high end."""

    name = "segregated"
    keeps_pinned_apart = True

    def allocate(self, s: Storage) -> bool:
        if not (self._on_top(s) and s.nbytes):
            return super().allocate(s)
        hole = self._topmost_fit(s.nbytes)
        if hole is None:
            return False
        self._place(hole, s, low=False)
        return True

    def _on_top(self, s: Storage) -> bool:
        """Does ``s`` go in the topmost hole that fits (beside the pinned state)?"""
        return s.pinned

    def _topmost_fit(self, n: int) -> Block | None:
        """The highest-address hole of at least ``n`` bytes."""
        holes = self._holes
        i = bisect_left(holes, n << self._shift)
        if i == len(holes):
            return None
        addr_of = ((1 << self._shift) - 1).__and__  # a key's low bits are the address
        return self._hole_at[max(islice(holes, i, None), key=addr_of)]
