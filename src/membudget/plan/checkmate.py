"""Checkmate's MILP (Jain et al., MLSys'20) over a recorded step, solved with HiGHS.

Stage ``t`` is the window between call ``t - 1`` finishing and call ``t`` finishing:
``R[t, i]`` = call ``i < t`` is run again in that window (before call ``t``), ``S[t, v]`` =
value ``v`` is resident when call ``t - 1`` has finished. The constraints are Checkmate's
(a value is resident only if it was, or was just made; a call runs only on inputs resident
or made earlier in the same window) and the objective is the recomputation cost.

Memory is Checkmate's with one deliberate relaxation, so that the program's optimum is a
*proven lower bound* on any schedule the simulator can run: at call ``t`` it counts the
fixed bytes, call ``t``'s inputs and outputs, and every value still resident after call
``t`` (each of those was resident while ``t`` ran), but not what a recomputation chain held
for a moment and freed before call ``t``. The schedule it finds is run in the simulator as
an eviction plan, which gives its real cost (an upper bound); where the two meet, the
optimum is proven.

Recomputing call ``i`` is only ever useful while something made from it is still needed,
so ``R[t, i]`` and ``S[t, v]`` exist only up to that point: this keeps every schedule the
full program has and removes variables that cannot matter. When the program releases ``v``
the engine evicts it at once, so in that window it is there only if made again (and, made
again, it may stay, as the engine keeps a recomputed value until it needs the room).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from membudget.plan.mip_backends import lp_then_mip
from membudget.plan.remat_problem import RematProblem, Value
from membudget.sim.evictions import EvictionPlan

MIB = float(1 << 20)


@dataclass
class CheckmateResult:
    """``bound``: proven lower bound on the recomputation cost; ``cost``: the cost of the
    best schedule the program found (its own accounting), or inf; ``plan``: that schedule
    as an eviction plan; ``exact``: solved to optimality."""

    bound: float
    cost: float
    exact: bool
    plan: EvictionPlan | None
    variables: int
    rows: int
    seconds: float
    timed_out: bool
    recomputes: list[tuple[int, int]] = field(default_factory=list)  # (window, call)


class _Rows:
    """Sparse rows ``lo <= sum(coef * x[idx]) <= hi`` collected for HiGHS."""

    def __init__(self) -> None:
        self.start = [0]
        self.index: list[int] = []
        self.value: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, idx: list[int], coef: list[float], lo: float, hi: float) -> None:
        self.index.extend(idx)
        self.value.extend(coef)
        self.start.append(len(self.index))
        self.lo.append(lo)
        self.hi.append(hi)


def size(problem: RematProblem) -> int:
    """The number of variables the program has for ``problem`` (to decide if it is small)."""
    horizon, value_end = _horizons(problem)
    calls = {v.call for v in problem.values}
    return (sum(max(0, horizon[i] - i) for i in calls)
            + sum(max(0, value_end[k] - v.call) for k, v in enumerate(problem.values)))


def _horizons(problem: RematProblem) -> tuple[list[int], list[int]]:
    """For each call, the last stage where running it again can matter; for each value, the
    last stage where keeping it can matter (its last need, or a need of what it feeds)."""
    n = problem.n
    last = [-1] * n  # the latest need of each call's values, as a stage
    readers: list[list[int]] = [[] for _ in range(n)]  # calls reading each call's values
    for v in problem.values:
        last[v.call] = max(last[v.call], min(n, math.ceil(v.last_need)))
        for t in v.needs:
            if t == int(t) and t < n and int(t) != v.call:
                readers[v.call].append(int(t))
    horizon = last[:]
    for i in range(n - 1, -1, -1):
        for j in readers[i]:
            horizon[i] = max(horizon[i], horizon[j])
    value_end = []
    for v in problem.values:
        end = min(n, math.ceil(v.last_need))
        for t in v.needs:
            if t == int(t) and t < n and int(t) != v.call:
                end = max(end, horizon[int(t)])
        value_end.append(end)
    return horizon, value_end


def solve(problem: RematProblem, budget: int, time_limit: float = 60.0,
          threads: int = 2) -> CheckmateResult:
    """Solve Checkmate's program for ``budget`` bytes within ``time_limit`` seconds."""
    import highspy

    t0 = time.perf_counter()
    n = problem.n
    horizon, value_end = _horizons(problem)
    values = problem.values
    outputs: list[list[int]] = [[] for _ in range(n)]
    for k, v in enumerate(values):
        outputs[v.call].append(k)
    inputs = problem.reads()  # value indices each call reads
    cost: list[float] = []
    r_var: dict[tuple[int, int], int] = {}
    for i in range(n):
        if outputs[i]:
            for t in range(i + 1, horizon[i] + 1):
                r_var[(t, i)] = len(cost)
                cost.append(float(problem.cost[i]))
    s_var: dict[tuple[int, int], int] = {}
    for k, v in enumerate(values):
        for t in range(v.call + 1, value_end[k] + 1):
            s_var[(t, k)] = len(cost)
            cost.append(0.0)
    rows = _Rows()
    inf = math.inf
    # the window each value is released in (after call k - 1, before call k: window k)
    released_in = [math.ceil(v.released) if v.released != inf else -1 for v in values]

    def present(t: int, k: int) -> tuple[list[int], float]:
        """Variables whose sum says value k is there in window t (resident or made), and
        a constant 1 when call t makes it. In the window where the program releases it
        the engine evicts it first: there only if made again."""
        v = values[k]
        if v.call == t:
            return [], 1.0
        kept = s_var.get((t, k)) if t != released_in[k] else None
        idx = [x for x in (kept, r_var.get((t, v.call))) if x is not None]
        return idx, 0.0

    # a value is resident after call t only if it was before, or was made in window t
    for (t, k), s in s_var.items():
        if t - 1 > values[k].call:
            prev, const = present(t - 1, k)
            rows.add([s, *prev], [1.0] + [-1.0] * len(prev), -inf, const)
    # a call (first run, or again) needs its inputs there; so does a pin or the step's end
    for j in range(n):
        for k in inputs[j]:
            idx, const = present(j, k)
            rows.add(idx, [1.0] * len(idx), 1.0 - const, inf)
        for t in range(j + 1, horizon[j] + 1):
            r = r_var.get((t, j))
            if r is None:
                continue
            for k in inputs[j]:
                idx, const = present(t, k)
                rows.add([*idx, r], [1.0] * len(idx) + [-1.0], -const, inf)
    for k, v in enumerate(values):
        for t in v.needs:
            if t != int(t) or t >= n:
                stage = min(n, math.ceil(t))
                idx, const = present(stage, k)
                rows.add(idx, [1.0] * len(idx), 1.0 - const, inf)
    # memory at each call: fixed, its inputs and outputs, and what stays resident after it
    held: list[list[int]] = [[] for _ in range(n)]  # values made before call t, kept after
    for t, k in s_var:
        if values[k].call < t - 1:
            held[t - 1].append(k)
    for t in range(n):
        reads = set(inputs[t])
        constant = int(problem.fixed[t]) + sum(values[k].nbytes for k in outputs[t])
        constant += sum(values[k].nbytes for k in reads)
        if constant > budget:
            return CheckmateResult(inf, inf, True, None, len(cost), len(rows.lo),
                                   time.perf_counter() - t0, False)
        kept = [k for k in held[t] if k not in reads]
        if kept:
            rows.add([s_var[(t + 1, k)] for k in kept], [values[k].nbytes / MIB for k in kept],
                     -inf, (budget - constant) / MIB)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), len(rows.lo)
    lp.col_cost_ = np.array(cost)
    lp.col_lower_ = np.zeros(len(cost))
    lp.col_upper_ = np.ones(len(cost))
    hinf = highspy.kHighsInf
    lp.row_lower_ = np.array([x if x > -inf else -hinf for x in rows.lo])
    lp.row_upper_ = np.array([x if x < inf else hinf for x in rows.hi])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(rows.start, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(rows.index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(rows.value)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * len(cost)
    h, bound = lp_then_mip(lp, time_limit - (time.perf_counter() - t0), threads)
    info = h.getInfo()
    status = h.getModelStatus()
    seconds = time.perf_counter() - t0
    if status == highspy.HighsModelStatus.kInfeasible or bound == inf:
        return CheckmateResult(inf, inf, True, None, len(cost), len(rows.lo), seconds, False)
    plan, found, recomputes = None, inf, []
    if info.primal_solution_status == highspy.kSolutionStatusFeasible:
        x = np.asarray(h.getSolution().col_value) > 0.5
        found = info.objective_function_value
        plan = _plan(values, n, x, r_var, s_var)
        recomputes = sorted(key for key, i in r_var.items() if x[i])
    return CheckmateResult(max(0.0, bound), found, status == highspy.HighsModelStatus.kOptimal,
                           plan, len(cost), len(rows.lo), seconds,
                           status == highspy.HighsModelStatus.kTimeLimit, recomputes)


def _plan(values: list[Value], n: int, x: np.ndarray, r_var: dict[tuple[int, int], int],
          s_var: dict[tuple[int, int], int]) -> EvictionPlan:
    """The schedule as evictions: a value the schedule does not hold after call ``t`` goes
    before call ``t`` if nothing in window ``t`` reads it, else once call ``t`` has run."""

    def on(key: tuple[int, int]) -> bool:
        i = r_var.get(key)
        return i is not None and bool(x[i])

    before: dict[int, list[tuple[int, int]]] = {}
    for k, v in enumerate(values):
        readers = [int(t) for t in v.needs if t == int(t) and t < n and int(t) != v.call]
        last = max((t for t in range(v.call + 1, n + 1)
                    if (t, k) in s_var or (t, v.call) in r_var), default=v.call)
        for w in range(v.call, min(n - 1, last) + 1):
            held_in = w > v.call and (s := s_var.get((w, k))) is not None and bool(x[s])
            if not (w == v.call or held_in or on((w, v.call))):
                continue  # not there in window w
            if (s := s_var.get((w + 1, k))) is not None and x[s]:
                continue  # kept after call w
            read = w == v.call or w in readers or any(on((w, j)) for j in readers if j < w)
            # evicted once call w has run, or, if window w does not read it, once call
            # w - 1 has (by the plans' convention: see PlanFollower)
            before.setdefault(w if read or not held_in else w - 1, []).append(
                (v.call, v.slot))
    return EvictionPlan(before, "checkmate")
