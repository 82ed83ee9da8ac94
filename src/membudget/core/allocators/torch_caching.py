"""``torch-caching``: a model of PyTorch's CUDA caching allocator in its default configuration.

The device's ``capacity`` bytes are reserved in *segments* (one cudaMalloc each) that are never
merged and are only returned to the device when an allocation would otherwise fail. Storages
get blocks carved from a segment's free blocks: sizes are rounded to 512 B, requests of up to
1 MiB use the small pool (2 MiB segments) and larger ones the large pool (20 MiB segments for
requests under 10 MiB, else a segment of the request rounded up to 2 MiB). The best fit
(smallest free block, lowest address among equals) is split unless the remainder is too small
to be worth keeping, so a block can hold more bytes than its storage asked for.

Modelled after c10/cuda/CUDACachingAllocator.cpp (``malloc``, ``get_free_block``,
``should_split``, ``get_allocation_size``, ``free_block``, ``release_cached_blocks``) with no
``max_split_size``, no expandable segments, no ``roundup_power2_divisions``, no garbage
collection threshold and a single stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from sortedcontainers import SortedList

from membudget.core.allocators.base import LayoutAllocator
from membudget.core.allocators.best_fit import check_tiling
from membudget.core.allocators.block import Block, link_after, unlink
from membudget.core.records import Storage

MIN_BLOCK_SIZE = 512  # kMinBlockSize: every block size is a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: size of a small-pool segment
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: requests below this share a 20 MiB segment
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests get their own segment, rounded to this
LARGE_BUFFER = 20 << 20  # kLargeBuffer: size of a shared large-pool segment


def round_size(nbytes: int) -> int:
    """Block size of a request: ``nbytes`` rounded up to a multiple of 512 (0 stays 0)."""
    return (nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE * MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """Bytes of the segment reserved for a block of ``size`` bytes that no free block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


class _Pool:
    """The small or the large pool: its free blocks, best fit by (size, address)."""

    __slots__ = ("free", "idle", "small")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free = SortedList()  # (size, addr) of every free block of the pool's segments
        self.idle: dict[int, Block] = {}  # addr -> free block spanning a whole segment


class _Segment:
    """One reservation from the device: ``size`` bytes at ``addr``, tiled by blocks from
    ``head``. The block at the segment's start is never replaced (splits keep the low part,
    merges keep the lower block), so ``head`` stays valid for the segment's whole life."""

    __slots__ = ("addr", "head", "pool", "size")

    def __init__(self, addr: int, size: int, pool: _Pool, head: Block) -> None:
        self.addr = addr
        self.size = size
        self.pool = pool
        self.head = head


class TorchCachingAllocator(LayoutAllocator):
    """PyTorch's caching allocator on a device of ``capacity`` bytes (``inf``: unbounded).

    ``used`` counts allocated block bytes (rounded sizes, unsplit remainders included, like
    ``allocated_bytes``), ``requested`` the storages' own bytes (``requested_bytes``) and
    ``reserved`` the segments' bytes (``reserved_bytes``); ``reserved <= capacity`` always.

    Segments get fresh, never reused addresses from a bump pointer, so no two segments ever
    overlap and segment ids (and the dict of segments) are in address order.
    """

    name = "torch-caching"

    def __init__(self, capacity: float) -> None:
        super().__init__(capacity)
        if math.isfinite(capacity):
            self.capacity = int(capacity)
        self.reserved = 0
        self.peak_reserved = 0
        self.requested = 0
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._segments: dict[int, _Segment] = {}  # segment id -> segment, in address order
        self._free_at: dict[int, Block] = {}  # addr -> free block (both pools)
        self._next_segment = 0
        self._next_addr = 0

    # ------------------------------------------------------------------ interface
    def allocate(self, s: Storage) -> bool:
        """Best fit in the storage's pool, else a new segment, else (after releasing every fully
        free cached segment, as PyTorch does before raising an OOM) a new segment; False when
        even that does not fit. A failed call leaves the released segments released."""
        n = s.nbytes
        if n == 0:
            return True
        size = (n + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE * MIN_BLOCK_SIZE  # round_size, inlined
        pool = self._small if size <= SMALL_SIZE else self._large
        free = pool.free
        i = free.bisect_left((size, -1))
        if i < len(free):
            block = self._free_at[free[i][1]]
        else:
            seg_size = allocation_size(size)
            if self.reserved + seg_size > self.capacity:
                self._release_cached()
                if self.reserved + seg_size > self.capacity:
                    return False
            block = self._new_segment(seg_size, pool)
        self._carve(block, s, size, pool)
        return True

    def free(self, s: Storage) -> None:
        """Return the block to its pool, merged with free neighbours of the same segment."""
        if s.block is not None:
            self.requested -= s.nbytes
        b = self._release(s)
        if b is not None:
            self._add_free(b, self._segments[b.segment].pool)
            self._mark_beside(b)

    def _release(self, s: Storage) -> Block | None:
        """Free the block of ``s`` and merge it with free neighbours (same segment only:
        ``prev``/``next`` never cross one); return the merged free block, to be indexed."""
        b = s.block
        if b is None:
            return None
        if self.observer is not None:
            self.observer.on_free(s, b)
        s.block = None
        b.storage = None
        self.used -= b.size
        prev, nxt = b.prev, b.next
        if prev is not None and prev.storage is None:
            self._remove_free(prev, self._segments[prev.segment].pool)
            prev.size += b.size
            unlink(b)
            b = prev
        if nxt is not None and nxt.storage is None:
            self._remove_free(nxt, self._segments[nxt.segment].pool)
            b.size += nxt.size
            unlink(nxt)
        return b

    def transfer(self, old: Storage, new: Storage) -> None:
        if old.block is not None:
            self.requested += new.nbytes - old.nbytes
        super().transfer(old, new)

    @property
    def free_bytes(self) -> float:
        """Bytes not allocated to any storage: cached free blocks plus never reserved bytes."""
        return self.capacity - self.used

    def largest_free_block(self) -> float:
        """The largest block this allocator could hand out now: the biggest cached free
        block, or the largest request whose new segment fits in the unreserved bytes plus
        the fully free cached segments (released before an out-of-memory)."""
        cached = max((p.free[-1][0] for p in (self._small, self._large) if p.free), default=0)
        avail = self.capacity - self.reserved + sum(
            b.size for p in (self._small, self._large) for b in p.idle.values())
        if avail >= MIN_LARGE_ALLOC:  # one segment of the request rounded to 2 MiB
            fresh = avail // ROUND_LARGE * ROUND_LARGE
        elif avail >= SMALL_BUFFER:
            fresh = SMALL_SIZE
        else:
            fresh = 0
        return max(cached, fresh)

    def block_bytes(self, nbytes: int) -> int:
        """The rounded block size (a multiple of 512 B); 0 for a storage that needs no block."""
        return round_size(nbytes)

    def layout(self, request: Storage | None = None) -> list[Block]:
        """Every block of every segment in address order; with ``request``, only the blocks
        of the pool (small or large) that the request would be served from."""
        segments: Iterable[_Segment] = self._segments.values()
        if request is not None:
            pool = self._small if round_size(request.nbytes) <= SMALL_SIZE else self._large
            segments = [g for g in segments if g.pool is pool]
        out = []
        for g in segments:
            b: Block | None = g.head
            while b is not None:
                out.append(b)
                b = b.next
        return out

    def segment_deficit(self, nbytes: int) -> int:
        room = self.capacity - self.reserved + sum(
            b.size for p in (self._small, self._large) for b in p.idle.values())
        return max(0, allocation_size(round_size(nbytes)) - int(room))

    def left_after(self, hole: Block, left: int, size: int) -> int:
        rest = left - size
        small = self._segments[hole.segment].pool.small
        return rest if ((rest >= MIN_BLOCK_SIZE) if small else (rest > SMALL_SIZE)) else 0

    def relocate(self, moves: list[tuple[Storage, Block]],
                 copy: Callable[[Storage], None]) -> None:
        """Carve each storage's rounded size from the high end of its hole (the whole hole
        when the rest would not be split off, as ``_carve`` decides), then free the old
        blocks: a moved block loses an unsplit remainder it had."""
        old = []
        for s, hole in moves:
            old.append(s.block)
            pool = self._segments[hole.segment].pool
            size = round_size(s.nbytes)
            self._remove_free(hole, pool)
            if self.left_after(hole, hole.size, size):
                b = Block(hole.addr + hole.size - size, size, s, hole.segment)
                link_after(b, hole)
                hole.size -= size
                self._add_free(hole, pool)
            else:
                b = hole
                b.storage = s
            s.block = b
            self.used += b.size  # both copies are held while the data moves
            if self.used > self.peak:
                self.peak = self.used
            self._mark_beside(b)
            if self.observer is not None:
                self.observer.on_alloc(s, b)
        for s, _ in moves:
            copy(s)
        for (s, _), was in zip(moves, old, strict=True):
            new, s.block = s.block, was
            self.free(s)  # frees b and counts ``s.nbytes`` out of ``requested``
            self.requested += s.nbytes
            s.block = new

    def slide(self, storages: list[Storage], copy: Callable[[Storage], None]) -> None:
        """As the best-fit pool does; ``_carve`` keeps the rest of the merged block free
        where it would split it (so a large-pool rest of 1 MiB or less stays with the
        storage, as it would for a new allocation)."""
        for s in storages:
            b = s.block
            hole = None if b is None else b.prev
            if hole is None or hole.storage is not None:
                continue
            self.free(s)  # b merges into the hole before it (same segment), which keeps it
            self._carve(hole, s, round_size(s.nbytes), self._segments[hole.segment].pool)
            copy(s)

    # ------------------------------------------------------------------ segments and blocks
    def _new_segment(self, size: int, pool: _Pool) -> Block:
        """Reserve a segment of ``size`` bytes (the caller checked it fits); return its only,
        free block (already in ``pool``)."""
        sid = self._next_segment
        self._next_segment += 1
        addr = self._next_addr
        self._next_addr += size
        head = Block(addr, size, None, sid)
        self._segments[sid] = _Segment(addr, size, pool, head)
        self.reserved += size
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        self._add_free(head, pool)
        if self.observer is not None:
            self.observer.on_segment("segment_alloc", addr, size)
        return head

    def _release_cached(self) -> None:
        """Return every fully free segment of both pools to the device (``release_cached_blocks``:
        large pool first, each pool in (size, address) order)."""
        for pool in (self._large, self._small):
            if not pool.idle:
                continue
            for b in sorted(pool.idle.values(), key=_size_addr):
                pool.free.remove((b.size, b.addr))
                del self._free_at[b.addr]
                del self._segments[b.segment]
                self.reserved -= b.size
                if self.observer is not None:
                    self.observer.on_segment("segment_free", b.addr, b.size)
            pool.idle.clear()

    def _carve(self, block: Block, s: Storage, size: int, pool: _Pool) -> None:
        """Give ``s`` the low ``size`` bytes of free ``block``, splitting off the rest as a free
        block when it is big enough (small pool: any remainder; large pool: over 1 MiB)."""
        self._remove_free(block, pool)
        rest = block.size - size
        if (rest >= MIN_BLOCK_SIZE) if pool.small else (rest > SMALL_SIZE):
            tail = Block(block.addr + size, rest, None, block.segment)
            link_after(tail, block)
            block.size = size
            self._add_free(tail, pool)
            self._mark_beside(tail)  # the block after it: its free neighbour shrank
        block.storage = s
        s.block = block
        self.used += block.size
        if self.used > self.peak:
            self.peak = self.used
        self.requested += s.nbytes
        self._mark_beside(block)
        if self.observer is not None:
            self.observer.on_alloc(s, block)

    def _add_free(self, b: Block, pool: _Pool) -> None:
        pool.free.add((b.size, b.addr))
        self._free_at[b.addr] = b
        if b.prev is None and b.next is None:
            pool.idle[b.addr] = b

    def _remove_free(self, b: Block, pool: _Pool) -> None:
        pool.free.remove((b.size, b.addr))
        del self._free_at[b.addr]
        if b.prev is None and b.next is None:
            del pool.idle[b.addr]

    # ------------------------------------------------------------------ checking
    def check(self) -> None:
        """Assert the invariants (used by tests): each segment is tiled by its own blocks,
        segments do not overlap, coalescing is complete, the free-block indexes match, every
        storage sits in its pool in a block big enough for it, the byte counters are right
        and the candidate pool's free-neighbour rows are current or marked."""
        used = requested = reserved = 0
        end = 0
        free_of: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # by pool.small
        free_at: dict[int, Block] = {}
        idle_of: dict[bool, dict[int, Block]] = {True: {}, False: {}}
        for sid, g in self._segments.items():
            assert g.addr >= end, f"segment {sid} overlaps the one before it"
            end = g.addr + g.size
            reserved += g.size
            blocks = []
            b: Block | None = g.head
            while b is not None:
                blocks.append(b)
                b = b.next
            check_tiling(blocks, g.addr, end)
            for b in blocks:
                assert b.segment == sid, f"{b} is linked into segment {sid}"
                if b.storage is None:
                    free_of[g.pool.small].append((b.size, b.addr))
                    free_at[b.addr] = b
                else:
                    n = b.storage.nbytes
                    assert b.size >= round_size(n), f"{b} too small for {b.storage}"
                    assert (round_size(n) <= SMALL_SIZE) == g.pool.small, f"{b} wrong pool"
                    used += b.size
                    requested += n
            if len(blocks) == 1 and blocks[0].storage is None:
                idle_of[g.pool.small][g.addr] = blocks[0]
        for pool in (self._small, self._large):
            assert sorted(free_of[pool.small]) == list(pool.free), "free-block index out of date"
            assert idle_of[pool.small] == pool.idle, "idle-segment index out of date"
        assert free_at == self._free_at, "free-block address index out of date"
        assert used == self.used, f"used {self.used}, blocks hold {used}"
        assert requested == self.requested, f"requested {self.requested}, storages {requested}"
        assert reserved == self.reserved, f"reserved {self.reserved}, segments {reserved}"
        assert self.reserved <= self.capacity, "reserved more than the device has"
        assert self.used <= self.peak and self.reserved <= self.peak_reserved
        self._check_rows()


def _size_addr(b: Block) -> tuple[int, int]:
    return b.size, b.addr
