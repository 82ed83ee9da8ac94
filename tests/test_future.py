"""dtr-future: DTR scored by the time until each value's next read, which a replay knows."""

from __future__ import annotations

import pytest

import membudget
from membudget.errors import MembudgetError
from membudget.sim import simulate
from membudget.sim.future import read_times
from membudget.sim.schedules import run_schedule, schedules
from membudget.trace.format import CALL, COPY, GET, PUT, RELEASE, Trace


def call(op, ins, outs, nbytes, cost=1.0, mut=()):
    return (CALL, None, op, tuple(ins), tuple(outs), tuple(nbytes), (-1,) * len(outs),
            float(cost), tuple(mut))


def cyclic_reads() -> Trace:
    """Three 100 B values a, b, c made from one leaf, read in the cycle a b c a b c (each
    read makes a 10 B value, released at once), then released: with room for two of the
    three, the least recently used one is always the one read next."""
    ev: list = [(PUT, None, 1, 100, "leaf")]
    for tid in (2, 3, 4):
        ev.append(call(f"make{tid}", [1], [tid], [100]))
    out = 10
    for tid in (2, 3, 4, 2, 3, 4):
        out += 1
        ev += [call("read", [tid], [out], [10]), (RELEASE, None, out)]
    ev += [(RELEASE, None, tid) for tid in (2, 3, 4)]
    return Trace({"model": "cyclic"}, ev)


def test_knowing_the_next_read_beats_staleness_on_a_cycle():
    # Budget: the leaf, two values and one read's output. Staleness (DTR, equal costs and
    # sizes) keeps evicting the value read next: 5 recomputations. Belady's rule sends
    # b away for c (b is read after a), then misses b, a and c once each: 3.
    tr = cyclic_reads()
    budget = 100 + 2 * 100 + 10
    dtr = simulate(tr, "dtr", budget=budget, allocator="fungible")
    future = simulate(tr, "dtr-future", budget=budget, allocator="fungible")
    assert dtr.status == future.status == "ok"
    assert future.peak_bytes <= budget and dtr.peak_bytes <= budget
    assert future.remat_ops == 3 and dtr.remat_ops == 5


def test_read_times_follow_copies_gets_and_new_versions():
    ev = [(PUT, None, 1, 8, "leaf"),
          call("f", [1], [2], [8]),        # call 0
          (COPY, None, 2, 3),              # 3 is another name of 2
          call("g", [3], [4], [8]),        # call 1 reads 2's value
          (GET, None, 4),                  # the program reads 4 between calls 1 and 2
          call("add_", [2, 4], [], [], mut=[0]),  # call 2 writes 2: a new version
          call("h", [2], [5], [8]),        # call 3 reads the new version
          (RELEASE, None, 4)]
    reads, inputs_of, results_of = read_times(ev)
    leaf, two, four, two_v2, five = 0, 1, 2, 3, 4
    assert inputs_of == [[leaf], [two], [two, four], [two_v2]]
    assert results_of == [[two], [four], [two_v2], [five]]
    assert reads[leaf] == [0, 4]   # held to the end (4 calls)
    assert reads[two] == [1, 2, 4]  # 3 still names the first version at the end
    assert reads[four] == [1.5, 2]
    assert reads[two_v2] == [3, 4] and reads[five] == [4]


def test_its_schedule_is_a_candidate_and_replays_as_a_plan():
    tr = cyclic_reads()
    budget = 100 + 2 * 100 + 10
    assert ({"dtr-future", "dtr-future-stale", "dtr-future-time"}
            <= set(dict(schedules(tr, budget, "dtr"))))
    r = run_schedule(tr, budget, "dtr-future", "dtr-future")
    again = simulate(tr, "dtr", budget=budget, plan=r.eviction_plan)
    assert again.status == "ok" and again.executed_cost == r.executed_cost
    assert again.remat_ops == r.remat_ops == 3


def test_a_live_session_refuses_it_and_says_where_it_works():
    with pytest.raises(MembudgetError, match="recorded step"):
        membudget.budget("10 MB", policy="dtr-future")


def test_by_time_the_distance_counts_the_ops_cost_not_their_number():
    # a (cost 3) and b (cost 1) from one leaf; c needs one of them to go. b is read one
    # call on, a three calls on but after an op of cost 1000. Counting calls, b scores
    # 1 / (m · 2) against a's 3 / (m · 4): b goes. Counting time, a's read is much
    # further off than b's: a goes.
    ev: list = [(PUT, None, 1, 100, "leaf"), call("a", [1], [2], [100], cost=3),
                call("b", [1], [3], [100]), call("c", [1], [4], [100]),
                call("read_b", [3], [5], [1]), (RELEASE, None, 5),
                call("slow", [4], [6], [1], cost=1000), (RELEASE, None, 6),
                call("read_a", [2], [7], [1]), (RELEASE, None, 7)]
    ev += [(RELEASE, None, t) for t in (2, 3, 4)]
    tr = Trace({"model": "costs"}, ev)
    first = {}
    for name in ("dtr-future", "dtr-future-time"):
        r = run_schedule(tr, 100 + 2 * 100 + 10, name, name)
        assert r.status == "ok" and r.peak_bytes <= 310
        first[name] = r.eviction_plan.before[2][0]
    assert first == {"dtr-future": (1, 0), "dtr-future-time": (0, 0)}
