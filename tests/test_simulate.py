"""simulate() and measure_baseline() on small hand-made traces with hand-derived outcomes."""

from __future__ import annotations

import pytest

from membudget.core.policies import POLICIES
from membudget.errors import MembudgetError, UnknownNameError
from membudget.sim import measure_baseline, simulate
from membudget.trace.format import CALL, COPY, GET, PHASE, PUT, RELEASE, Trace


def call(op, ins, outs, nbytes, cost, alias=None, mut=()):
    alias = tuple(alias) if alias is not None else (-1,) * len(outs)
    return (CALL, None, op, tuple(ins), tuple(outs), tuple(nbytes), alias, float(cost),
            tuple(mut))


# The example of docs/trace-format.md: baseline cost 29 800, peak 20 484 B.
DOC = Trace({"model": "doc"}, [
    (PUT, None, 1, 4096, "param"),
    (PUT, None, 2, 8192, "input"),
    (PHASE, None, "forward"),
    call("mm", [2, 1], [3], [8192], 12000),
    (COPY, None, 2, 4),
    (RELEASE, None, 2),
    call("view", [3], [5], [0], 800, alias=[0]),
    (RELEASE, None, 3),
    call("sum", [5], [6], [4], 3000),
    (RELEASE, None, 5),
    (PHASE, None, "backward"),
    call("mm_backward", [6, 4], [7], [4096], 12000),
    (RELEASE, None, 4),
    call("sgd_", [1, 7], [], [], 2000, mut=[0]),
    (RELEASE, None, 7),
    (GET, None, 6),
])

# x0 (leaf) -> x1 (cost 10) -> x2 (cost 20) -> x3 (cost 30), 100 B each, all kept; x1 is read.
CHAIN = Trace({"model": "chain"}, [
    (PUT, None, 1, 100, "leaf"),
    call("f", [1], [2], [100], 10),
    call("g", [2], [3], [100], 20),
    call("h", [3], [4], [100], 30),
    (GET, None, 2),
])


def test_baselines():
    b = measure_baseline(DOC)
    assert (b.cost, b.peak_bytes, b.ops) == (29_800, 20_484, 5)
    b = measure_baseline(CHAIN)
    assert (b.cost, b.peak_bytes, b.ops) == (60, 400, 3)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("semantics", ["membudget", "simrd"])
def test_ratio_one_is_ok_without_recomputation(policy, semantics):
    # At the baseline peak nothing needs evicting: under a budget the released input (held
    # through handle 4) and the old weight stay resident, but the bytes live at once never
    # exceed 20 484 (weight, input, mm output, loss; later weight, input, grad, new weight).
    r = simulate(DOC, policy, ratio=1.0, semantics=semantics)
    assert r.status == "ok", r.message
    assert r.semantics == semantics and r.policy == policy and r.trace == "doc"
    assert r.budget_bytes == r.baseline_peak_bytes == 20_484
    assert r.peak_bytes == 20_484
    assert r.evictions == 0 and r.remat_ops == 0 and r.remat_cost == 0
    assert r.overhead == 0 and r.executed_cost == r.baseline_cost == 29_800
    assert r.ops == 5 and r.needed_bytes is None
    assert set(r.to_json()) >= {"status", "overhead", "peak_bytes", "search_us"}


def test_oom_when_the_first_allocation_cannot_fit():
    r = simulate(CHAIN, "dtr-eq", budget=50)
    assert r.status == "oom"
    assert r.needed_bytes == 100 and r.needed_bytes > r.budget_bytes == 50
    assert "100" in r.message and r.peak_bytes == 0


def test_oom_when_the_first_op_cannot_fit():
    # The leaf (100 B, pinned) fits in 150; f's input is locked and f needs 100 more.
    r = simulate(CHAIN, "lru", budget=150)
    assert r.status == "oom"
    assert r.needed_bytes == 200 > r.budget_bytes
    assert r.ops == 0 and r.peak_bytes == 100


def test_overhead_is_executed_over_baseline_minus_one():
    # Budget 300 = leaf + 2, LRU. h evicts x1; reading x1 recomputes f (10) and evicts x2;
    # at the end the held x2 is recomputed (g, 20, evicting x3), then x3 (h, 30, evicting x1).
    r = simulate(CHAIN, "lru", ratio=0.75, overhead_limit=None)
    assert r.status == "ok" and r.budget_bytes == 300
    assert r.remat_ops == 3 and r.remat_cost == 60 and r.evictions == 4
    assert r.executed_cost == 120
    assert r.overhead == pytest.approx(r.executed_cost / r.baseline_cost - 1) == 1.0
    assert r.peak_bytes == 300


def test_overhead_limit_marks_thrashing():
    # limit = baseline cost × (overhead_limit - 1): 60 × 0.5 = 30. After g's recomputation
    # the recomputation cost is 30 (not above), after h's it is 60: thrashed.
    r = simulate(CHAIN, "lru", ratio=0.75, overhead_limit=1.5)
    assert r.status == "thrashed" and r.remat_cost == 60
    assert "60" in r.message and "30" in r.message
    # The default limit (2.0) allows recomputation up to the baseline cost: 60 is not over.
    assert simulate(CHAIN, "lru", ratio=0.75).status == "ok"


def test_a_deadline_passed_stops_the_run_at_its_next_search_for_room():
    import time

    r = simulate(CHAIN, "lru", ratio=0.75, deadline=time.perf_counter())
    assert r.status == "timeout" and "out of time" in r.message
    # with no allocation that needs room, a passed deadline stops nothing
    assert simulate(CHAIN, "lru", ratio=1.0, deadline=time.perf_counter()).status == "ok"
    assert simulate(CHAIN, "lru", ratio=0.75).status == "ok"


def test_past_its_deadline_the_schedules_compared_are_the_policys_alone():
    import time

    from membudget.sim.schedules import schedules

    runs = dict(schedules(DOC, 20_484, "dtr", until=time.perf_counter()))
    assert list(runs) == ["dtr"] and runs["dtr"].status == "ok"
    assert {"dtr", "dtr-eq", "msps", "chen-sqrt"} <= set(dict(schedules(DOC, 20_484, "dtr")))
    from membudget.sim.schedules import cheapest
    assert cheapest(DOC, 20_484, "dtr", time_limit=0).eviction_plan.source == "dtr"


def test_simrd_keeps_released_leaves_resident():
    # A 100 B leaf released with nothing computed from it, then another 100 B leaf.
    # Baseline peak 100. membudget frees the first; simrd keeps released pinned storages.
    tr = Trace({"model": "leaves"}, [(PUT, None, 1, 100, "leaf"), (RELEASE, None, 1),
                                     (PUT, None, 2, 100, "leaf")])
    assert simulate(tr, "dtr", ratio=1.0).status == "ok"
    r = simulate(tr, "dtr", ratio=1.0, semantics="simrd")
    assert r.status == "oom" and r.needed_bytes == 200


def test_simrd_semantics_runs_with_evictions():
    r = simulate(CHAIN, "dtr-eq", ratio=0.75, semantics="simrd", overhead_limit=None)
    assert r.status == "ok" and r.semantics == "simrd"
    assert r.peak_bytes <= 300 and r.remat_ops > 0
    assert r.overhead == pytest.approx(r.executed_cost / r.baseline_cost - 1)


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(UnknownNameError) as ei:
        simulate(CHAIN, "belady", ratio=0.5)
    msg = str(ei.value)
    assert "'belady'" in msg
    for name in POLICIES:
        assert name in msg
    assert ei.value.known == sorted([*POLICIES, "default"])
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("kwargs", [
    {}, {"ratio": 0.5, "budget": 100}, {"ratio": 0}, {"ratio": -1}, {"budget": -1},
    {"ratio": 0.5, "semantics": "tvm"},
])
def test_bad_arguments(kwargs):
    with pytest.raises(MembudgetError):
        simulate(CHAIN, "lru", **kwargs)


def test_given_baseline_is_used():
    base = measure_baseline(CHAIN)
    r = simulate(CHAIN, "lru", ratio=0.75, baseline=base, overhead_limit=None)
    assert r.baseline_cost == base.cost and r.budget_bytes == int(base.peak_bytes * 0.75)


def test_a_slow_candidate_does_not_starve_the_others(monkeypatch):
    # A stand-in for dtr runs until its deadline and times out; the others finish at once.
    # Each gets a share of the time first, so all of them run; dtr then runs again with
    # all the time left, and is still reported as stopped.
    import time
    from dataclasses import replace

    from membudget.sim import schedules as sched

    real = sched.run_schedule
    deadlines: list[float] = []

    def fake(trace, budget, source, policy, plan=None, **kw):
        if source == "dtr":
            deadlines.append(kw["deadline"])
            time.sleep(max(0.0, kw["deadline"] - time.perf_counter()))
            return replace(real(trace, budget, source, policy, plan, **kw), status="timeout")
        return real(trace, budget, source, policy, plan, **kw)

    list(sched.schedules(DOC, 20_484, "dtr-eq"))  # (the first run's imports take a second)
    monkeypatch.setattr(sched, "run_schedule", fake)
    until = time.perf_counter() + 1.0
    runs = list(sched.schedules(DOC, 20_484, "dtr-eq", until=until))
    status = dict((source, r.status) for source, r in runs)
    assert status.pop("dtr") == "timeout" and len(deadlines) == 2
    assert deadlines[0] < until and deadlines[1] == until
    assert {"msps", "dtr-future", "dtr-future-stale"} <= set(status)
    assert set(status.values()) == {"ok"}
