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
from collections.abc import Callable
from itertools import islice

from membudget.core.allocators.base import fit_into
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

    def make_way(self, nbytes: int, copy: Callable[[Storage], None]) -> None:
        """Clear room for a leaf just below the pinned storages at the top: it predates the
        step, and would lie there had it been taken in before the step's values (a live
        session takes a tensor in when an op first reads it). The values in the way move to
        the low end of holes below, best fit; nothing moves where the topmost hole that
        holds the leaf lies among the pinned storages already, or where a storage in the
        way cannot move or fits nowhere below."""
        n = self.block_bytes(nbytes)
        top = self._topmost_fit(n) if n > 0 else None
        if top is None:  # (no hole holds it: the engine makes room as for any storage)
            return
        tail = [top]  # the topmost hole that holds it, and every block above it
        while (b := tail[-1].next) is not None:
            tail.append(b)
        k = len(tail)  # tail[k:]: the pinned storages at the top, and holes among them
        while (s := tail[k - 1].storage) is None or s.pinned:
            k -= 1
            if k == 0:  # the leaf goes among them
                return
        j, got = k, tail[k].size if k < len(tail) and tail[k].storage is None else 0
        while got < n:  # tail[j:k] is in the way (tail[0] holds n bytes: this ends)
            j -= 1
            s = tail[j].storage
            if s is not None and (s.pinned or not s.movable):
                return
            got += tail[j].size
        movers = [b.storage for b in tail[j:k] if b.storage is not None]
        limit = tail[j].addr
        addr_of = ((1 << self._shift) - 1).__and__  # a key's low bits are the address
        below = [self._hole_at[key] for key in self._holes if addr_of(key) < limit]
        plan = fit_into(self, below, list(range(len(below))), movers)
        if plan:
            self.relocate(plan, copy, low=True)
