"""A proven lower bound on the recomputation any schedule of a step needs under a budget.

The relaxation (ours; exact where it is tight): for each evictable value and each open gap
between two times it is needed, a 0/1 choice ``y`` = "not resident somewhere in this gap".
Dropping costs the value's share of its call's cost (the value must be made again before
its next need); keeping it resident costs its bytes at every stage inside the gap. Each stage
``k`` whose bytes with nothing dropped exceed the budget needs dropped bytes covering the
excess. Every real schedule induces such a choice that costs it no more than the schedule
pays and satisfies every stage, so the integer program's optimum, and any dual bound on it,
is a lower bound. Recomputing a value needs its call's inputs, and an input the program
has released is gone, so dropping the value also runs that input's call again (and so on
up its released ancestors): one 0/1 column per such call, at its whole cost, which every
dropping that needs it switches on (``y <= w``); such a run is never one that a dropping of
the call's own outputs is charged for (see :func:`_released_ancestors`). What it still
leaves out (inputs the program holds but a schedule dropped, and the memory a
recomputation holds for a moment) is what makes a real schedule cost more.

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
MAX_ANCESTORS = 64  # calls linked to one column: keeps the program near linear in size


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
    entries: list[tuple[list[int], list[float]]] = []  # per LP column: its rows, coefficients
    costs, used = [], []
    for c, (v, _, _, lo, hi) in enumerate(cols):
        rows = row_of_seg[seg_of[lo]:seg_of[hi] + 1]
        rows = rows[rows >= 0]
        if len(rows) == 0:
            continue
        entries.append((rows.tolist(), [v.nbytes / MIB] * len(rows)))
        costs.append(v.weight)
        used.append(c)
    # the released ancestors a drop must make again: a column per call, y_j <= w_c
    n_rows = len(need)
    linked: dict[int, list[int]] = {}
    for j, closure in enumerate(_released_ancestors(problem, [cols[c] for c in used])):
        for call in closure:
            entries[j][0].append(n_rows)
            entries[j][1].append(-1.0)
            linked.setdefault(call, []).append(n_rows)
            n_rows += 1
    for call, rows_of in linked.items():
        entries.append((rows_of, [1.0] * len(rows_of)))
        costs.append(float(problem.cost[call]))
    starts = np.cumsum([0] + [len(r) for r, _ in entries])
    lp = highspy.HighsLp()
    lp.num_col_ = len(entries)
    lp.num_row_ = n_rows
    lp.col_cost_ = np.array(costs, dtype=float)
    lp.col_lower_ = np.zeros(len(entries))
    lp.col_upper_ = np.ones(len(entries))
    lp.row_lower_ = np.concatenate((seg_excess[need] / MIB, np.zeros(n_rows - len(need))))
    lp.row_upper_ = np.full(n_rows, highspy.kHighsInf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = starts.astype(np.int32)
    lp.a_matrix_.index_ = np.array([i for r, _ in entries for i in r], dtype=np.int32)
    lp.a_matrix_.value_ = np.array([x for _, xs in entries for x in xs], dtype=float)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * len(entries)
    h, bound = lp_then_mip(lp, time_limit - (time.perf_counter() - t0), threads)
    info = h.getInfo()
    status = h.getModelStatus()
    drops: list[Drop] = []
    if info.primal_solution_status == highspy.kSolutionStatusFeasible:
        x = h.getSolution().col_value
        drops = [Drop(cols[c][0], cols[c][1], cols[c][2])  # (the drop columns come first)
                 for c, xv in zip(used, x[:len(used)], strict=True) if xv > 0.5]
    exact = status == highspy.HighsModelStatus.kOptimal
    return BoundResult(max(0.0, bound), exact, drops, min_budget, True, n_rows, len(entries),
                       time.perf_counter() - t0)


def _released_ancestors(problem: RematProblem,
                        cols: list[tuple[Value, float, float, int, int]]) -> list[list[int]]:
    """For each column (value ``v`` dropped in the gap ``(a, b)``), calls that any schedule
    dropping it must also run again, each at a time no dropping column of that call's own
    outputs can use: ``v``'s call reads input ``u`` at the recomputation (after ``a``), and
    ``u`` is gone if the program released it by then (released values are evicted at once).
    So ``u``'s call runs after ``u``'s release; when that is after every need of its call's
    outputs, the run is not one any of their columns is charged for. The same holds, from
    that run on, for the inputs of ``u``'s call released by ``u``'s release. At most
    :data:`MAX_ANCESTORS` calls per column (any subset keeps the bound valid)."""
    values = problem.values
    reads = [[values[k] for k in ks] for ks in problem.reads()]
    last_need = [-math.inf] * problem.n  # the latest need of any output of each call
    for v in values:
        last_need[v.call] = max(last_need[v.call], v.last_need)

    def gone_by(u: Value, when: float) -> bool:
        return u.released <= when and u.released > last_need[u.call]

    links = []
    for v, a, _, _, _ in cols:
        calls: set[int] = set()
        todo = [u for u in reads[v.call] if gone_by(u, a)]
        while todo and len(calls) < MAX_ANCESTORS:
            u = todo.pop()
            if u.call not in calls:
                calls.add(u.call)
                todo.extend(x for x in reads[u.call] if gone_by(x, u.released))
        links.append(sorted(calls))
    return links
