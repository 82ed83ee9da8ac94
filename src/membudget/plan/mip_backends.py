"""A solver-neutral MIP (``Mip``) and its two back-ends, CP-SAT and HiGHS, behind one
function (``run_mip``).

The lifetime ILP is built once in this form so that either solver takes the same model and
warm start, and either can be benchmarked against the other. OR-Tools and highspy cannot
share a process (see ``solver_worker``): ``run_mip`` runs a solver in a worker process when
its rival library is already loaded in this one.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from membudget.plan import interrupt, solver_worker

SOLVERS = ("cpsat", "highs")
_RIVAL = {"cpsat": "highspy", "highs": "ortools.sat.python.cp_model"}  # see solver_worker


@dataclass
class Mip:
    """A minimisation MIP over integer variables with bounds: rows of three kinds (``lin``:
    lo <= a.x <= hi; ``one``: sum = 1; ``imp``: x[a] <= x[b]); minimise one variable."""

    lb: list[int] = field(default_factory=list)
    ub: list[int] = field(default_factory=list)
    lin: list[tuple[list[int], list[int], float, float]] = field(default_factory=list)
    one: list[list[int]] = field(default_factory=list)
    imp: list[tuple[int, int]] = field(default_factory=list)
    objective: int = -1

    def var(self, lb: int, ub: int) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        return len(self.lb) - 1

    @property
    def n_rows(self) -> int:
        return len(self.lin) + len(self.one) + len(self.imp)


Solution = tuple[list[float] | None, int | None, int]  # values, objective, proven bound
Report = Callable[[float, float], None]  # objective, bound (model units)


def run_mip(solver: str, mip: Mip, values: list[int], time_limit: float, gap: int,
            report: Report | None = None) -> Solution:
    """Minimise ``mip`` with ``solver`` from the start ``values`` until the objective is
    within ``gap`` of the bound or time is up, in this process or, if the solver's rival
    library is loaded here, in its worker process."""
    args = (solver, mip, values, time_limit, gap)
    if _RIVAL[solver] in sys.modules:
        return solver_worker.call(solver, _run_here, args, report)
    return _run_here(*args, report)


def _run_here(solver: str, mip: Mip, values: list[int], time_limit: float, gap: int,
              report: Report | None) -> Solution:
    """``run_mip`` in this process. Top level so that a worker process can run it."""
    run = _solve_cpsat if solver == "cpsat" else _solve_highs
    sol, obj, bound = run(mip, values, max(time_limit, 0.01), gap, report)
    return sol, obj, max(bound, mip.lb[mip.objective])


def _solve_cpsat(mip: Mip, values: list[int], time_limit: float, gap: int,
                 report: Report | None) -> Solution:
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    xs = [m.new_bool_var("") if (a, b) == (0, 1) else m.new_int_var(a, b, "")
          for a, b in zip(mip.lb, mip.ub, strict=True)]
    for idx, coef, lo, hi in mip.lin:
        expr = cp_model.LinearExpr.weighted_sum([xs[i] for i in idx], coef)
        m.add_linear_constraint(expr, int(max(lo, -2**62)), int(min(hi, 2**62)))
    for idx in mip.one:
        m.add_exactly_one(xs[i] for i in idx)
    for a, b in mip.imp:
        m.add_implication(xs[a], xs[b])
    m.minimize(xs[mip.objective])
    for var, val in zip(xs, values, strict=True):
        m.add_hint(var, val)
    s = cp_model.CpSolver()
    s.parameters.max_time_in_seconds = time_limit
    s.parameters.num_workers = 2
    s.parameters.absolute_gap_limit = max(gap, 0.5)  # integer objective: < 1 means exact
    s.parameters.cp_model_probing_level = 0  # probing these models costs seconds, gains little
    s.parameters.catch_sigint_signal = False  # Ctrl-C is ours: see packing.cp_sat

    class _Cb(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            if report is not None:
                report(self.objective_value, self.best_objective_bound)

    with interrupt.stopping(s.stop_search):
        code = s.solve(m, _Cb())
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, None, mip.lb[mip.objective]
    return ([s.value(v) for v in xs], round(s.objective_value),
            math.ceil(s.best_objective_bound - 1e-6))


_bannered = False  # whether this process made a HiGHS instance (and silenced its banner)


def new_highs() -> Any:
    """A silent HiGHS instance that ``cancelSolve()`` stops (:func:`run_highs`). The first
    one made in a process prints a banner to the C stdout, which would corrupt ``--json``
    output: that one is made with stdout closed (only that one: what other threads print
    meanwhile is lost too)."""
    global _bannered
    import highspy

    if _bannered:
        h = highspy.Highs()
    else:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        _bannered = True
    h.silent()
    h.HandleUserInterrupt = True
    return h


def highs_threads(requested: int) -> int:
    """HiGHS's threads for a solve from this thread: ``requested`` in the main thread, one
    elsewhere. HiGHS ties a scheduler and its worker threads to the thread that first
    solves; run from a short-lived thread (a planned session's planner), workers that start
    late outlive it, which HiGHS's maintainers report as crashes and hangs (HiGHS #810,
    #1886). A planner shares the machine with the training loop anyway."""
    return requested if threading.current_thread() is threading.main_thread() else 1


def run_highs(h: Any) -> None:
    """``h.run()``, which Ctrl-C stops (:mod:`.interrupt`): ``h`` then holds the best
    solution and bound it had, and every later run of ``h`` stops at once."""
    with interrupt.stopping(h.cancelSolve):
        h.run()


def lp_then_mip(lp: Any, time_limit: float, threads: int = 2,
                rel_gap: float = 1e-6) -> tuple[Any, float]:
    """Solve the 0/1 program ``lp`` (its integrality set) with HiGHS: first its LP
    relaxation, whose optimum is a bound even when the search that follows gets no further
    than the root, then the MIP in the time left. Returns the solver and the best proven
    lower bound (-inf if not even the LP finished)."""
    import highspy

    t0 = time.perf_counter()
    integrality = lp.integrality_
    lp.integrality_ = []
    h = new_highs()
    h.passModel(lp)
    h.setOptionValue("time_limit", max(0.1, float(time_limit)))
    h.setOptionValue("threads", highs_threads(threads))
    run_highs(h)
    bound = -math.inf
    if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:
        bound = h.getInfo().objective_function_value
    elif h.getModelStatus() == highspy.HighsModelStatus.kInfeasible:
        return h, math.inf
    left = time_limit - (time.perf_counter() - t0)
    n = lp.num_col_
    h.changeColsIntegrality(n, np.arange(n, dtype=np.int32),
                            np.array(integrality, dtype=np.uint8))
    h.setOptionValue("time_limit", max(0.1, left))
    h.setOptionValue("mip_rel_gap", rel_gap)
    run_highs(h)
    dual = h.getInfo().mip_dual_bound
    if math.isfinite(dual):
        bound = max(bound, dual)
    return h, bound


def _solve_highs(mip: Mip, values: list[int], time_limit: float, gap: int,
                 report: Report | None) -> Solution:
    import highspy

    rows = list(mip.lin) + [(idx, [1] * len(idx), 1, 1) for idx in mip.one]
    rows += [([a, b], [1, -1], -math.inf, 0) for a, b in mip.imp]
    lp = highspy.HighsLp()
    n = len(mip.lb)
    lp.num_col_, lp.num_row_ = n, len(rows)
    cost = np.zeros(n)
    cost[mip.objective] = 1.0
    lp.col_cost_ = cost
    lp.col_lower_ = np.array(mip.lb, dtype=float)
    lp.col_upper_ = np.array(mip.ub, dtype=float)
    inf = highspy.kHighsInf
    lp.row_lower_ = np.array([lo if lo > -math.inf else -inf for _, _, lo, _ in rows])
    lp.row_upper_ = np.array([hi if hi < math.inf else inf for _, _, _, hi in rows])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.cumsum([0] + [len(r[0]) for r in rows]).astype(np.int32)
    lp.a_matrix_.index_ = np.fromiter((i for r in rows for i in r[0]), dtype=np.int32)
    lp.a_matrix_.value_ = np.fromiter((c for r in rows for c in r[1]), dtype=float)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n
    h = new_highs()
    h.passModel(lp)
    h.setOptionValue("time_limit", time_limit)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", max(gap, 0.999))  # integer objective: < 1 means exact
    h.setOptionValue("threads", highs_threads(2))
    h.setSolution(n, np.arange(n, dtype=np.int32), np.array(values, dtype=float))
    if report is not None:
        def _cb(e: object) -> None:
            d = e.data_out  # type: ignore[attr-defined]
            report(d.objective_function_value, d.mip_dual_bound)

        h.cbMipImprovingSolution.subscribe(_cb)
    run_highs(h)
    info = h.getInfo()
    if info.primal_solution_status != highspy.kSolutionStatusFeasible:
        return None, None, mip.lb[mip.objective]
    dual = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else -math.inf
    return (list(h.getSolution().col_value), round(info.objective_function_value),
            math.ceil(max(dual, mip.lb[mip.objective]) - 1e-6))
