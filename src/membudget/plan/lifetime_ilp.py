"""OLLA's lifetime ILP (operator order minimising the peak): its encoding and ``solve``.

One node per time step (T = n). Binaries: ``x[v,t]`` (node v runs at step t, i.e. creates
its outputs: OLLA's "generate") and ``p[e,t]`` (tensor e is preserved into step t). A tensor
is live at t when generated or preserved there; the integer ``peak`` is at least the bytes
live at every step. Scaling as in OLLA: variables exist only in each node's ASAP/ALAP
window and each tensor's maximum useful lifetime, ``p`` is fixed to 1 where every order
keeps the tensor (forced preservation), and sizes are divided by their GCD. The model is
built once in a solver-neutral form (``mip_backends.Mip``) and handed to CP-SAT or HiGHS
(``mip_backends.run_mip``) with a warm start.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from membudget.plan.graph import LEAF, Graph
from membudget.plan.mip_backends import SOLVERS, Mip, run_mip


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
class _Encoding:
    """The MIP of one graph and how to read an order from, or write a hint into, its
    variables."""

    mip: Mip
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
    mip = Mip()
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

    sol, obj, bound = run_mip(solver, enc.mip, values, left, gap_bytes // enc.scale, report)
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
