"""OLLA's lifetime ILP (operator order minimising the peak), solved by CP-SAT or HiGHS.

One node per time step (T = n). Binaries: ``x[v,t]`` (node v runs at step t, i.e. creates
its outputs: OLLA's "generate") and ``p[e,t]`` (tensor e is preserved into step t). A tensor
is live at t when generated or preserved there; the integer ``peak`` is at least the bytes
live at every step. Scaling as in OLLA: variables exist only in each node's ASAP/ALAP
window and each tensor's maximum useful lifetime, ``p`` is fixed to 1 where every order
keeps the tensor (forced preservation), and sizes are divided by their GCD. The model is
built once in a solver-neutral form and handed to either solver with a warm start.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from membudget.plan.graph import LEAF, Graph

SOLVERS = ("cpsat", "highs")
# OR-Tools bundles its own libhighs.so.1 and highspy ships another with the same soname: one
# process can load only one of them, so a solver whose rival is loaded runs in a worker
# process (``python -m membudget.plan.lifetime_ilp``, kept for later solves).
_RIVAL = {"cpsat": "highspy", "highs": "ortools.sat.python.cp_model"}
_WORKERS: dict[str, subprocess.Popen] = {}


@dataclass
class IlpResult:
    """A solver's answer: its best order (None if it found none), that order's peak (from
    the graph) and the proven lower bound (bytes), status ("optimal", "feasible", "unknown")
    and model size."""

    order: list[int] | None
    peak: int | None
    bound: int
    status: str
    seconds: float
    n_vars: int
    n_rows: int


@dataclass
class _Mip:
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


@dataclass
class _Encoding:
    """The MIP of one graph and how to read an order from, or write a hint into, its
    variables."""

    mip: _Mip
    x: list[dict[int, int]]  # node -> step -> variable
    p: list[dict[int, int]]  # tensor -> step -> variable
    scale: int
    base: int  # bytes live at every step (leaves)

    def order_of(self, value: Callable[[int], float]) -> list[int]:
        step = {v: max(xs, key=lambda t, xs=xs: value(xs[t])) for v, xs in enumerate(self.x)}
        return sorted(step, key=step.__getitem__)

    def hint(self, g: Graph, order: Sequence[int], peak: int) -> list[int]:
        """Variable values for a valid order whose peak is ``peak`` bytes."""
        values = [0] * len(self.mip.lb)
        pos = {v: t for t, v in enumerate(order)}
        for v, xs in enumerate(self.x):
            values[xs[pos[v]]] = 1
        for e, ps in enumerate(self.p):
            if not ps:
                continue
            t_ = g.tensors[e]
            end = g.n - 1 if t_.to_end else max(pos[s] for s in t_.sinks)
            for t, var in ps.items():
                values[var] = int(pos[t_.src] < t <= end)
        values[self.mip.objective] = (peak - self.base) // self.scale
        return values


def encode(g: Graph, lower: int, upper: int) -> _Encoding:
    """The lifetime ILP of ``g`` with the peak (bytes) searched in [lower, upper]."""
    lo, hi = g.reachability().windows()
    sized = [k for k, t in enumerate(g.tensors) if t.src != LEAF and t.size > 0]
    scale = math.gcd(*(g.tensors[k].size for k in sized)) or 1
    mip = _Mip()
    base = g.leaf_bytes
    mip.objective = mip.var(max(0, -((base - lower) // scale)), (upper - base) // scale)
    x = [{t: mip.var(0, 1) for t in range(lo[v], hi[v] + 1)} for v in range(g.n)]
    mem: list[list[tuple[int, int]]] = [[] for _ in range(g.n)]  # step -> (var, size)
    made = [0] * g.n  # scaled bytes each node makes (live at its step)
    p: list[dict[int, int]] = [{} for _ in g.tensors]
    for k in sized:
        t_ = g.tensors[k]
        s, size, sinks = t_.src, t_.size // scale, sorted(set(t_.sinks))
        made[s] += size
        if not sinks and not t_.to_end:
            continue
        last = g.n - 1 if t_.to_end else max(hi[w] for w in sinks)
        forced = g.n - 1 if t_.to_end else max(lo[w] for w in sinks)
        ps = p[k] = {t: mip.var(1 if hi[s] < t <= forced else 0, 1)
                     for t in range(lo[s] + 1, last + 1)}
        for t, var in ps.items():  # preserved at t: preserved or generated at t - 1
            idx, coef = [var], [1]
            for prev in (ps.get(t - 1), x[s].get(t - 1)):
                if prev is not None:
                    idx.append(prev)
                    coef.append(-1)
            mip.lin.append((idx, coef, 0 if t_.to_end else -math.inf, 0))
            mem[t].append((var, size))
        for w in sinks:  # a sink runs at t: the tensor is preserved at t
            mip.imp += [(xv, ps[t]) for t, xv in x[w].items()]
    for v in range(g.n):
        mip.one.append(list(x[v].values()))
        for t, var in x[v].items():
            if made[v]:
                mem[t].append((var, made[v]))
    by_step: list[list[int]] = [[] for _ in range(g.n)]
    for xs in x:
        for t, var in xs.items():
            by_step[t].append(var)
    mip.one += by_step
    for t in range(g.n):
        idx = [var for var, _ in mem[t]] + [mip.objective]
        mip.lin.append((idx, [c for _, c in mem[t]] + [-1], -math.inf, 0))
    # Ordering edges that are not tensors (sizes 0): step(u) + 1 <= step(v). Tensor edges
    # need no such row: a sink needs the tensor preserved, hence already generated.
    data = {(g.tensors[k].src, w) for k in sized for w in g.tensors[k].sinks}
    for v in range(g.n):
        for u in g.preds[v]:
            if (u, v) not in data:
                mip.lin.append(([*x[u].values(), *x[v].values()], [*x[u], *(-t for t in x[v])],
                                -math.inf, -1))
    return _Encoding(mip, x, p, scale, base)


SolveProgress = Callable[[float, int, int], None]  # seconds, best peak, bound (bytes)


def solve(g: Graph, solver: str, time_limit: float, hint: Sequence[int], hint_peak: int,
          lower: int, gap_bytes: int = 0, progress: SolveProgress | None = None) -> IlpResult:
    """Solve the lifetime ILP of ``g`` from the warm start ``hint`` (a valid order of peak
    ``hint_peak``) with the peak searched in [lower, hint_peak]; stop once the best peak is
    within ``gap_bytes`` of the bound. "optimal" means proven (peak = bound)."""
    if solver not in SOLVERS:
        raise ValueError(f"unknown ILP solver {solver!r}; known: {', '.join(SOLVERS)}")
    t0 = time.perf_counter()
    enc = encode(g, lower, hint_peak)
    values = enc.hint(g, hint, hint_peak)
    left = max(0.0, time_limit - (time.perf_counter() - t0))

    def report(obj: float, bound: float) -> None:
        if progress is not None:
            bound = max(bound, enc.mip.lb[enc.mip.objective])  # HiGHS starts at -inf
            progress(time.perf_counter() - t0, enc.base + round(obj) * enc.scale,
                     enc.base + math.ceil(bound - 1e-6) * enc.scale)

    run = _remote if _RIVAL[solver] in sys.modules else run_mip
    sol, obj, bound = run(solver, enc.mip, values, left, gap_bytes // enc.scale, report)
    order = None if sol is None else enc.order_of(sol.__getitem__)
    if order is None or obj is None or not _topological(g, order):  # none, or tolerances
        return IlpResult(None, None, enc.base + bound * enc.scale, "unknown",
                         time.perf_counter() - t0, len(enc.mip.lb), enc.mip.n_rows)
    return IlpResult(order, g.peak(order),  # at most the objective: p may be set needlessly
                     enc.base + bound * enc.scale, "optimal" if obj <= bound else "feasible",
                     time.perf_counter() - t0, len(enc.mip.lb), enc.mip.n_rows)


def _topological(g: Graph, order: list[int]) -> bool:
    """Whether ``order`` runs every node after its predecessors, each node once."""
    pos = {v: i for i, v in enumerate(order)}
    return len(pos) == g.n and all(pos[u] < pos[v] for v in range(g.n) for u in g.preds[v])


Solution = tuple[list[float] | None, int | None, int]  # values, objective, proven bound
Report = Callable[[float, float], None]  # objective, bound (model units)


def run_mip(solver: str, mip: _Mip, values: list[int], time_limit: float, gap: int,
            report: Report | None = None) -> Solution:
    """Minimise ``mip`` from the start ``values`` until the objective is within ``gap`` of
    the bound or time is up. Top level so that a worker process can run it."""
    run = _solve_cpsat if solver == "cpsat" else _solve_highs
    sol, obj, bound = run(mip, values, max(time_limit, 0.01), gap, report)
    return sol, obj, max(bound, mip.lb[mip.objective])


def _solve_cpsat(mip: _Mip, values: list[int], time_limit: float, gap: int,
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

    class _Cb(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            if report is not None:
                report(self.objective_value, self.best_objective_bound)

    code = s.solve(m, _Cb())
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, None, mip.lb[mip.objective]
    return ([s.value(v) for v in xs], round(s.objective_value),
            math.ceil(s.best_objective_bound - 1e-6))


def _solve_highs(mip: _Mip, values: list[int], time_limit: float, gap: int,
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
    h = highspy.Highs()
    h.silent()
    h.passModel(lp)
    h.setOptionValue("time_limit", time_limit)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", max(gap, 0.999))  # integer objective: < 1 means exact
    h.setOptionValue("threads", 2)
    h.setSolution(n, np.arange(n, dtype=np.int32), np.array(values, dtype=float))
    if report is not None:
        def _cb(e: object) -> None:
            d = e.data_out  # type: ignore[attr-defined]
            report(d.objective_function_value, d.mip_dual_bound)

        h.cbMipImprovingSolution.subscribe(_cb)
    h.run()
    info = h.getInfo()
    if info.primal_solution_status != highspy.kSolutionStatusFeasible:
        return None, None, mip.lb[mip.objective]
    dual = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else -math.inf
    return (list(h.getSolution().col_value), round(info.objective_function_value),
            math.ceil(max(dual, mip.lb[mip.objective]) - 1e-6))


def _worker(solver: str) -> subprocess.Popen:
    """The worker process that runs ``solver`` (started on first use)."""
    w = _WORKERS.get(solver)
    if w is None or w.poll() is not None:
        src = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        w = _WORKERS[solver] = subprocess.Popen(
            [sys.executable, "-m", "membudget.plan.lifetime_ilp"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env)
    return w


def _remote(solver: str, mip: _Mip, values: list[int], time_limit: float, gap: int,
            report: Report | None = None) -> Solution:
    """``run_mip`` in the solver's worker process, relaying its progress reports. If this
    is interrupted or the worker dies, the worker is killed (a new one starts next time)."""
    w = _worker(solver)
    assert w.stdin is not None and w.stdout is not None
    try:
        pickle.dump((solver, mip, values, time_limit, gap), w.stdin)
        w.stdin.flush()
        while True:
            kind, payload = pickle.load(w.stdout)
            if kind == "done":
                return payload
            if report is not None:
                report(*payload)
    except BaseException as e:
        w.kill()
        w.wait()
        del _WORKERS[solver]
        if isinstance(e, (EOFError, OSError, pickle.UnpicklingError)):
            raise RuntimeError(f"the {solver} worker process died ({e!r}); see its "
                               "stderr") from e
        raise


@atexit.register
def _stop_workers() -> None:
    for w in _WORKERS.values():
        if w.stdin is not None:
            w.stdin.close()  # the worker exits at end of input
        try:
            w.wait(timeout=5)
        except subprocess.TimeoutExpired:
            w.kill()


def _serve() -> None:
    """Worker loop: read pickled jobs from stdin, answer on the original stdout (solver
    output that goes to file descriptor 1 is sent to stderr instead)."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while True:
        try:
            solver, mip, values, time_limit, gap = pickle.load(sys.stdin.buffer)
        except EOFError:
            return

        def relay(obj: float, bound: float) -> None:
            pickle.dump(("progress", (obj, bound)), out)
            out.flush()

        pickle.dump(("done", run_mip(solver, mip, values, time_limit, gap, relay)), out)
        out.flush()


if __name__ == "__main__":
    _serve()
