"""Hand-written programs on the Engine whose outcome is derived by hand in the comments.

Clock arithmetic used throughout: the engine's clock starts at 1.0 and advances by each executed
op's cost; a program op stamps its outputs with the clock *after* it ran, and every op stamps
its inputs with the clock *before* it runs. ``put`` and ``get_value`` do not advance the clock.
"""

from __future__ import annotations

import math
import sys

import pytest

from membudget.core import Engine
from membudget.core.policies import POLICIES
from membudget.errors import EngineError, OutOfBudget, Thrashed

B = 100  # bytes of one activation in the chain tests


def chain(eng: Engine, n: int, nbytes: int = B, cost: float = 1.0) -> list:
    """x0 (a pinned leaf) -> x1 -> ... -> xn, every handle kept."""
    xs = [eng.put(nbytes)]
    for i in range(1, n + 1):
        (x,) = eng.apply(f"op{i}", [xs[-1]], [nbytes], cost=cost)
        xs.append(x)
    return xs


def resident_bytes(*tensors) -> int:
    return sum(s.nbytes for s in {t.storage for t in tensors} if s.resident)


def frame_depth() -> int:
    f, depth = sys._getframe(), 0
    while f is not None:
        depth += 1
        f = f.f_back
    return depth


# ---------------------------------------------------------------------------------- chains
def test_chain_forward_keeps_last_k_and_sweep_remats_one_op_per_read():
    # Budget = leaf + k activations. Under LRU, x_j's last access is j + 1 (its op ran at
    # clock j -> j + 1, and it is stamped again with j + 1 when x_{j+1}'s op starts), so
    # each new output evicts the oldest unlocked one: after the forward pass exactly the last
    # k outputs are resident and x1..x_{n-k} are evicted, one eviction per op past the k-th.
    n, k = 10, 3
    budget = B * (1 + k)
    eng = Engine(budget, "lru", "fungible")
    xs = chain(eng, n)
    assert [x.storage.resident for x in xs] == [True] * 1 + [False] * (n - k) + [True] * k
    assert all(x.storage.evicted for x in xs[1 : n - k + 1])
    assert eng.stats.evictions == n - k
    assert eng.stats.ops == n and eng.stats.remat_ops == 0
    assert eng.used_bytes == budget == eng.peak_bytes

    # Reading x1: its only input x0 is resident, so exactly one recomputation (op1); to make
    # room LRU evicts the oldest resident one, x_{n-k+1} (last access n-k+2).
    eng.get_value(xs[1])
    assert eng.stats.remat_ops == 1 and eng.stats.remat_cost == 1.0
    assert xs[1].defined and xs[1].storage.resident
    assert xs[n - k + 1].storage.evicted
    assert all(x.storage.resident for x in xs[n - k + 2 :])

    # Sweep x2..xn in order. Before reading x_j the resident activations are the three most
    # recently read/created ones, x_{j-1} is locked as op_j's input, and LRU evicts the oldest
    # of the other two, so every read costs exactly one recomputation: x_{n-k+1..n} were all
    # evicted by the reads of x1..x3, so they too need one op each. Total: n.
    for j in range(2, n + 1):
        before = eng.stats.remat_ops
        eng.get_value(xs[j])
        assert eng.stats.remat_ops == before + 1, f"reading x{j}"
        assert xs[j].defined and xs[j - 1].defined
    assert eng.stats.remat_ops == n
    assert eng.stats.remat_cost == n
    assert eng.stats.ops == n  # recomputations are not program ops
    assert eng.peak_bytes <= budget
    assert eng.used_bytes == resident_bytes(*xs) == budget


def test_chain_deep_read_recomputes_each_missing_ancestor_once():
    # After the forward pass x1..x7 are evicted. Reading x7 needs op1..op7, each run once:
    # op_j's input x_{j-1} is locked while op_j runs, so it is never lost again.
    n, k = 10, 3
    eng = Engine(B * (1 + k), "lru")
    xs = chain(eng, n, cost=2.0)
    eng.get_value(xs[7])
    assert eng.stats.remat_ops == 7
    assert eng.stats.remat_cost == 14.0
    assert xs[7].defined and xs[7].storage.resident
    assert eng.peak_bytes <= B * (1 + k)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_chain_peak_never_exceeds_budget_for_any_policy(policy):
    n, k = 30, 2
    budget = B * (1 + k)
    eng = Engine(budget, policy)
    xs = chain(eng, n)
    for j in (1, n // 2, n, 3, n - 1):
        eng.get_value(xs[j])
        assert xs[j].defined and xs[j].storage.resident
        assert eng.used_bytes <= budget
    assert eng.peak_bytes <= budget
    assert eng.used_bytes == resident_bytes(*xs)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_lifted_budget_still_evicts_under_every_policy(policy):
    """After the budget is lifted to a fungible pool (a session handing values back), a
    read that needs room evicts as before, also for the policies that read addresses."""
    n, k = 12, 2
    eng = Engine(B * (1 + k), policy)
    xs = chain(eng, n)
    eng.lift_budget(B * (2 + k))
    for j in (1, n // 2, n):
        eng.get_value(xs[j])
        assert xs[j].storage.resident and eng.used_bytes <= B * (2 + k)


# ---------------------------------------------------------------------------------- release
def test_release_without_dependents_frees_for_good():
    eng = Engine(math.inf, "lru")
    a = eng.put(B)
    (y,) = eng.apply("f", [a], [3 * B], cost=1)
    assert eng.used_bytes == 4 * B
    eng.release(y)
    s = y.storage
    assert s.dead and not s.resident and not s.evicted
    assert not y.defined
    assert eng.used_bytes == B
    assert eng.stats.frees == 1 and eng.stats.eager_evictions == 0
    assert s not in a.storage.children
    with pytest.raises(EngineError, match="freed for good"):
        eng.apply("g", [y], [B])


def test_release_with_live_dependent_only_evicts_and_stays_recomputable():
    # budget 3B: a (leaf), y = f(a), z = g(y).
    eng = Engine(3 * B, "lru")
    a = eng.put(B)
    (y,) = eng.apply("f", [a], [B], cost=1)
    (z,) = eng.apply("g", [y], [B], cost=1)
    eng.release(y)  # z depends on y: evicted eagerly, not freed
    assert y.storage.evicted and not y.storage.dead and not y.defined
    assert eng.stats.eager_evictions == 1 and eng.stats.frees == 0
    assert eng.used_bytes == 2 * B
    # w = h(a) needs 2B with 2B used of 3B: the only candidate, z, is evicted.
    (w,) = eng.apply("h", [a], [2 * B], cost=1)
    assert z.storage.evicted and eng.stats.evictions == 1
    # Reading z recomputes y (op f), then z (op g); making room for y evicts w.
    eng.get_value(z)
    assert eng.stats.remat_ops == 2 and eng.stats.remat_cost == 2.0
    assert z.defined and z.storage.resident
    assert w.storage.evicted
    assert eng.peak_bytes <= 3 * B
    # Releasing z frees it and cascades to y (no handle, no other child): two frees.
    eng.release(z)
    assert z.storage.dead and y.storage.dead
    assert eng.stats.frees == 2
    assert not a.storage.dead and a.storage.resident  # the program still holds a
    assert eng.used_bytes == resident_bytes(a, w) == B


def test_released_pinned_leaf_with_dependent_stays_resident():
    eng = Engine(math.inf, "lru")
    a = eng.put(B)
    (y,) = eng.apply("f", [a], [B])
    eng.release(a)
    assert a.storage.resident and not a.storage.evicted and not a.storage.dead
    eng.release(y)  # y freed; cascade frees the leaf that nothing needs any more
    assert a.storage.dead and eng.used_bytes == 0 and eng.stats.frees == 2


def test_retain_then_release_keeps_value_until_last_reference():
    eng = Engine(math.inf, "lru")
    a = eng.put(B)
    (y,) = eng.apply("f", [a], [B])
    eng.retain(y)
    eng.release(y)
    assert y.storage.resident and not y.storage.dead
    eng.release(y)
    assert y.storage.dead
    with pytest.raises(EngineError, match="released more often"):
        eng.release(y)


def test_long_free_cascade_is_iterative():
    n = 10_000
    eng = Engine(math.inf, "lru")
    xs = [eng.put(8)]
    for i in range(1, n + 1):
        (x,) = eng.apply(i, [xs[-1]], [8], cost=1)
        if i > 1:
            eng.release(xs[-1])  # has a live child: evicted eagerly
        xs.append(x)
    assert eng.stats.eager_evictions == n - 1
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(frame_depth() + 150)
    try:
        eng.release(xs[-1])
    finally:
        sys.setrecursionlimit(old)
    assert eng.stats.frees == n
    assert all(x.storage.dead for x in xs[1:])
    assert eng.used_bytes == 8 and xs[0].storage.resident


# ---------------------------------------------------------------------------------- pinning
def test_pinned_tensors_are_never_evicted_and_oom_reports_needed_bytes():
    eng = Engine(3 * B, "size")
    a = eng.put(B)
    b = eng.put(B)
    (x,) = eng.apply("f", [a], [B])  # 3B used: full
    # Needs 2B: "size" would take the largest, but only x is a candidate; after evicting it
    # 2B (a, b) remain pinned, 2B + 2B > 3B and nothing is left: out of budget.
    with pytest.raises(OutOfBudget) as ei:
        eng.apply("g", [b], [2 * B])
    e = ei.value
    assert e.request_bytes == 2 * B
    assert e.unevictable_bytes == 2 * B
    assert e.needed_bytes == 4 * B
    assert e.budget_bytes == 3 * B
    assert a.storage.resident and b.storage.resident and a.defined and b.defined
    assert x.storage.evicted
    assert eng.peak_bytes <= 3 * B


def test_locked_input_counts_as_unevictable_in_oom():
    eng = Engine(3 * B, "lru")
    a = eng.put(B)
    (x,) = eng.apply("f", [a], [2 * B])  # 3B used
    # x is the input of the failing op, hence locked: needed = a + x + request = 5B.
    with pytest.raises(OutOfBudget) as ei:
        eng.apply("g", [x], [2 * B])
    assert ei.value.needed_bytes == 5 * B
    assert ei.value.unevictable_bytes == 3 * B
    assert x.storage.locks == 0 and x.storage.resident  # the lock was released
    assert x.storage in eng.pool  # evictable again
    # Now x can be evicted to make room for an op that does not read it.
    (y,) = eng.apply("h", [a], [2 * B])
    assert x.storage.evicted and y.storage.resident


def test_pin_makes_an_activation_unevictable():
    eng = Engine(3 * B, "lru")
    a = eng.put(B)
    (x,) = eng.apply("f", [a], [B])
    (y,) = eng.apply("g", [a], [B])
    eng.pin(x)  # x is the LRU choice, but pinned
    eng.apply("h", [a], [B])
    assert x.storage.resident and y.storage.evicted


def test_put_larger_than_budget_is_oom():
    eng = Engine(50, "lru")
    with pytest.raises(OutOfBudget) as ei:
        eng.put(60)
    assert ei.value.needed_bytes == 60 and eng.used_bytes == 0


# ---------------------------------------------------------------------------------- recursion
@pytest.mark.parametrize("policy", ["lru", "dtr-eq"])
def test_ten_thousand_op_evicted_chain_rematerializes_iteratively(policy):
    n = 10_000
    eng = Engine(3 * 8, policy)  # leaf + two activations of 8 bytes
    xs = chain(eng, n, nbytes=8)
    assert xs[n - 2].storage.evicted and xs[1].storage.evicted
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(frame_depth() + 150)
    try:
        eng.get_value(xs[n - 2])
    finally:
        sys.setrecursionlimit(old)
    # x1..x_{n-2} were all evicted, and each one is locked while its child is computed.
    assert eng.stats.remat_ops == n - 2
    assert xs[n - 2].defined
    assert eng.peak_bytes <= 24


def _waiting_frame(budget: int) -> tuple[Engine, list]:
    """x (leaf) -> a, c, d; b = g(c, d). a stays resident, b, c and d are evicted: an op
    f(a, b) then locks a in its frame while b's recomputation needs c, d and b."""
    eng = Engine(budget, "lru")
    x = eng.put(8)
    (c,) = eng.apply("h1", [x], [B])
    (d,) = eng.apply("h2", [x], [B])
    (b,) = eng.apply("g", [c, d], [B])
    (a,) = eng.apply("k", [x], [B])  # (c or d, the least recent, makes room for it)
    assert all(t.storage.evicted or eng.evict(t) for t in (b, c, d))
    return eng, [x, a, b, c, d]


def test_a_recomputation_deeper_than_the_budget_unlocks_the_frames_below_it():
    # Budget x + 3B: f needs a, b and its output (3B), g needs c, d and b (3B), but g's
    # recomputation inside f's frame, which holds a, would need 4B. f's frame gives up its
    # lock, a is evicted for b, and f recomputes a once b is back: h1, h2, g and k run again.
    # (Before, the run stopped out of budget while recomputing.)
    eng, (x, a, b, c, d) = _waiting_frame(8 + 3 * B)
    (out,) = eng.apply("f", [a, b], [B])
    assert out.defined and a.defined and b.defined
    assert eng.stats.remat_ops == 4 and a.storage.remats == 1
    assert eng.peak_bytes <= 8 + 3 * B
    assert all(s.locks == 0 for s in (x.storage, a.storage, b.storage, c.storage, d.storage))


def test_a_recomputation_that_needs_more_than_the_budget_alone_still_fails():
    # A leaf p of B bytes, put after the fact, leaves g's recomputation (c, d and b beside x
    # and p: x + 4B) no way to fit, a given up or not: the run stops out of budget, with
    # every lock released and the engine usable.
    eng, (x, a, b, c, d) = _waiting_frame(8 + 3 * B)
    p = eng.put(B)
    with pytest.raises(OutOfBudget) as ei:
        eng.apply("f", [a, b], [B])
    assert ei.value.recomputing and ei.value.needed_bytes == 8 + 4 * B
    assert all(s.locks == 0 for s in (x.storage, a.storage, b.storage, c.storage, d.storage))
    (y,) = eng.apply("k2", [x, p], [B])
    assert y.defined and eng.peak_bytes <= 8 + 3 * B


# ---------------------------------------------------------------------------------- aliases
def test_view_shares_base_storage_and_is_recomputed_with_it():
    eng = Engine(2 * B, "lru")
    a = eng.put(B)
    (base,) = eng.apply("f", [a], [B], cost=3)
    (view,) = eng.apply("v", [base], [0], out_alias=[0], cost=2)
    assert view.storage is base.storage and view.alias
    assert base.storage.tensors == [base, view]
    assert eng.used_bytes == 2 * B  # the view holds no bytes of its own
    assert base.storage.cost == 5.0  # the view's cost is charged to the base storage
    assert base.storage.ext_refs == 2
    # Pressure: the base storage is the only candidate; evicting it undefines both.
    (other,) = eng.apply("g", [a], [B], cost=1)
    assert base.storage.evicted and not base.defined and not view.defined
    # Reading the view re-runs f (to rebuild the base, evicting `other`) then v.
    eng.get_value(view)
    assert eng.stats.remat_ops == 2 and eng.stats.remat_cost == 5.0
    assert view.defined and base.defined and base.storage.resident
    assert other.storage.evicted
    assert eng.peak_bytes <= 2 * B
    # Releasing only the base keeps the storage: the view still references it.
    eng.release(base)
    assert base.storage.resident and base.storage.ext_refs == 1


# ---------------------------------------------------------------------------------- mutation
def test_copy_on_write_mutation_appends_a_same_size_new_version():
    eng = Engine(math.inf, "lru")
    a = eng.put(7)
    (x,) = eng.apply("f", [a], [300])
    used = eng.used_bytes
    outs = eng.apply("add_", [x, a], [11], mutated=[0], cost=1)
    assert len(outs) == 2
    new = outs[1]
    assert new.storage is not x.storage
    assert new.storage.nbytes == x.storage.nbytes == 300
    assert not new.alias and new.producer is outs[0].producer
    assert x.storage in new.storage.parents and a.storage in new.storage.parents
    assert eng.used_bytes == used + 11 + 300
    # The caller rebinds its handle and releases the old version: the new version was
    # computed from it, so it is evicted (still recomputable), not freed.
    eng.release(x)
    assert x.storage.evicted and not x.storage.dead
    assert eng.used_bytes == used + 11
    assert eng.stats.eager_evictions == 1
    # Mutating a leaf: the new version has the leaf's size; the leaf has a child now, so
    # releasing it keeps it resident (pinned leaves stay).
    (new_a,) = eng.apply("zero_", [a], [], mutated=[0])
    assert new_a.storage.nbytes == 7 and new_a.storage is not a.storage
    eng.release(a)
    assert a.storage.resident and not a.storage.dead


# ---------------------------------------------------------------------------------- thrashing
def test_remat_cost_limit_raises_thrashed():
    # Chain of 5 ops of cost 10, budget leaf + 2: after the forward pass x4, x5 are resident.
    # Reading x1 costs 10 (evicts x4), reading x2 costs 10 more (evicts x5): 20 == limit is
    # allowed; reading x3 (evicted in the forward pass) brings it to 30 > 20.
    eng = Engine(3 * B, "lru", remat_cost_limit=20)
    xs = chain(eng, 5, cost=10)
    eng.get_value(xs[1])
    eng.get_value(xs[2])
    assert eng.stats.remat_cost == 20
    with pytest.raises(Thrashed) as ei:
        eng.get_value(xs[3])
    assert ei.value.extra_cost == 30 and ei.value.limit_cost == 20
    assert all(s.locks == 0 for s in {x.storage for x in xs})


# ---------------------------------------------------------------------------------- policies
def probe(eng: Engine, leaf) -> None:
    """Request exactly one byte more than is free: every candidate holds >= 1 byte, so the
    policy evicts exactly one storage, its first choice. The probe's output is then freed."""
    before = eng.stats.evictions
    (out,) = eng.apply("probe", [leaf], [int(eng.budget - eng.used_bytes) + 1])
    assert eng.stats.evictions == before + 1
    eng.release(out)
    assert out.storage.dead


def evicted(*tensors) -> list:
    return [t for t in tensors if t.storage.evicted]


@pytest.fixture
def three_candidates():
    """x1 (100 B, cost 100, oldest), x2 (100 B, cost 1), x3 (300 B, cost 50, newest).

    Clocks: x1 at 1 + 100 = 101, x2 at 102, x3 at 152; an idle 0-byte op of cost 48 ends at
    200. Staleness at 200: 99, 98, 48. c/(m·s): x1 100/9900 = 0.0101, x2 1/9800 = 0.0001,
    x3 50/14400 = 0.0035. c/m: 1, 0.01, 0.167. No evicted neighbours anywhere.
    """

    def build(policy):
        eng = Engine(10_000, policy)
        a = eng.put(1)
        (x1,) = eng.apply("f1", [a], [100], cost=100)
        (x2,) = eng.apply("f2", [a], [100], cost=1)
        (x3,) = eng.apply("f3", [a], [300], cost=50)
        eng.apply("idle", [a], [0], cost=48)
        assert eng.clock == 200
        return eng, a, (x1, x2, x3)

    return build


@pytest.mark.parametrize("policy, victim", [
    ("lru", 0), ("size", 2), ("dtr-local", 1), ("dtr", 1), ("dtr-eq", 1), ("msps", 1),
])
def test_policy_choice_on_three_candidates(three_candidates, policy, victim):
    eng, a, xs = three_candidates(policy)
    probe(eng, a)
    assert evicted(*xs) == [xs[victim]]


def test_lru_uses_reads_as_accesses(three_candidates):
    eng, a, (x1, x2, x3) = three_candidates("lru")
    eng.get_value(x1)  # x1 touched at 200: x2 (last 102) is now the oldest
    probe(eng, a)
    assert evicted(x1, x2, x3) == [x2]


@pytest.mark.parametrize("policy, victim", [("dtr-local", 0), ("msps", 1)])
def test_msps_ignores_staleness(policy, victim):
    # x1: cost 10, 100 B, made at clock 11; idle to 100; x2: cost 5, 100 B, made at 105;
    # idle to 106. dtr-local: x1 10/(100·95) = 0.00105 < x2 5/(100·1) = 0.05 -> x1.
    # msps: x1 10/100 = 0.1 > x2 5/100 = 0.05 -> x2.
    eng = Engine(10_000, policy)
    a = eng.put(1)
    (x1,) = eng.apply("f1", [a], [100], cost=10)
    eng.apply("idle", [a], [0], cost=89)
    (x2,) = eng.apply("f2", [a], [100], cost=5)
    eng.apply("idle", [a], [0], cost=1)
    assert eng.clock == 106
    probe(eng, a)
    assert evicted(x1, x2) == [(x1, x2)[victim]]


@pytest.mark.parametrize("policy, victim", [
    ("dtr-local", "c"), ("dtr", "d"), ("dtr-eq", "d"), ("msps", "d"), ("lru", "c"),
])
def test_evicted_parent_cost_counts_for_neighbourhood_policies(policy, victim):
    # p (cost 50) -> c (cost 1); d (cost 2) independent. Releasing p evicts it (c needs it).
    # Clocks: p 51, c 52, d 54, idle to 100: staleness c 48, d 46.
    # dtr-local: c 1/4800 = 0.00021 < d 2/4600 = 0.00043 -> c.
    # dtr, dtr-eq: c (1 + 50)/4800 = 0.0106 > d -> d.  msps: c 51/100 > d 2/100 -> d.
    eng = Engine(10_000, policy)
    a = eng.put(1)
    (p,) = eng.apply("fp", [a], [100], cost=50)
    (c,) = eng.apply("fc", [p], [100], cost=1)
    (d,) = eng.apply("fd", [a], [100], cost=2)
    eng.release(p)
    assert p.storage.evicted
    assert c.storage.ev_parents == 1 and a.storage.ev_children == 1
    eng.apply("idle", [a], [0], cost=46)
    assert eng.clock == 100
    probe(eng, a)
    assert evicted(c, d) == [{"c": c, "d": d}[victim]]


@pytest.mark.parametrize("policy, victim", [
    ("dtr", "s"), ("dtr-eq", "d"), ("dtr-local", "s"), ("msps", "s"),
])
def test_dtr_eq_merges_connected_evicted_neighbours_dtr_walks_each_side(policy, victim):
    # p -> s -> c and p -> q -> c, plus a 0-byte z = fz(c) that keeps c needed; d independent.
    # Release p, q, c: all evicted, and dtr-eq's union-find merges them into one class
    # worth P + Q + C = 10 + 1000 + 10. For s, dtr walks parents (p: 10) and children
    # (c: 10) only: 20. Clocks: p 11, s 12, q 1012, c 1022 (s stamped 1012), z 1022,
    # d 1122, idle to 1200: staleness s 188, d 78.
    # s: dtr (1 + 20)/18800 = 0.0011; dtr-eq (1 + 1020)/18800 = 0.054; dtr-local 1/18800;
    # msps (1 + 10)/100 = 0.11.  d: 100/7800 = 0.0128 (and msps 100/100 = 1).
    eng = Engine(10_000, policy)
    a = eng.put(1)
    (p,) = eng.apply("fp", [a], [100], cost=10)
    (s,) = eng.apply("fs", [p], [100], cost=1)
    (q,) = eng.apply("fq", [p], [100], cost=1000)
    (c,) = eng.apply("fc", [s, q], [100], cost=10)
    eng.apply("fz", [c], [0], cost=0)
    (d,) = eng.apply("fd", [a], [100], cost=100)
    for t in (p, q, c):
        eng.release(t)
    assert p.storage.evicted and q.storage.evicted and c.storage.evicted
    assert s.storage.ev_parents == 1 and s.storage.ev_children == 1
    eng.apply("idle", [a], [0], cost=78)
    assert eng.clock == 1200
    probe(eng, a)
    assert evicted(s, d) == [{"s": s, "d": d}[victim]]


def test_zero_staleness_is_never_preferred():
    # A candidate touched at the current clock scores +inf under the cost policies.
    # x1: made at 1001, staleness 1 at clock 1002: 1000/100 = 10; x2: cost 0, made at 1002.
    eng = Engine(10_000, "dtr-local")
    a = eng.put(1)
    (x1,) = eng.apply("f1", [a], [100], cost=1000)  # very expensive, but stale
    eng.apply("idle", [a], [0], cost=1)
    (x2,) = eng.apply("f2", [a], [100], cost=0)  # free, but made at the current clock
    assert eng.clock == 1002
    probe(eng, a)
    assert evicted(x1, x2) == [x1]


def test_random_policy_is_seeded_and_picks_a_candidate():
    def run(seed):
        eng = Engine(10_000, "random", seed=seed)
        a = eng.put(1)
        xs = [eng.apply(f"f{i}", [a], [100], cost=1)[0] for i in range(8)]
        picks = []
        for _ in range(4):
            probe(eng, a)
            picks.append([i for i, x in enumerate(xs) if x.storage.evicted])
        return picks

    first = run(3)
    assert first == run(3)
    assert len(first[-1]) == 4  # four distinct victims, all among the candidates
    assert len({tuple(run(s)[-1]) for s in range(6)}) > 1  # the seed matters


# ---------------------------------------------------------------------------------- regressions
# Both were bugs at the base commit (found here and by test_properties.py), since fixed in
# engine.py: _execute sets ``t.defined = t.storage.resident`` after running an op, and _link
# counts a view of an evicted base as an evicted child of the op's other inputs.
def test_remat_of_multi_output_op_does_not_mark_an_evicted_sibling_defined():
    # Clocks: (o1, o2) made at 2; a 0-byte op to 3; o1 read (last 3); x made at 4; y at 5.
    eng = Engine(301, "lru")
    a = eng.put(1)
    o1, o2 = eng.apply("f", [a], [100, 100], cost=1)
    eng.apply("k", [a], [0], cost=1)
    eng.get_value(o1)
    (x,) = eng.apply("g", [a], [100], cost=1)
    (y,) = eng.apply("h", [a], [100], cost=1)  # full: LRU evicts o2 (last 2)
    assert o2.storage.evicted and o1.storage.resident
    # Recomputing o2 re-runs f: the duplicate of resident o1 needs 100 B, and LRU's oldest
    # candidate is o1 itself (last 3 < x 4 < y 5).
    eng.get_value(o2)
    for t in (a, o1, o2, x, y):
        assert not t.defined or t.storage.resident, f"{t} is defined but not resident"
    assert eng.used_bytes == resident_bytes(a, o1, o2, x, y)


def test_view_of_evicted_base_keeps_neighbour_counts_exact():
    eng = Engine(1000, "size")
    a = eng.put(1)
    (q,) = eng.apply("q", [a], [50], cost=1)
    (b,) = eng.apply("b", [a], [400], cost=1)
    eng.apply("w", [a], [600], cost=1)  # "size" evicts the largest candidate: b
    assert b.storage.evicted
    eng.apply("view", [b, q], [0], out_alias=[0], cost=1)  # rematerializes b, then views it
    for s in (a.storage, q.storage, b.storage):
        assert s.ev_children == sum(c.evicted for c in s.children), s
        assert s.ev_parents == sum(p.evicted for p in s.parents), s


@pytest.mark.parametrize("inplace", ["cow", "remat"])
def test_a_recomputed_write_takes_the_block_of_the_value_recomputed_for_it(inplace):
    # y = f(x), then y2 = relu_(y) written in place; the program keeps only y2 and a pinned
    # w. Under a budget of four blocks, v = g(x) evicts y2 and is then released: reading y2
    # recomputes y for the write alone, and the write lands in y's block, so x, w and y2
    # fill the budget, where a fresh block for the version would need a fifth.
    eng = Engine(4 * B, "lru", inplace=inplace)
    x = eng.put(B)
    (y,) = eng.apply("f", [x], [B], cost=1)
    (y2,) = eng.apply("relu_", [y], [], mutated=[0], cost=1)
    eng.release(y)
    w = eng.put(2 * B)
    (v,) = eng.apply("g", [x], [B], cost=1)
    eng.release(v)
    assert y2.storage.evicted and w.storage.resident and eng.used_bytes == 3 * B
    eng.get_value(y2)
    assert y2.defined and y2.storage.resident
    assert y.storage.evicted and not y.storage.dead  # recomputable again, from x
    assert eng.stats.remat_ops == 2
    assert eng.peak_bytes == eng.used_bytes == 4 * B


@pytest.mark.parametrize("inplace", ["cow", "remat"])
def test_a_recomputed_write_keeps_an_old_value_another_op_is_using(inplace):
    # The same write, recomputed while an op that reads both y and y2 holds y: y stays
    # where it is and the version takes a block of its own.
    eng = Engine(math.inf, "lru", inplace=inplace)
    x = eng.put(B)
    (y,) = eng.apply("f", [x], [B], cost=1)
    (y2,) = eng.apply("relu_", [y], [], mutated=[0], cost=1)
    assert eng.evict(y2)
    (z,) = eng.apply("g", [y, y2], [B], cost=1)
    assert y.storage.resident and y2.storage.resident and z.storage.resident
    assert y.storage is not y2.storage
