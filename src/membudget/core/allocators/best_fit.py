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
from collections.abc import Callable
from itertools import islice

from membudget.core.allocators.base import LayoutAllocator
from membudget.core.allocators.block import Block
from membudget.core.records import Storage


class BestFitAllocator(LayoutAllocator):
    """Best-fit placement at the low end of the chosen hole; freed blocks merge with free
    neighbours at once, so no two free blocks are ever adjacent.

    A hole is indexed by one integer key, ``size << shift | addr`` (``shift`` bits hold any
    address), so keys sort by (size, address) and compare as machine integers: placing and
    freeing, on every op, bisect a list of ints and make no tuples."""

    name = "best-fit"
    compacts = True

    def __init__(self, capacity: float) -> None:
        super().__init__(capacity)
        if not math.isfinite(capacity):
            raise ValueError(f"the {self.name} pool needs a finite number of bytes")
        self.capacity = size = int(capacity)
        self.head = Block(0, size)
        self._shift = max(size.bit_length(), 1)
        self._holes: list[int] = []  # the key of every free block, sorted
        self._hole_at: dict[int, Block] = {}  # key -> free block
        if size > 0:
            key = size << self._shift  # the one hole, at address 0
            self._holes.append(key)
            self._hole_at[key] = self.head

    # ------------------------------------------------------------------ holes
    def _best_fit(self, size: int) -> Block | None:
        """The smallest free block of at least ``size`` bytes, lowest address among equals."""
        holes = self._holes
        i = bisect_left(holes, size << self._shift)
        if i == len(holes):
            return None
        return self._hole_at[holes[i]]

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
        """Carve ``s.nbytes`` from the low or high end of ``hole``; return the new block.
        (On every allocation: the hole index and the list links are written inline.)"""
        n = s.nbytes
        holes, hole_at, shift = self._holes, self._hole_at, self._shift
        size, addr = hole.size, hole.addr
        key = size << shift | addr
        del holes[bisect_left(holes, key)]
        del hole_at[key]
        if size == n:
            b = first = last = hole
            b.storage = s
        else:
            rest = size - n
            if low:  # b takes the low end: it goes before the hole
                p = hole.prev
                b = first = Block(addr, n, s, hole.segment, p, hole)
                last = hole
                if p is None:
                    self.head = b
                else:
                    p.next = b
                hole.prev = b
                hole.addr = addr = addr + n
            else:  # the high end: after the hole
                nx = hole.next
                b = last = Block(addr + rest, n, s, hole.segment, hole, nx)
                first = hole
                if nx is not None:
                    nx.prev = b
                hole.next = b
            hole.size = rest
            key = rest << shift | addr
            insort(holes, key)
            hole_at[key] = hole
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
        """Free the block of ``s``, merged with its free neighbours at once (the hole index
        and the list links written inline: on every free)."""
        b = s.block
        if b is None:
            return
        if self.observer is not None:
            self.observer.on_free(s, b)
        s.block = None
        b.storage = None
        self.used -= b.size
        holes, hole_at, shift = self._holes, self._hole_at, self._shift
        prev, nxt = b.prev, b.next
        if prev is not None and prev.storage is None:  # b joins the hole before it
            key = prev.size << shift | prev.addr
            del holes[bisect_left(holes, key)]
            del hole_at[key]
            prev.size += b.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            b = prev
        if nxt is not None and nxt.storage is None:  # and the hole after it joins b
            key = nxt.size << shift | nxt.addr
            del holes[bisect_left(holes, key)]
            del hole_at[key]
            b.size += nxt.size
            b.next = nn = nxt.next
            if nn is not None:
                nn.prev = b
        key = b.size << shift | b.addr
        insort(holes, key)
        hole_at[key] = b
        self._mark_beside(b)

    def relocate(self, moves: list[tuple[Storage, Block]],
                 copy: Callable[[Storage], None], low: bool = False) -> None:
        """(``low``: each carved from the low end of its hole instead.)"""
        old = []
        for s, hole in moves:
            old.append(s.block)
            self._place(hole, s, low)  # the hole keeps its block (unless used up)
        for s, _ in moves:
            copy(s)
        for (s, _), was in zip(moves, old, strict=True):
            new, s.block = s.block, was
            self.free(s)  # frees b, counted out of ``used`` as ``_place`` counted the new one
            s.block = new

    def slide(self, storages: list[Storage], copy: Callable[[Storage], None]) -> None:
        for s in storages:
            b = s.block
            hole = None if b is None else b.prev
            if hole is None or hole.storage is not None:
                continue
            self.free(s)  # b merges into the hole before it, which keeps its block
            self._place(hole, s, low=True)
            copy(s)

    def compact(self, need: int, copy: Callable[[Storage], None]) -> None:
        movers = [b.storage for b in self.layout()
                  if b.storage is not None and b.storage.movable]
        holes, hole_at, shift = self._holes, self._hole_at, self._shift
        addr_of = ((1 << shift) - 1).__and__  # a key's low bits are the address
        for s in movers:
            if self.largest_free_block() >= need:
                return
            b = s.block
            assert b is not None
            n = s.nbytes
            below = [k for k in islice(holes, bisect_left(holes, n << shift), None)
                     if addr_of(k) < b.addr]
            if below:  # a lower free block holds it: carve it there, then free the old one
                self._place(hole_at[min(below, key=addr_of)], s, low=True)
                copy(s)
                new, s.block = s.block, b
                self.free(s)
                s.block = new
            elif b.prev is not None and b.prev.storage is None and self.free_bytes >= n:
                self.slide([s], copy)

    def layout(self, request: Storage | None = None) -> list[Block]:
        out = []
        b: Block | None = self.head if self.capacity else None
        while b is not None:
            out.append(b)
            b = b.next
        return out

    def largest_free_block(self) -> int:
        return self._holes[-1] >> self._shift if self._holes else 0

    # ------------------------------------------------------------------ checking
    def check(self) -> None:
        """Assert the pool's invariants (used by tests): blocks tile [0, capacity) in address
        order, no two free blocks touch, the hole index matches, ``used`` is right, and the
        candidate pool's free-neighbour rows are current or marked."""
        check_tiling(self.layout(), 0, int(self.capacity))
        holes = [b.size << self._shift | b.addr for b in self.layout() if b.storage is None]
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
