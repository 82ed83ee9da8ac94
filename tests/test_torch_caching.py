"""The ``torch-caching`` allocator: one hand-computed example per rule of PyTorch's caching
allocator, then random allocate/free sequences checked against the invariants."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from membudget.core.allocators.block import Block
from membudget.core.allocators.torch_caching import TorchCachingAllocator, allocation_size
from membudget.core.pool import CandidatePool
from membudget.core.records import Storage

KiB = 1 << 10
MiB = 1 << 20


class Recorder:
    """An observer that logs every event and tracks the live segments on its own."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.segments: dict[int, int] = {}  # addr -> size

    def on_alloc(self, s: Storage, block: Block) -> None:
        self.events.append(("alloc", s.id, block.addr, block.size))

    def on_free(self, s: Storage, block: Block) -> None:
        self.events.append(("free", s.id, block.addr, block.size))

    def on_segment(self, action: str, addr: int, size: int) -> None:
        self.events.append((action, addr, size))
        if action == "segment_alloc":
            assert addr not in self.segments
            self.segments[addr] = size
        else:
            assert self.segments.pop(addr) == size

    def segment_events(self) -> list[tuple]:
        return [e for e in self.events if e[0].startswith("segment")]


def make(capacity: float = 1 << 40) -> tuple[TorchCachingAllocator, Recorder]:
    a = TorchCachingAllocator(capacity)
    rec = Recorder()
    a.observer = rec
    return a, rec


_ids = iter(range(1 << 62))


def alloc(a: TorchCachingAllocator, nbytes: int) -> Storage:
    """Allocate a new storage of ``nbytes``, asserting that it fits."""
    s = Storage(next(_ids), nbytes)
    assert a.allocate(s)
    a.check()
    return s


def release(a: TorchCachingAllocator, s: Storage) -> None:
    a.free(s)
    a.check()


def shape(a: TorchCachingAllocator) -> list[tuple[int, int, int | None, int]]:
    """The layout as (addr, size, storage id or None, segment) tuples."""
    return [(b.addr, b.size, None if b.storage is None else b.storage.id, b.segment)
            for b in a.layout()]


# ---------------------------------------------------------------------- rounding
def test_rounding_to_512_bytes():
    a, _ = make()
    assert a.block_bytes(1) == 512
    assert a.block_bytes(512) == 512
    assert a.block_bytes(513) == 1024
    assert a.block_bytes(1 * MiB + 1) == 1 * MiB + 512
    s = alloc(a, 1)
    t = alloc(a, 513)
    assert (s.block.size, t.block.size) == (512, 1024)
    assert a.used == 1536
    assert a.requested == 514


def test_zero_byte_storage_gets_no_block():
    a, rec = make()
    s = alloc(a, 0)
    assert s.block is None
    assert (a.used, a.reserved, a.requested) == (0, 0, 0)
    release(a, s)
    assert rec.events == []


# ---------------------------------------------------------------------- segment sizes
def test_small_request_gets_a_2mib_segment_split():
    a, rec = make()
    s = alloc(a, 1000)
    assert rec.segment_events() == [("segment_alloc", 0, 2 * MiB)]
    assert shape(a) == [(0, 1024, s.id, 0), (1024, 2 * MiB - 1024, None, 0)]
    assert (a.used, a.reserved, a.requested) == (1024, 2 * MiB, 1000)
    assert s.free_adj == 2 * MiB - 1024


def test_medium_request_gets_a_20mib_segment():
    a, rec = make()
    s = alloc(a, 1 * MiB + 1)  # rounds to 1 MiB + 512: large pool
    t = alloc(a, 9 * MiB)  # best fit in the 19 MiB - 512 left, split (remainder > 1 MiB)
    assert rec.segment_events() == [("segment_alloc", 0, 20 * MiB)]
    assert shape(a) == [(0, MiB + 512, s.id, 0), (MiB + 512, 9 * MiB, t.id, 0),
                        (10 * MiB + 512, 10 * MiB - 512, None, 0)]
    u = alloc(a, 9 * MiB + 512)  # 10 MiB - 512 left: exact fit, no new segment
    assert u.block.addr == 10 * MiB + 512
    assert a.reserved == 20 * MiB == a.used


def test_large_request_gets_its_own_segment_rounded_to_2mib():
    a, rec = make()
    s = alloc(a, 11 * MiB)  # 12 MiB segment; the 1 MiB remainder is not split off
    assert rec.segment_events() == [("segment_alloc", 0, 12 * MiB)]
    assert shape(a) == [(0, 12 * MiB, s.id, 0)]
    assert (a.used, a.requested, a.reserved) == (12 * MiB, 11 * MiB, 12 * MiB)
    t = alloc(a, 10 * MiB)  # exactly kMinLargeAlloc: its own 10 MiB segment, not 20 MiB
    assert rec.segment_events()[1] == ("segment_alloc", 12 * MiB, 10 * MiB)
    assert t.block.size == 10 * MiB
    assert a.reserved == 22 * MiB


# ---------------------------------------------------------------------- splitting
def test_large_pool_remainder_of_1mib_is_not_split():
    a, _ = make()
    s = alloc(a, 5 * MiB)  # 20 MiB segment: 15 MiB left
    t = alloc(a, 14 * MiB)  # remainder exactly 1 MiB: t gets all 15 MiB
    assert shape(a) == [(0, 5 * MiB, s.id, 0), (5 * MiB, 15 * MiB, t.id, 0)]
    assert a.used == 20 * MiB
    assert a.requested == 19 * MiB
    assert a.free_bytes == a.capacity - 20 * MiB


def test_large_pool_remainder_over_1mib_is_split():
    a, _ = make()
    s = alloc(a, 5 * MiB)
    t = alloc(a, 13 * MiB + 512 * KiB)  # remainder 1.5 MiB: split off
    assert shape(a) == [(0, 5 * MiB, s.id, 0), (5 * MiB, 13 * MiB + 512 * KiB, t.id, 0),
                        (18 * MiB + 512 * KiB, MiB + 512 * KiB, None, 0)]
    assert a.used == 18 * MiB + 512 * KiB
    assert t.free_adj == MiB + 512 * KiB


def test_small_pool_remainder_of_512_is_split():
    a, rec = make()
    s = alloc(a, 1 * MiB)  # 2 MiB segment, 1 MiB left
    t = alloc(a, 1 * MiB - 512)  # remainder 512 B: split off
    assert shape(a) == [(0, MiB, s.id, 0), (MiB, MiB - 512, t.id, 0),
                        (2 * MiB - 512, 512, None, 0)]
    u = alloc(a, 100)  # takes the 512-byte block exactly
    assert u.block.addr == 2 * MiB - 512
    assert len(rec.segment_events()) == 1
    assert a.used == a.reserved == 2 * MiB


# ---------------------------------------------------------------------- best fit
def test_best_fit_smallest_block_then_lowest_address():
    a, rec = make()
    blocks = [alloc(a, n * MiB) for n in (2, 2, 3, 2, 3, 2)]  # ends at 14 MiB of 20
    release(a, blocks[2])  # 3 MiB hole at 4 MiB
    release(a, blocks[4])  # 3 MiB hole at 9 MiB
    holes = [(addr, size) for addr, size, sid, _ in shape(a) if sid is None]
    assert holes == [(4 * MiB, 3 * MiB), (9 * MiB, 3 * MiB), (14 * MiB, 6 * MiB)]
    s = alloc(a, 2 * MiB + 512 * KiB)  # smallest fit: a 3 MiB hole, the lower one
    assert (s.block.addr, s.block.size) == (4 * MiB, 3 * MiB)  # 0.5 MiB remainder kept
    t = alloc(a, 3 * MiB)  # the other 3 MiB hole, not the 6 MiB one
    assert t.block.addr == 9 * MiB
    u = alloc(a, 4 * MiB)  # the 6 MiB hole, split
    assert (u.block.addr, u.block.size) == (14 * MiB, 4 * MiB)
    assert len(rec.segment_events()) == 1


def test_best_fit_in_the_small_pool():
    a, _ = make()
    s = [alloc(a, 256 * KiB) for _ in range(8)]  # fills one 2 MiB segment
    release(a, s[1])
    release(a, s[5])
    release(a, s[6])  # holes: 256 KiB at 256 KiB, 512 KiB at 1.25 MiB
    t = alloc(a, 200 * KiB)
    assert t.block.addr == 256 * KiB
    u = alloc(a, 300 * KiB)
    assert u.block.addr == 1280 * KiB


# ---------------------------------------------------------------------- freeing
def test_free_merges_with_both_neighbours_in_the_segment():
    a, _ = make()
    x, y, z = (alloc(a, 2 * MiB) for _ in range(3))  # 14 MiB left
    release(a, x)
    release(a, z)  # merges with the free tail
    assert shape(a) == [(0, 2 * MiB, None, 0), (2 * MiB, 2 * MiB, y.id, 0),
                        (4 * MiB, 16 * MiB, None, 0)]
    assert y.free_adj == 18 * MiB
    release(a, y)  # merges both ways: one free block, the whole segment
    assert shape(a) == [(0, 20 * MiB, None, 0)]
    assert a.used == 0
    assert a.reserved == 20 * MiB  # cached, not returned to the device


def test_free_never_merges_across_segments():
    a, rec = make()
    x = alloc(a, 12 * MiB)
    y = alloc(a, 12 * MiB)  # the next segment, right after x's in address space
    assert [b.segment for b in a.layout()] == [0, 1]
    release(a, x)
    release(a, y)
    assert shape(a) == [(0, 12 * MiB, None, 0), (12 * MiB, 12 * MiB, None, 1)]
    assert all(b.prev is None and b.next is None for b in a.layout())
    z = alloc(a, 20 * MiB)  # no free block holds it: a third segment
    assert z.block.segment == 2
    assert rec.segment_events()[-1] == ("segment_alloc", 24 * MiB, 20 * MiB)


def test_small_and_large_pools_never_share_blocks():
    a, rec = make()
    big = alloc(a, MiB + 512)  # large: 20 MiB segment with 19 MiB - 512 free
    small = alloc(a, 512)  # small: a 2 MiB segment of its own
    assert (big.block.segment, small.block.segment) == (0, 1)
    assert rec.segment_events() == [("segment_alloc", 0, 20 * MiB),
                                    ("segment_alloc", 20 * MiB, 2 * MiB)]
    mid = alloc(a, MiB + 1)  # large again: fits the 20 MiB segment, not the small one
    assert mid.block.segment == 0
    assert {b.segment for b in a.layout(Storage(-1, 100))} == {1}
    assert {b.segment for b in a.layout(Storage(-1, 2 * MiB))} == {0}


def test_transfer_hands_the_block_over():
    a, rec = make()
    old = alloc(a, 3000)
    new = Storage(next(_ids), 3000)
    block = old.block
    a.transfer(old, new)
    a.check()
    assert (old.block, new.block, block.storage) == (None, block, new)
    assert new.free_adj == 2 * MiB - 3072
    assert rec.events[-2:] == [("free", old.id, 0, 3072), ("alloc", new.id, 0, 3072)]


def test_free_adj_reaches_the_candidate_pool():
    a, _ = make()
    a.pool = CandidatePool(track_free_adj=True)
    s = Storage(next(_ids), 512)
    a.pool.add(Storage(next(_ids), 8))
    a.pool.add(s)  # slot 1
    assert a.allocate(s)
    a.pool.sync()
    assert list(a.pool.free_adj[:2]) == [0, 2 * MiB - 512]
    t = alloc(a, 512)
    a.pool.sync()
    assert a.pool.free_adj[1] == 0  # t took the bytes right after s
    release(a, t)
    a.pool.sync()
    assert a.pool.free_adj[1] == 2 * MiB - 512


def test_free_adj_of_the_block_after_a_split_hole_shrinks():
    a, _ = make()
    x = alloc(a, 6 * MiB)  # 20 MiB segment: 14 MiB left
    y = alloc(a, 14 * MiB)  # exact fit: the segment is full
    release(a, x)
    assert y.free_adj == 6 * MiB
    alloc(a, 2 * MiB)  # low 2 MiB of x's hole; 4 MiB stay free, right before y
    assert y.free_adj == 4 * MiB


# ---------------------------------------------------------------------- out of memory
def test_cached_segments_are_released_and_the_allocation_retried():
    a, rec = make(capacity=36 * MiB)
    busy = alloc(a, 19 * MiB)  # a 20 MiB segment, all of it allocated (1 MiB not split)
    x = alloc(a, 10 * MiB)  # a 10 MiB segment
    t = alloc(a, 512)  # a 2 MiB small segment
    release(a, x)
    release(a, t)  # both fully free but cached
    assert a.reserved == 32 * MiB
    y = alloc(a, 11 * MiB)  # needs 12 MiB: 32 + 12 > 36, so release the cache and retry
    assert rec.segment_events() == [("segment_alloc", 0, 20 * MiB),
                                    ("segment_alloc", 20 * MiB, 10 * MiB),
                                    ("segment_alloc", 30 * MiB, 2 * MiB),
                                    ("segment_free", 20 * MiB, 10 * MiB),
                                    ("segment_free", 30 * MiB, 2 * MiB),
                                    ("segment_alloc", 32 * MiB, 12 * MiB)]
    assert shape(a) == [(0, 20 * MiB, busy.id, 0), (32 * MiB, 12 * MiB, y.id, 3)]
    assert a.reserved == a.peak_reserved == 32 * MiB


def test_allocation_fails_when_releasing_cannot_help():
    a, rec = make(capacity=24 * MiB)
    x = alloc(a, 5 * MiB)  # 20 MiB segment
    y = alloc(a, 512)  # 2 MiB small segment
    release(a, y)  # fully free, cached
    before = shape(a)
    s = Storage(next(_ids), 16 * MiB)  # 15 MiB free in x's segment is not enough
    assert not a.allocate(s)  # 16 MiB segment: 20 + 16 > 24 even after releasing
    a.check()
    assert s.block is None
    assert rec.segment_events()[-1] == ("segment_free", 20 * MiB, 2 * MiB)  # the only change
    assert shape(a) == before[:2]
    assert (a.used, a.requested, a.reserved) == (5 * MiB, 5 * MiB, 20 * MiB)
    assert x.block.size == 5 * MiB
    assert a.peak_reserved == 22 * MiB


def test_capacity_is_never_exceeded_by_a_segment():
    a, rec = make(capacity=21 * MiB)
    alloc(a, 5 * MiB)  # 20 MiB segment
    assert not a.allocate(Storage(next(_ids), 100))  # a 2 MiB segment would need 22 MiB
    assert a.reserved == 20 * MiB
    assert len(rec.segment_events()) == 1


def test_unbounded_device():
    a, _ = make(capacity=math.inf)
    s = alloc(a, 100 * MiB)
    assert a.reserved == 100 * MiB
    assert a.free_bytes == math.inf
    release(a, s)


def test_negative_capacity_is_rejected():
    with pytest.raises(ValueError):
        TorchCachingAllocator(-1)


# ---------------------------------------------------------------------- properties
SIZES = st.one_of(  # every size class, around each boundary of the rules
    st.integers(0, 4 * KiB),
    st.integers(1, MiB + 1024),
    st.integers(MiB, 12 * MiB),
    st.integers(10 * MiB, 40 * MiB),
)
OPS = st.lists(st.tuples(st.booleans(), SIZES, st.integers(0, 1 << 16)), max_size=80)


@settings(max_examples=300)
@given(capacity=st.integers(4 * MiB, 160 * MiB), ops=OPS)
def test_random_sequences_keep_the_invariants(capacity: int, ops: list) -> None:
    a, rec = make(capacity)
    live: list[Storage] = []
    for do_alloc, nbytes, pick in ops:
        if do_alloc or not live:
            s = Storage(next(_ids), nbytes)
            held = [(t, t.block) for t in live]
            used, requested = a.used, a.requested
            if a.allocate(s):
                if nbytes:
                    live.append(s)
                    assert a.block_bytes(nbytes) <= s.block.size
            else:
                # nothing changed but the released segments; and it really did not fit
                assert s.block is None
                assert all(t.block is b for t, b in held)
                assert (a.used, a.requested) == (used, requested)
                need = a.block_bytes(nbytes)
                assert all(b.storage is not None or b.size < need
                           for b in a.layout(s))
                assert a.reserved + allocation_size(need) > capacity
                # every cached, fully free segment was released
                assert all(any(b.storage is not None for b in a.layout() if b.segment == g)
                           for g in {b.segment for b in a.layout()})
        else:
            a.free(live.pop(pick % len(live)))
        a.check()
        assert a.reserved == sum(rec.segments.values()) <= capacity
        spans = sorted((b.addr, b.addr + b.size, b.segment) for b in a.layout())
        assert all(x[1] <= y[0] for x, y in pairwise(spans))
        starts = sorted(rec.segments)
        for b in a.layout():  # every block lies inside a live segment
            seg = max(x for x in starts if x <= b.addr)
            assert b.addr + b.size <= seg + rec.segments[seg]
        for s in live:
            b = s.block
            adj = sum(x.size for x in (b.prev, b.next) if x is not None and x.storage is None)
            assert s.free_adj == adj
        assert a.used == sum(s.block.size for s in live)
        assert a.requested == sum(s.nbytes for s in live)
