"""The optimum: its bounds never exceed, and its schedules never beat, the brute-force optimum.

The brute force is a shortest path over (next call, resident set): drop anything, run again
any earlier call whose inputs are resident, or run the next call, never above the budget.
It is written here from the problem's definition, apart from the solvers it checks. As in
the engine, a value the program releases is evicted then (made again later, it may stay).
"""

from __future__ import annotations

import heapq
import json
import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from membudget.cli import app
from membudget.plan import checkmate
from membudget.plan.optimum import BudgetInfeasible, optimum
from membudget.plan.remat_bound import lower_bound
from membudget.plan.remat_problem import RematProblem, remat_problem
from membudget.sim import measure_baseline, simulate
from membudget.sim.simulate import Baseline
from membudget.trace.format import CALL, PHASE, PUT, RELEASE, Trace, write_trace

LOGS = Path(__file__).resolve().parents[1].parent / "shared" / "dtr-logs" / "logs.zip"
needs_logs = pytest.mark.skipif(not LOGS.is_file(), reason=f"{LOGS} is missing")


def call(op, ins, outs, nbytes, cost):
    return (CALL, None, op, tuple(ins), tuple(outs), tuple(nbytes), (-1,) * len(outs),
            float(cost), ())


def tiny_step(seed: int, layers: int = 4) -> Trace:
    """A forward chain with random skips, sizes and costs, and its backward: each forward
    value is held until the backward op that reads it, each gradient until consumed."""
    rng = random.Random(seed)
    ev: list = [(PUT, None, 1, 64, "input"), (PHASE, None, "forward")]
    acts, tid = [1], 1
    for i in range(layers):
        tid += 1
        ins = [acts[-1]] + ([acts[-2]] if len(acts) > 1 and rng.random() < 0.3 else [])
        ev.append(call(f"f{i}", ins, [tid], [rng.choice([64, 128, 192, 256])],
                       rng.choice([1, 2, 5, 10])))
        acts.append(tid)
    backward(ev, acts, tid, lambda: rng.choice([1, 2, 5]))
    return Trace({"model": f"tiny{seed}"}, ev)


def backward(ev: list, acts: list[int], tid: int, cost: Callable[[], float]) -> None:
    """The backward of a forward chain whose activations are ``acts``: each op reads the
    gradient so far and one activation (held until then), ids from ``tid + 1`` on."""
    ev.append((PHASE, None, "backward"))
    tid += 1
    ev.append(call("loss_grad", [acts[-1]], [tid], [64], 1))
    grad = tid
    ev.append((RELEASE, None, acts[-1]))
    for i in range(len(acts) - 2, -1, -1):
        tid += 1
        ev.append(call(f"b{i}", [grad, acts[i]], [tid], [64], cost()))
        ev.append((RELEASE, None, grad))
        if i > 0:
            ev.append((RELEASE, None, acts[i]))
        grad = tid


def brute_force(p: RematProblem, budget: int) -> float:
    """The least recomputation cost of any schedule, or inf if none fits."""
    n, vals = p.n, p.values
    outs: list[frozenset[int]] = [frozenset(k for k, v in enumerate(vals) if v.call == i)
                                  for i in range(n)]
    ins: list[frozenset[int]] = [frozenset(k for k, v in enumerate(vals) if i in v.needs
                                           and v.call != i) for i in range(n)]
    at_end = frozenset(k for k, v in enumerate(vals) if n in v.needs)
    size = [v.nbytes for v in vals]
    gone = [frozenset(k for k, v in enumerate(vals) if t - 1 < v.released < t)
            for t in range(n + 1)]

    def fits(t: int, held: frozenset[int]) -> bool:
        return int(p.fixed[min(t, n - 1)]) + sum(size[k] for k in held) <= budget

    start = (0, frozenset())
    best = {start: 0.0}
    heap = [(0.0, 0, frozenset())]
    while heap:
        c, t, held = heapq.heappop(heap)
        if best.get((t, held), float("inf")) < c:
            continue
        if t == n and at_end <= held:
            return c
        moves = [(c, t, held - {k}) for k in held]
        for i in range(min(t, n)):
            if outs[i] and ins[i] <= held and fits(t, held | outs[i]):
                moves.append((c + float(p.cost[i]), t, held | outs[i]))
        if t < n and ins[t] <= held and fits(t, held | outs[t]):
            # the engine evicts what the program releases (made again later, it may stay)
            moves.append((c, t + 1, (held | outs[t]) - gone[t + 1]))
        for c2, t2, h2 in moves:
            if c2 < best.get((t2, h2), float("inf")):
                best[(t2, h2)] = c2
                heapq.heappush(heap, (c2, t2, h2))
    return float("inf")


def test_the_problem_holds_what_the_baseline_holds():
    tr = tiny_step(0, layers=5)
    p = remat_problem(tr)
    base = measure_baseline(tr)
    assert p.base_cost == base.cost
    assert p.live_bytes().max() == base.peak_bytes
    assert p.n == 11 and len(p.values) == 11


@pytest.mark.parametrize("seed", range(12))
def test_bounds_and_schedules_bracket_the_brute_force_optimum(seed):
    tr = tiny_step(seed)
    p = remat_problem(tr)
    base = measure_baseline(tr)
    floor = int(p.required_bytes().max())
    for budget in sorted({floor, (floor + base.peak_bytes) // 2, base.peak_bytes - 64}):
        best = brute_force(p, budget)
        relax = lower_bound(p, budget, time_limit=5)
        cm = checkmate.solve(p, budget, time_limit=5)
        assert relax.cost <= best + 1e-6, (budget, relax.cost, best)
        assert cm.exact and cm.bound <= best + 1e-6, (budget, cm.bound, best)
        try:
            r = optimum(tr, budget=budget, time_limit=10, problem=p, baseline=base)
        except BudgetInfeasible:  # the relaxation proved it: so must the brute force
            assert best == float("inf")
            continue
        assert r.lower_bound * base.cost <= best + 1e-6
        # the static checkpointing a user would pick is among the schedules compared
        assert {"chen-sqrt", "min-cut"} <= {c.source for c in r.candidates}
        if r.overhead is not None:  # a schedule the simulator ran: never below the optimum
            assert r.overhead * base.cost >= best - 1e-6
            check = simulate(tr, "lru", budget=budget, baseline=base, plan=r.plan)
            assert check.status == "ok" and check.overhead == pytest.approx(r.overhead)
            assert check.peak_bytes <= budget


def step_with_temporaries(seed: int, layers: int = 3) -> Trace:
    """Each forward layer makes a temporary the program releases at once (as a pointwise
    op's input nobody saves) and the activation backward reads: making an activation again
    means making its temporary again too."""
    rng = random.Random(seed)
    ev: list = [(PUT, None, 1, 64, "input"), (PHASE, None, "forward")]
    acts, tid = [1], 1
    for i in range(layers):
        ev.append(call(f"t{i}", [acts[-1]], [tid + 1], [rng.choice([64, 128])],
                       rng.choice([2, 5, 10])))
        ev.append(call(f"f{i}", [tid + 1], [tid + 2], [rng.choice([64, 128, 192])],
                       rng.choice([1, 2])))
        ev.append((RELEASE, None, tid + 1))
        tid += 2
        acts.append(tid)
    backward(ev, acts, tid, lambda: 1)
    return Trace({"model": f"temps{seed}"}, ev)


def test_dropping_a_value_counts_its_released_inputs(monkeypatch):
    """The relaxation charges a dropped value the calls of its inputs the program has
    released (they must run again first): still a bound on every schedule, and higher
    than charging the value's own call alone."""
    import membudget.plan.remat_bound as remat_bound

    raised = 0
    for seed in range(8):
        tr = step_with_temporaries(seed)
        p = remat_problem(tr)
        floor = int(p.required_bytes().max())
        peak = int(p.live_bytes().max())
        for budget in sorted({floor, (floor + peak) // 2, peak - 64}):
            best = brute_force(p, budget)
            relax = lower_bound(p, budget, time_limit=5)
            assert relax.exact and relax.cost <= best + 1e-6, (seed, budget, relax.cost, best)
            with monkeypatch.context() as m:
                m.setattr(remat_bound, "MAX_ANCESTORS", 0)
                alone = lower_bound(p, budget, time_limit=5)
            assert alone.cost <= relax.cost + 1e-9
            raised += relax.cost > alone.cost + 1e-9
    assert raised >= 4


def halfway(seed: int) -> tuple[Trace, RematProblem, Baseline, int]:
    """A tiny step, its problem and baseline, and a budget halfway between the least any
    schedule needs and the unconstrained peak."""
    tr = tiny_step(seed)
    p = remat_problem(tr)
    base = measure_baseline(tr)
    return tr, p, base, (int(p.required_bytes().max()) + base.peak_bytes) // 2


def test_on_a_chain_the_optimum_is_proven():
    proven = 0
    for seed in range(12):
        tr, p, base, budget = halfway(seed)
        r = optimum(tr, budget=budget, time_limit=10, problem=p, baseline=base)
        best = brute_force(p, budget)
        if r.proven:
            proven += 1
            assert r.overhead * base.cost == pytest.approx(best, abs=1e-6)
    assert proven >= 8  # most tiny steps close: Checkmate's schedule is the brute force's


def test_a_planner_thread_solves_with_one_highs_thread_and_finds_the_same_optimum():
    """A planned session's planner calls HiGHS from a short-lived thread; there HiGHS gets one
    thread (its workers could outlive the thread: upstream crashes and hangs), and the
    proven optimum is the main thread's."""
    from membudget.plan.mip_backends import highs_threads

    for seed in range(3):
        tr, p, base, budget = halfway(seed)
        here = optimum(tr, budget=budget, time_limit=10, problem=p, baseline=base)
        got: dict[str, object] = {}

        def plan(tr=tr, p=p, base=base, budget=budget, got=got) -> None:
            got["threads"] = highs_threads(2)
            got["r"] = optimum(tr, budget=budget, time_limit=10, problem=p, baseline=base)

        t = threading.Thread(target=plan)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive() and got["threads"] == 1 and highs_threads(2) == 2
        there = got["r"]
        assert there.proven == here.proven  # type: ignore[attr-defined]
        if here.proven:
            assert there.overhead == pytest.approx(here.overhead)  # type: ignore[attr-defined]


def test_a_budget_below_every_schedule_names_the_minimum():
    tr = tiny_step(1)
    p = remat_problem(tr)
    floor = int(p.required_bytes().max())
    with pytest.raises(BudgetInfeasible, match=f"give --budget {floor}"):
        optimum(tr, budget=floor - 1, time_limit=5)
    assert brute_force(p, floor - 1) == float("inf")


def test_the_cli_prints_the_json_fields(tmp_path):
    tr = tiny_step(3)
    path = tmp_path / "t.jsonl"
    write_trace(path, tr.header, tr.events)
    res = CliRunner().invoke(app, ["optimum", str(path), "--ratio", "0.7", "--time-limit", "5",
                                   "--json", "--plan-out", str(tmp_path / "plan.json")])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output)
    for key in ("status", "overhead", "lower_bound", "proven", "seconds", "gap"):
        assert key in obj
    assert obj["lower_bound"] <= obj["overhead"] + 1e-9
    assert json.loads((tmp_path / "plan.json").read_text())["before"]


def test_a_checkmate_milp_too_large_to_run_is_named_not_called_a_timeout(tmp_path, monkeypatch):
    """Where Checkmate's MILP is above the size it is run at, the output says so; it used to
    print "(time limit reached)" long before the time limit."""
    import membudget.plan.optimum as optimum_module

    monkeypatch.setattr(optimum_module, "CHECKMATE_MAX_VARIABLES", 0)
    tr = tiny_step(3)
    path = tmp_path / "t.jsonl"
    write_trace(path, tr.header, tr.events)
    res = CliRunner().invoke(app, ["optimum", str(path), "--ratio", "0.7", "--time-limit", "30"])
    assert res.exit_code == 0, res.output
    assert "Checkmate's MILP not run" in res.output and "time limit reached" not in res.output
    r = optimum(tr, ratio=0.7, time_limit=30)
    assert "checkmate" not in r.bounds and r.checkmate_variables > 0 and not r.timed_out
    assert r.seconds < 15


def test_the_cli_refuses_an_infeasible_budget_with_the_minimum(tmp_path):
    tr = tiny_step(3)
    path = tmp_path / "t.jsonl"
    write_trace(path, tr.header, tr.events)
    res = CliRunner().invoke(app, ["optimum", str(path), "--budget", "10"])
    assert res.exit_code == 1
    assert "give --budget" in res.output


@needs_logs
def test_on_a_dtr_log_the_bound_is_below_every_policy():
    from membudget.trace import load_trace
    tr = load_trace(f"{LOGS}::resnet32")
    r = optimum(tr, ratio=0.5, time_limit=20)
    assert r.overhead is not None and r.lower_bound <= r.overhead
    for pol in ("dtr-eq", "dtr", "msps"):
        s = simulate(tr, pol, ratio=0.5, allocator="fungible", inplace="cow")
        assert s.status != "ok" or s.overhead >= r.lower_bound


def test_a_value_pinned_then_read_is_counted_once():
    """A value the program pins (an optimizer's write) is fixed memory from then on; its
    later reads must not count it again as an evictable value (that made a bound exceed a
    real schedule on resnet-50)."""
    from membudget.trace.format import PIN
    tr = Trace({"model": "pinned"}, [
        (PUT, None, 1, 64, "input"),
        call("f", [1], [2], [256], 5),
        (PIN, None, 2, False),
        call("g", [2], [3], [128], 5),
        call("h", [2, 3], [4], [64], 5),
        (RELEASE, None, 3),
    ])
    p = remat_problem(tr)
    assert p.live_bytes().max() == measure_baseline(tr).peak_bytes
    assert [(v.call, v.needs) for v in p.values if v.call == 0] == [(0, [0.5])]


def test_a_cheaper_schedule_run_elsewhere_becomes_the_best_with_the_same_rules():
    from dataclasses import replace

    tr = tiny_step(3)
    r = optimum(tr, budget=measure_baseline(tr).peak_bytes - 64, time_limit=10)
    r = replace(r, overhead=0.5, lower_bound=0.2, gap=0.6, proven=False, status="feasible")
    assert r.beside("elsewhere", 0.6) is r  # dearer: nothing changes
    b = r.beside("elsewhere", 0.4)
    assert (b.best, b.gap, b.proven, b.status, b.plan) == ("elsewhere", 0.5, False,
                                                           "feasible", None)
    b = r.beside("elsewhere", 0.2)  # at the bound: proven
    assert (b.gap, b.proven, b.status) == (0.0, True, "optimal")
