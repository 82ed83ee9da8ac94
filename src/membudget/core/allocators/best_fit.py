"""``best-fit``: one pool of exactly ``budget`` bytes, address-ordered blocks, best fit, coalescing.

This is the memory model of Coop's pool (and of a device that cannot move tensors): an
allocation needs one contiguous free block, so it fails when no single hole fits even if the
free total would. Free blocks are kept in a list sorted by (size, address), so the best fit
(the smallest hole that fits, lowest address among equals) is one bisection. A flat list with
the C ``bisect`` functions, rather than a SortedList: the index is touched on every
allocation and free, and at the sizes a pool's holes reach, a C memmove costs less than
SortedList's Python-level bookkeeping.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort

from membudget.core.allocators.base import LayoutAllocator
from membudget.core.allocators.block import Block, link_after, link_before
from membudget.core.records import Storage


class BestFitAllocator(LayoutAllocator):
    """Best-fit placement at the low end of the chosen hole; freed blocks merge with free
    neighbours at once, so no two free blocks are ever adjacent."""

    name = "best-fit"

    def __init__(self, capacity: float) -> None:
        super().__init__(capacity)
        if not math.isfinite(capacity):
            raise ValueError(f"the {self.name} pool needs a finite number of bytes")
        self.capacity = int(capacity)
        self.head = Block(0, self.capacity)
        self._holes: list[tuple[int, int]] = []  # (size, addr) of every free block, sorted
        self._hole_at: dict[int, Block] = {}  # addr -> free block
        if self.capacity > 0:
            self._add_hole(self.head)

    # ------------------------------------------------------------------ holes
    def _add_hole(self, b: Block) -> None:
        insort(self._holes, (b.size, b.addr))
        self._hole_at[b.addr] = b

    def _remove_hole(self, b: Block) -> None:
        holes = self._holes
        del holes[bisect_left(holes, (b.size, b.addr))]
        del self._hole_at[b.addr]

    def _best_fit(self, size: int) -> Block | None:
        """The smallest free block of at least ``size`` bytes, lowest address among equals."""
        holes = self._holes
        i = bisect_left(holes, (size, -1))
        if i == len(holes):
            return None
        return self._hole_at[holes[i][1]]

    # ------------------------------------------------------------------ interface
    def allocate(self, s: Storage) -> bool:
        n = s.nbytes
        if n == 0:
            return True
        hole = self._best_fit(n)
        if hole is None:
            return False
        self._place(hole, s, self._at_low_end(s))
        return True

    def _at_low_end(self, s: Storage) -> bool:
        """Which end of the chosen hole ``s`` takes (subclasses partition the pool)."""
        return True

    def _place(self, hole: Block, s: Storage, low: bool) -> Block:
        """Carve ``s.nbytes`` from the low or high end of ``hole``; return the new block."""
        n = s.nbytes
        self._remove_hole(hole)
        if hole.size == n:
            b = first = last = hole
            b.storage = s
        else:
            if low:
                b = first = Block(hole.addr, n, s, hole.segment)
                last = hole
                hole.addr += n
                link_before(b, hole)
                if hole is self.head:
                    self.head = b
            else:
                b = last = Block(hole.addr + hole.size - n, n, s, hole.segment)
                first = hole
                link_after(b, hole)
            hole.size -= n
            self._add_hole(hole)
        s.block = b
        self.used += n
        if self.used > self.peak:
            self.peak = self.used
        # the storages before b and after the shrunk hole lost free neighbour bytes
        pool = self.pool
        if pool is not None:
            for x in (first.prev, last.next):
                if x is not None:
                    t = x.storage
                    if t is not None and t.slot >= 0:
                        pool.stale.append(t)
        if self.observer is not None:
            self.observer.on_alloc(s, b)
        return b

    def free(self, s: Storage) -> None:
        b = self._release(s)
        if b is not None:
            self._add_hole(b)
            self._mark_beside(b)

    _unindex = _remove_hole

    def layout(self, request: Storage | None = None) -> list[Block]:
        out = []
        b: Block | None = self.head if self.capacity else None
        while b is not None:
            out.append(b)
            b = b.next
        return out

    def largest_free_block(self) -> int:
        return self._holes[-1][0] if self._holes else 0

    # ------------------------------------------------------------------ checking
    def check(self) -> None:
        """Assert the pool's invariants (used by tests): blocks tile [0, capacity) in address
        order, no two free blocks touch, the hole index matches, ``used`` is right, and the
        candidate pool's free-neighbour rows are current or marked."""
        check_tiling(self.layout(), 0, self.capacity)
        holes = [(b.size, b.addr) for b in self.layout() if b.storage is None]
        assert sorted(holes) == list(self._holes), "hole index out of date"
        assert self.used == sum(b.size for b in self.layout() if b.storage is not None)
        self._check_rows()


def check_tiling(blocks: list[Block], start: int, end: int) -> None:
    """Assert that ``blocks`` tile [start, end) in address order, linked both ways, with
    coalescing complete and each storage pointing back at its block."""
    addr = start
    prev = None
    for b in blocks:
        assert b.addr == addr, f"gap or overlap at {addr}: {b}"
        assert b.size > 0, f"empty block {b}"
        assert b.prev is prev, f"broken back link at {b}"
        if prev is not None:
            assert prev.next is b
            assert not (prev.storage is None and b.storage is None), f"uncoalesced at {b}"
        if b.storage is not None:
            assert b.storage.block is b, f"{b.storage} does not point at {b}"
        addr += b.size
        prev = b
    assert addr == end, f"blocks end at {addr}, pool at {end}"
    assert prev is None or prev.next is None
