"""Coop's window, DTE and MegEngine scoring, recomputable in-place, and budget bisection."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from membudget.core import Engine
from membudget.core.allocators.block import Block
from membudget.core.policies import make_policy
from membudget.core.policies.coop import cheapest_window
from membudget.core.pool import CandidatePool
from membudget.core.records import Storage
from membudget.errors import EngineError, MembudgetError
from membudget.sim import simulate
from membudget.sim.budgets import budget_limits
from membudget.sim.method import Method
from membudget.trace.format import CALL, GET, PUT, Trace, write_trace


# ---------------------------------------------------------------------------- the window
def brute_force(sizes, costs, barrier, need, segments):
    """The lowest summed cost over every contiguous run of non-barrier blocks of one
    segment covering ``need`` bytes (None if there is none)."""
    best = None
    n = len(sizes)
    for i in range(n):
        for j in range(i, n):
            if barrier[j] or segments[j] != segments[i]:
                break
            if sum(sizes[i: j + 1]) >= need:
                c = math.fsum(costs[i: j + 1])
                best = c if best is None else min(best, c)
                break  # longer runs from i only cost more
    return best


LAYOUTS = st.lists(st.tuples(st.integers(1, 50), st.floats(0, 1e6, allow_nan=False),
                             st.integers(0, 5), st.integers(0, 3)), min_size=0, max_size=40)


@settings(max_examples=400)
@given(blocks=LAYOUTS, need=st.integers(1, 300), tiny=st.booleans())
def test_sliding_window_finds_the_brute_force_minimum(blocks, need, tiny):
    import numpy as np

    sizes = np.array([b[0] for b in blocks], dtype=np.int64)
    # mix huge and tiny costs so prefix sums lose precision unless re-summed exactly
    costs = np.array([b[1] * (1e-9 if tiny and k % 2 else 1.0) for k, b in enumerate(blocks)])
    barrier = np.array([b[2] == 0 for b in blocks], dtype=bool)
    segments = np.cumsum([b[3] == 0 for b in blocks]).astype(np.int64)
    expected = brute_force(sizes.tolist(), costs.tolist(), barrier.tolist(), need,
                           segments.tolist())
    got = cheapest_window(sizes, costs, barrier, need, segments)
    if expected is None:
        assert got is None
        return
    assert got is not None
    i, j = got
    assert not barrier[i: j + 1].any() and len(set(segments[i: j + 1])) == 1
    assert sizes[i: j + 1].sum() >= need
    assert math.fsum(costs[i: j + 1]) == expected


@settings(max_examples=300)
@given(blocks=LAYOUTS, need=st.integers(1, 300), data=st.data())
def test_window_with_lower_bounds_made_exact_on_demand_is_still_the_minimum(blocks, need,
                                                                          data):
    """coop's branch and bound: some costs start as lower bounds (a fraction of the truth)
    and are made exact only where needed; the choice must match brute force on the truth."""
    import numpy as np

    n = len(blocks)
    sizes = np.array([b[0] for b in blocks], dtype=np.int64)
    truth = np.array([b[1] for b in blocks])
    barrier = np.array([b[2] == 0 for b in blocks], dtype=bool)
    segments = np.cumsum([b[3] == 0 for b in blocks]).astype(np.int64)
    pending = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    shrink = np.array(data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)))
    given = np.where(pending, truth * shrink, truth)
    asked: list[int] = []

    def exact(k: int) -> float:
        asked.append(k)
        return float(truth[k])

    got = cheapest_window(sizes, given, barrier, need, segments, pending.copy(), exact)
    expected = brute_force(sizes.tolist(), truth.tolist(), barrier.tolist(), need,
                           segments.tolist())
    assert len(set(asked)) == len(asked)  # each bound made exact at most once
    if expected is None:
        assert got is None
        return
    i, j = got
    assert sizes[i: j + 1].sum() >= need and not barrier[i: j + 1].any()
    assert math.fsum(truth[i: j + 1]) == expected


def fill(eng: Engine, costs: list[float], nbytes: int = 10):
    """A pinned 10-byte leaf, then one 10-byte output per cost, each kept by the program."""
    x = eng.put(10)
    return x, [eng.apply(f"f{k}", [x], [nbytes], cost=c)[0] for k, c in enumerate(costs)]


def test_coop_evicts_the_cheapest_contiguous_run_at_once():
    eng = Engine(100, "coop", "best-fit")
    x, outs = fill(eng, [100, 100, 100, 1, 1, 1, 100, 100, 100])
    assert [t.storage.block.addr for t in outs] == list(range(10, 100, 10))
    y = eng.apply("big", [x], [30], cost=1)[0]
    evicted = [k for k, t in enumerate(outs) if t.storage.evicted]
    assert evicted == [3, 4, 5]
    assert y.storage.block.addr == 40
    assert eng.stats.evictions == 3 and len(eng.stats.search_ns) == 1  # one search


def test_layout_blind_policy_on_a_pool_keeps_evicting_until_a_block_fits():
    eng = Engine(100, "dtr-eq", "best-fit")
    x, _ = fill(eng, [1, 100, 1, 100, 1, 100, 100, 100, 100])
    eng.apply("big", [x], [20], cost=1)
    # the two cheapest are not adjacent, so freeing them leaves no 20-byte hole
    assert eng.stats.evictions > 2
    eng.allocator.check()
    assert eng.peak_bytes <= 100


def test_coop_needs_a_layout_and_says_so():
    with pytest.raises(EngineError, match="address layout"):
        Engine(100, "coop", "fungible")


# ---------------------------------------------------------------------------- scores
def pool_of(*specs):
    """Candidates (nbytes, cost, last access, free neighbours), entered in order; each
    sits in a block of its own with that many free bytes before it."""
    pool = CandidatePool(track_free_adj=True)
    out = []
    for k, (nbytes, cost, last, free_adj) in enumerate(specs):
        s = Storage(k, nbytes)
        s.cost, s.last_access, s.resident = cost, last, True
        s.block = Block(free_adj, nbytes, s)
        if free_adj:
            s.block.prev = Block(0, free_adj, None, 0, None, s.block)
        pool.add(s)
        out.append(s)
    pool.sync()
    return pool, out


def test_dte_prefers_the_victim_next_to_free_space():
    pool, (a, b) = pool_of((100, 5.0, 1.0, 50), (100, 5.0, 1.0, 0))
    assert make_policy("dte").choose(pool, 10.0) is a
    assert make_policy("dtr-eq").choose(pool, 10.0) is b  # a tie: the latest entrant


MIB = 2**20


def test_megengine_skips_small_tensors_and_leaves_out_its_own_cost():
    pool, (_, big_cheap, _) = pool_of(
        (2 * MIB, 1000.0, 1.0, 0), (2 * MIB, 1.0, 1.0, 0), (MIB // 2, 0.0, 1.0, 0))
    me = make_policy("megengine")
    # neither big one has evicted neighbours: both score 1e-3 / (2 · 9), a tie
    assert me.choose(pool, 10.0) is big_cheap
    assert make_policy("megengine", own_cost=True).choose(pool, 10.0) is big_cheap
    pool2, (x, y) = pool_of((2 * MIB, 1.0, 1.0, 0), (2 * MIB, 1000.0, 1.0, 0))
    assert make_policy("megengine", own_cost=True).choose(pool2, 10.0) is x
    assert me.choose(pool2, 10.0) is y  # own cost ignored: a tie, the latest entrant
    only_small, (s,) = pool_of((MIB // 2, 1.0, 1.0, 0))
    assert me.choose(only_small, 10.0) is s  # nothing larger: small ones are considered


def test_megengine_sqrt_sampling_is_seeded_and_picks_a_candidate():
    specs = [(2 * MIB, float(k + 1), 1.0, 0) for k in range(100)]
    picks = []
    for _ in range(2):
        pool, items = pool_of(*specs)
        pol = make_policy("megengine-sqrt", seed=3, own_cost=True)
        picks.append([items.index(pol.choose(pool, 10.0)) for _ in range(5)])
    assert picks[0] == picks[1]
    assert len(set(picks[0])) > 1  # different samples, different winners


def test_bad_policy_options_are_named():
    with pytest.raises(MembudgetError, match="bad options"):
        make_policy("dte", alpha=2.0)


# ---------------------------------------------------------------------------- in-place
def test_recomputable_inplace_reuses_the_block_and_keeps_the_old_value_recomputable():
    eng = Engine(1000, "dtr-eq", "best-fit", inplace="remat")
    x = eng.put(100)
    a = eng.apply("f", [x], [100], cost=5)[0]
    block = a.storage.block
    used = eng.used_bytes
    (new,) = eng.apply("relu_", [a], [], cost=1, mutated=[0])
    assert new.storage.block is block and eng.used_bytes == used
    assert a.storage.evicted and not a.defined
    assert eng.stats.inplace_reuses == 1
    eng.get_value(a)  # the old value comes back from its history, in a fresh block
    assert a.defined and a.storage.block is not block and eng.stats.remat_ops == 1
    eng.release(a)
    eng.release(new)
    eng.get_value(x)
    eng.allocator.check()


def test_copy_on_write_gives_the_new_version_a_fresh_block():
    eng = Engine(1000, "dtr-eq", "best-fit", inplace="cow")
    x = eng.put(100)
    a = eng.apply("f", [x], [100], cost=5)[0]
    b = eng.apply("g", [a], [100], cost=5)[0]  # may need the old a again
    (new,) = eng.apply("relu_", [a], [], cost=1, mutated=[0])
    assert new.storage.block is not a.storage.block and a.defined
    assert eng.used_bytes == 400
    eng.release(a)  # the caller rebinds its handle: the old a is evicted (b needs it)
    assert not a.defined and eng.used_bytes == 300
    # nothing needs `new` once it is written: the write lands in its data, which is evicted
    # as soon as the op has run; the accounting is copy-on-write's all the same
    (newer,) = eng.apply("relu_", [new], [], cost=1, mutated=[0])
    assert newer.storage.block is not new.storage.block and not new.defined
    assert eng.used_bytes == 300 and eng.peak_bytes == 400 and b.defined


def test_inplace_on_a_leaf_that_is_still_needed_falls_back_to_a_copy():
    eng = Engine(1000, "dtr-eq", "best-fit", inplace="remat")
    w = eng.put(100)
    act = eng.apply("f", [w], [100], cost=5)[0]  # still needs the old w to be recomputed
    (w2,) = eng.apply("sgd_", [w], [], cost=1, mutated=[0])
    assert eng.stats.inplace_copies == 1 and w.defined and w2.storage.pinned
    eng.release(act)  # now nothing needs the old w
    block = w2.storage.block
    (w3,) = eng.apply("sgd_", [w2], [], cost=1, mutated=[0])
    assert eng.stats.inplace_reuses == 1 and w3.storage.block is block


# ---------------------------------------------------------------------------- budgets
CHAIN = Trace({"model": "chain"}, [
    (PUT, None, 1, 100, "leaf"),
    (CALL, None, "f", (1,), (2,), (100,), (-1,), 10.0, ()),
    (CALL, None, "g", (2,), (3,), (100,), (-1,), 20.0, ()),
    (CALL, None, "h", (3,), (4,), (100,), (-1,), 30.0, ()),
    (GET, None, 2),
])


def test_minimum_and_cutoff_budget_by_bisection():
    # h needs its input and output resident beside the pinned leaf: 300 of the 400 bytes
    found = budget_limits(CHAIN, "dtr-eq", tolerance=0.01)
    assert 0.75 <= found.minimum <= 0.76
    assert 0.99 <= found.cutoff < 1.0  # below the unconstrained peak something is evicted
    assert simulate(CHAIN, "dtr-eq", ratio=found.minimum).status == "ok"
    assert simulate(CHAIN, "dtr-eq", ratio=found.minimum - 0.011).status == "oom"


@pytest.mark.parametrize("policy", ["coop", "dte", "megengine", "dtr-eq"])
@pytest.mark.parametrize("allocator", ["best-fit", "two-sided", "torch-caching"])
def test_a_budget_below_one_op_ends_in_oom_with_the_bytes_needed(policy, allocator):
    r = simulate(CHAIN, policy, budget=150, allocator=allocator)
    assert r.status == "oom" and r.needed_bytes is not None
    assert r.needed_bytes > 150 or "largest block" in r.message


def test_methods_parse_with_ablation_names():
    assert Method.parse("coop-no-window") == Method("dte", "two-sided", "remat",
                                                    "coop-no-window")
    assert Method.parse("coop@best-fit+cow").name == "coop@best-fit+cow"
    assert Method.parse("dtr", allocator="best-fit").name == "dtr@best-fit"
    with pytest.raises(MembudgetError, match="bad method"):
        Method.parse("coop@a@b")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "membudget.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_allocator_inplace_and_min_budget(tmp_path):
    path = tmp_path / "chain.jsonl"
    write_trace(path, CHAIN.header, CHAIN.events)
    r = _cli("simulate", str(path), "--policy", "coop", "--ratio", "0.9", "--json",
             "--min-budget")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert (obj["allocator"], obj["inplace"]) == ("two-sided", "remat")
    assert obj["budget_limits"]["minimum"] is not None
    bad = _cli("simulate", str(path), "--policy", "coop", "--allocator", "fungible",
               "--ratio", "0.5")
    assert bad.returncode == 2 and "address-ordered" in bad.stderr
    sw = _cli("sweep", str(path), "--policies", "coop,coop-no-window,dtr", "--allocator",
              "best-fit", "--ratios", "0.9,0.8", "--workers", "1", "--min-budget")
    assert sw.returncode == 0, sw.stderr
    assert "coop@best-fit" in sw.stdout and "frag" in sw.stdout and "cutoff" in sw.stdout


def test_cli_timeline_writes_a_png_and_a_snapshot_torch_reads(tmp_path):
    import pickle

    from torch.cuda import _memory_viz

    path = tmp_path / "chain.jsonl"
    write_trace(path, CHAIN.header, CHAIN.events)
    png, snap = tmp_path / "t.png", tmp_path / "t.pickle"
    r = _cli("timeline", str(path), "--policy", "dtr-eq", "--ratio", "0.8", "-o", str(png),
             "--snapshot", str(snap))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    with open(snap, "rb") as f:
        data = pickle.load(f)
    summary = _memory_viz.segsum(data)  # the best-fit pool is one segment of the budget
    assert "total_reserved: 320.0B" in summary and "total_allocated: 300.0B" in summary


def test_a_fragmented_pool_suggests_only_a_pool_it_is_not():
    """The out-of-memory hint names a pool that keeps pinned blocks together only when the
    run was not on one already."""
    from membudget.core.allocators import ALLOCATORS
    from membudget.errors import OutOfBudget

    split = {"op": "f", "request_bytes": 100, "unevictable_bytes": 50, "budget_bytes": 200,
             "largest_free_bytes": 80}
    assert "(two-sided or segregated)" in str(OutOfBudget(**split))
    message = str(OutOfBudget(**split, pinned_apart=True))
    assert "largest block" in message and "use a pool" not in message
    grouping = {name for name, cls in ALLOCATORS.items() if cls.keeps_pinned_apart}
    assert grouping == {"segregated", "two-sided", "size-sided", "phase-sided"}
