"""The address-ordered pools: best-fit and two-sided, by hand and by property."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from membudget.core.allocators import (
    BestFitAllocator,
    PhaseSidedAllocator,
    SizeSidedAllocator,
    TwoSidedAllocator,
    make_allocator,
)
from membudget.core.records import Storage


def store(sid: int, nbytes: int, cost: float = 0.0, pinned: bool = False) -> Storage:
    s = Storage(sid, nbytes)
    s.cost = cost
    s.pinned = pinned
    return s


def shape(alloc) -> list[tuple[int, int, int | None]]:
    return [(b.addr, b.size, None if b.storage is None else b.storage.id)
            for b in alloc.layout()]


def test_best_fit_takes_the_smallest_hole_that_fits_and_the_lowest_among_equals():
    a = BestFitAllocator(100)
    xs = [store(i, n) for i, n in enumerate([10, 20, 10, 30, 10, 20])]
    for s in xs:
        assert a.allocate(s)
    assert a.free_bytes == 0
    for i in (1, 3, 5):  # holes of 20 @10, 30 @40, 20 @80
        a.free(xs[i])
    a.check()
    assert [(b.addr, b.size) for b in a.layout() if b.storage is None] == [
        (10, 20), (40, 30), (80, 20)]
    y = store(10, 15)
    assert a.allocate(y)
    assert y.block.addr == 10  # 20-byte holes beat the 30-byte one; lowest address wins
    z = store(11, 25)
    assert a.allocate(z)
    assert z.block.addr == 40
    assert a.used == 10 + 10 + 10 + 15 + 25


def test_allocation_fails_when_no_single_hole_fits_even_if_the_total_would():
    a = BestFitAllocator(100)
    xs = [store(i, 25) for i in range(4)]
    for s in xs:
        assert a.allocate(s)
    a.free(xs[0])
    a.free(xs[2])
    assert a.free_bytes == 50
    assert a.largest_free_block() == 25
    big = store(9, 30)
    assert not a.allocate(big)
    assert big.block is None and a.used == 50  # nothing changed
    a.check()


def test_free_coalesces_with_both_neighbours():
    a = BestFitAllocator(90)
    xs = [store(i, 30) for i in range(3)]
    for s in xs:
        a.allocate(s)
    a.free(xs[0])
    a.free(xs[2])
    a.free(xs[1])  # merges left and right: one hole again
    assert shape(a) == [(0, 90, None)]
    a.check()


def test_free_neighbours_are_tracked_for_the_policies():
    a = BestFitAllocator(100)
    x, y, z = store(1, 60), store(2, 20), store(3, 10)
    for s in (x, y, z):
        a.allocate(s)
    assert (x.free_adj, y.free_adj, z.free_adj) == (0, 0, 10)
    a.free(x)
    assert y.free_adj == 60
    w = store(4, 10)
    a.allocate(w)  # the 10-byte tail hole is the best fit
    assert z.free_adj == 0 and y.free_adj == 60
    v = store(5, 50)
    a.allocate(v)  # carves the low end of the 60-byte hole; y now sees 10 bytes
    assert y.free_adj == 10
    a.check()


def test_two_sided_puts_expensive_outputs_low_cheap_ones_high_and_pinned_at_the_top():
    a = TwoSidedAllocator(1000, threshold=1.0)
    param = store(1, 100, pinned=True)
    conv = store(2, 100, cost=500)  # 5 cost units per byte: expensive
    relu = store(3, 100, cost=10)  # 0.1 per byte: cheap
    conv2 = store(4, 100, cost=400)
    relu2 = store(5, 100, cost=5)
    for s in (param, conv, relu, conv2, relu2):
        assert a.allocate(s)
    assert param.block.addr == 900
    assert (conv.block.addr, conv2.block.addr) == (0, 100)
    assert (relu.block.addr, relu2.block.addr) == (800, 700)
    a.check()


def test_two_sided_default_threshold_is_the_running_geometric_mean_of_densities():
    a = TwoSidedAllocator(1000)
    first = store(1, 10, cost=10)  # density 1: the first is cheap (no mean yet)
    hi = store(2, 10, cost=1000)  # 100 > 1: expensive
    lo = store(3, 10, cost=20)  # 2 < mean(log 1, log 100) = 10: cheap
    for s in (first, hi, lo):
        a.allocate(s)
    assert first.block.addr == 990 and hi.block.addr == 0 and lo.block.addr == 980


def test_size_sided_puts_large_storages_low_small_ones_high_and_pinned_at_the_top():
    a = SizeSidedAllocator(1000)
    param = store(1, 100, pinned=True)
    first = store(2, 10, cost=1e6)  # no mean yet: small, whatever its cost
    big = store(3, 200)  # 200 > 10: large
    small = store(4, 20)  # 20 < geometric mean of 10 and 200 (~44.7): small
    big2 = store(5, 100)  # 100 > mean of 10, 200, 20 (~34.2): large
    for s in (param, first, big, small, big2):
        assert a.allocate(s)
    assert param.block.addr == 900
    assert (big.block.addr, big2.block.addr) == (0, 200)
    assert (first.block.addr, small.block.addr) == (890, 870)
    a.check()


def test_phase_sided_packs_what_backward_makes_from_the_top_beside_the_pinned_state():
    def run(a):
        storages = store(1, 100, pinned=True), store(2, 200), store(3, 50), store(4, 100)
        storages[2].kind = "gradient"  # made in backward
        for s in storages:
            assert a.allocate(s)
        a.free(storages[2])
        return a, storages

    a, (param, act, grad, act2) = run(PhaseSidedAllocator(1000))
    assert (param.block.addr, act.block.addr, act2.block.addr) == (900, 0, 200)
    assert grad.block is None
    big = store(5, 600)  # the gradient's hole joined the free space above the activations
    assert a.allocate(big) and big.block.addr == 300
    a.check()
    a, _ = run(make_allocator("segregated", 1000))  # there it split the free space
    assert a.largest_free_block() == 550 and not a.allocate(store(5, 600))


def test_pools_need_finite_capacity_and_know_their_names():
    for name in ("best-fit", "segregated", "two-sided", "size-sided", "phase-sided"):
        assert make_allocator(name, 64).name == name
        try:
            make_allocator(name, float("inf"))
        except ValueError as e:
            assert "finite" in str(e)
        else:
            raise AssertionError("an infinite pool was accepted")


OPS = st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 100),
                         st.booleans()), min_size=1, max_size=80)


@settings(max_examples=200)
@given(ops=OPS, capacity=st.integers(0, 300), two_sided=st.booleans())
def test_pool_invariants_hold_under_any_sequence(ops, capacity, two_sided):
    """Blocks tile [0, capacity), live blocks never overlap, free blocks never touch, the
    hole index, byte count and free-neighbour fields stay exact, and a failed allocation
    means no hole was large enough."""
    a = TwoSidedAllocator(capacity) if two_sided else BestFitAllocator(capacity)
    live: list[Storage] = []
    for k, (alloc, nbytes, cost, pinned) in enumerate(ops):
        if alloc or not live:
            s = store(k, nbytes, cost, pinned)
            holes = [b.size for b in a.layout() if b.storage is None]
            if a.allocate(s):
                live.append(s)
                assert s.block.addr >= 0 and s.block.addr + nbytes <= capacity
            else:
                assert all(h < nbytes for h in holes)
        else:
            a.free(live.pop(cost % len(live)))
        a.check()
        spans = sorted((s.block.addr, s.block.addr + s.nbytes) for s in live)
        assert all(e <= b for (_, e), (b, _) in pairwise(spans))
        blocks = a.layout()
        for i, b in enumerate(blocks):
            if b.storage is not None:
                near = [blocks[j] for j in (i - 1, i + 1) if 0 <= j < len(blocks)]
                assert b.storage.free_adj == sum(x.size for x in near if x.storage is None)
