"""A proven lower bound on the recomputation any schedule of a step needs under a budget.

The relaxation (ours; exact where it is tight): for each evictable value and each open gap
between two times it is needed, a 0/1 choice ``y`` = "not resident somewhere in this gap".
Dropping costs the value's share of its call's cost (the value must be made again before
its next need); keeping it resident costs its bytes at every stage inside the gap. Each stage
``k`` whose bytes with nothing dropped exceed the budget needs dropped bytes covering the
excess. Every real schedule induces such a choice that costs it no more than the schedule
pays and satisfies every stage, so the integer program's optimum, and any dual bound on it,
is a lower bound. What it leaves out (recomputing a value needs its inputs resident, and
a dropped input made again) is what makes a real schedule cost more.

Solved with HiGHS. Stages whose covering values are the same are merged into one row (the
largest excess), so the program has one row per change in the set of gaps, not per call.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from membudget.plan.mip_backends import lp_then_mip
from membudget.plan.remat_problem import RematProblem, Value

MIB = float(1 << 20)  # rows in MiB keep the coefficients near 1


@dataclass
class Drop:
    """``value`` is dropped in the gap ``(start, end)`` between two of its needs."""

    value: Value
    start: float
    end: float


@dataclass
class BoundResult:
    """``cost``: the bound on recomputation cost (the program's dual bound); ``exact``: the
    program was solved to optimality (its solution's cost equals the bound); ``drops``: the
    best solution found (empty when none); ``min_budget``: the least budget the relaxation
    admits (a budget below it is infeasible for every schedule)."""

    cost: float
    exact: bool
    drops: list[Drop]
    min_budget: int
    feasible: bool
    rows: int
    columns: int
    seconds: float


def _columns(problem: RematProblem) -> list[tuple[Value, float, float, int, int]]:
    """Each (value, gap) with at least one stage strictly inside it: (value, start, end,
    first stage, last stage)."""
    n = problem.n
    cols = []
    for v in problem.values:
        for a, b in v.gaps():
            lo, hi = math.floor(a) + 1, min(n - 1, math.ceil(b) - 1)
            if lo <= hi:
                cols.append((v, a, b, lo, hi))
    return cols


def lower_bound(problem: RematProblem, budget: int, time_limit: float = 10.0,
                threads: int = 2) -> BoundResult:
    """Solve the relaxation for ``budget`` bytes within ``time_limit`` seconds."""
    import highspy

    t0 = time.perf_counter()
    n = problem.n
    live = problem.live_bytes()
    cols = _columns(problem)
    # what dropping everything droppable leaves at each stage: the least budget admitted
    cover = np.zeros(n + 1, dtype=np.int64)
    for v, _, _, lo, hi in cols:
        cover[lo] += v.nbytes
        cover[hi + 1] -= v.nbytes
    floor_bytes = live - np.cumsum(cover[:-1])
    min_budget = int(floor_bytes.max()) if n else 0
    excess = live - budget
    if min_budget > budget:
        return BoundResult(math.inf, True, [], min_budget, False, 0, len(cols),
                           time.perf_counter() - t0)
    if n == 0 or excess.max() <= 0:
        return BoundResult(0.0, True, [], min_budget, True, 0, 0, time.perf_counter() - t0)
    # segments between the stages where some gap starts or ends: one covering set each
    cuts = np.unique(np.array([0, n] + [lo for *_, lo, _ in cols] + [hi + 1 for *_, hi in cols],
                              dtype=np.int64))
    cuts = cuts[cuts <= n]
    seg_of = np.searchsorted(cuts, np.arange(n), side="right") - 1
    seg_excess = np.full(len(cuts) - 1, -1, dtype=np.int64)
    np.maximum.at(seg_excess, seg_of, excess)
    row_of_seg = np.full(len(seg_excess), -1, dtype=np.int64)
    need = np.flatnonzero(seg_excess > 0)
    row_of_seg[need] = np.arange(len(need))
    # keep the columns that cover a row with an excess; each covers a run of segments
    starts, index, values, costs, used = [], [], [], [], []
    for c, (v, _, _, lo, hi) in enumerate(cols):
        rows = row_of_seg[seg_of[lo]:seg_of[hi] + 1]
        rows = rows[rows >= 0]
        if len(rows) == 0:
            continue
        starts.append(len(index))
        index.extend(rows.tolist())
        values.extend([v.nbytes / MIB] * len(rows))
        costs.append(v.weight)
        used.append(c)
    starts.append(len(index))
    lp = highspy.HighsLp()
    lp.num_col_ = len(used)
    lp.num_row_ = len(need)
    lp.col_cost_ = np.array(costs, dtype=float)
    lp.col_lower_ = np.zeros(len(used))
    lp.col_upper_ = np.ones(len(used))
    lp.row_lower_ = seg_excess[need] / MIB
    lp.row_upper_ = np.full(len(need), highspy.kHighsInf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(values, dtype=float)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * len(used)
    h, bound = lp_then_mip(lp, time_limit - (time.perf_counter() - t0), threads)
    info = h.getInfo()
    status = h.getModelStatus()
    drops: list[Drop] = []
    if info.primal_solution_status == highspy.kSolutionStatusFeasible:
        x = h.getSolution().col_value
        drops = [Drop(cols[c][0], cols[c][1], cols[c][2]) for c, xv in zip(used, x, strict=True)
                 if xv > 0.5]
    exact = status == highspy.HighsModelStatus.kOptimal
    return BoundResult(max(0.0, bound), exact, drops, min_budget, True, len(need), len(used),
                       time.perf_counter() - t0)
