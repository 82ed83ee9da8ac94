"""Lifetime optimisation: the operator order of a step that minimises its peak memory.

``optimize_order`` contracts the nodes that allocate nothing, starts from the best of the
recorded order and the greedy list schedules, then runs OLLA's ILP: on the whole graph when
the model is small enough, else on windows of consecutive steps around the peak (the rest
of the order fixed; each window's ILP is exact for the steps it covers, OLLA's time-window
idea applied to segments of the current order). It always reports a lower bound and a gap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from membudget.plan import interrupt, lifetime_ilp
from membudget.plan.check_order import check_order
from membudget.plan.graph import LEAF, Graph, GraphError, Tensor
from membudget.plan.schedule import best_greedy, contract

# CP-SAT: on the same models (docs/results/olla-order.md) it finds and proves optima much
# faster than HiGHS, whose LP relaxation of the time-indexed model is weak and slow.
DEFAULT_SOLVER = "cpsat"
SOLVERS = ("cpsat", "highs", "greedy")
WHOLE_GRAPH_VARS = 20_000  # larger models are solved window by window
WINDOW = 60  # steps per window: CP-SAT usually proves such a window optimal in seconds
WINDOW_SECONDS = 10.0  # time limit of one such window's ILP (scaled with its size)
WINDOW_GROWTH = 4  # when every window around the peak is done, double up to 4x WINDOW
REL_GAP = 1e-4  # stop once the peak is within this fraction of the bound
MIN_SOLVE_SECONDS = 0.2  # below this the greedy order is the answer
REACH_MAX_NODES = 30_000  # the ancestor bit matrices take n²/4 bytes: skip them above


@dataclass(frozen=True)
class Progress:
    """A progress report: seconds since the start, best peak and best bound so far (bytes),
    and what is running."""

    seconds: float
    peak: int
    bound: int
    stage: str


@dataclass
class OrderResult:
    """An order of a graph's node ids, its checked peak, the combinatorial ``lower_bound``,
    the best proven ``bound`` (>= it: the solver's on a whole-graph ILP), ``gap`` = (peak -
    bound) / peak, and how it was found (bytes, seconds); ``interrupted``: Ctrl-C stopped
    the search, and this is the best order it had."""

    order: list[int]
    peak: int
    lower_bound: int
    bound: int
    recorded_peak: int | None
    gap: float
    status: str  # "optimal", "feasible" (ILP, not proven), "greedy" (no ILP ran)
    optimal: bool
    solver: str
    method: str  # "greedy", "ilp" (whole graph) or "windows"
    seconds: float
    message: str
    interrupted: bool = False

    @property
    def reduction(self) -> float | None:
        """Peak saved relative to the recorded order, as a fraction."""
        rec = self.recorded_peak
        return None if not rec else (rec - self.peak) / rec


def optimize_order(graph: Graph, time_limit: float = 30.0, solver: str = DEFAULT_SOLVER,
                   progress: Callable[[Progress], None] | None = None, *,
                   rel_gap: float = REL_GAP, window: int = WINDOW,
                   whole_graph_vars: int = WHOLE_GRAPH_VARS) -> OrderResult:
    """The lowest-peak order ``solver`` ("cpsat", "highs", "greedy": no ILP) finds in
    ``time_limit`` s or until within ``rel_gap`` of the bound (or Ctrl-C, within a
    :func:`.interrupt.sigint_stops` block). Always a valid order (the greedy one past a tiny
    limit); optimal only when proven (whole-graph optimum or peak = bound)."""
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; known: {', '.join(SOLVERS)}")
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    recorded = _recorded_peak(graph)
    c = contract(graph)
    g = c.graph
    order, peak, rule = best_greedy(g)
    if recorded is not None and recorded <= peak:
        order, peak, rule = c.lift(range(graph.n)), recorded, "recorded"
    lower = max(graph.lower_bound(), g.lower_bound())
    notes = [f"start: {rule} order; {graph.n} nodes, {g.n} after contracting the "
             f"{graph.n - g.n} that allocate nothing"]
    small = g.n <= REACH_MAX_NODES
    if small and deadline - time.perf_counter() > MIN_SOLVE_SECONDS:
        lower = max(lower, g.must_live_bound())
    bound, method, status = lower, "greedy", "greedy"

    def report(stage: str, best: int, best_bound: int) -> None:
        if progress is not None:
            progress(Progress(time.perf_counter() - t0, best, best_bound, stage))

    report("greedy", peak, lower)
    left = deadline - time.perf_counter()
    if (solver != "greedy" and peak - lower > rel_gap * peak and left > MIN_SOLVE_SECONDS
            and not interrupt.requested()):
        if small and _model_size(g) <= whole_graph_vars:
            method = "ilp"
            r = lifetime_ilp.solve(g, solver, left, order, peak, lower, int(rel_gap * peak),
                                   lambda s, p, b: report(solver, p, b))
            if r.order is not None and r.peak is not None and r.peak <= peak:
                order, peak = r.order, r.peak
            bound = max(lower, min(r.bound, peak))
            status = "optimal" if r.status == "optimal" else "feasible"
            notes.append(f"whole-graph ILP: {r.n_vars} variables, {r.n_rows} rows, "
                         f"{r.status} in {r.seconds:.1f} s")
        else:
            method, status = "windows", "feasible"
            order, peak, note = _improve_windows(g, order, lower, solver, deadline, window,
                                                 rel_gap, report)
            notes.append(note)
    full = c.expand(order)
    peak = graph.peak(full)
    check_order(graph, full, peak)
    optimal = status == "optimal" or peak <= lower
    if optimal:
        status, bound = "optimal", peak
    gap = (peak - bound) / peak if peak else 0.0
    if not optimal:
        notes.append(f"order not proven optimal ({method}): peak {peak:,} B is within "
                     f"{gap:.2%} of the bound {bound:,} B")
    seconds, interrupted = time.perf_counter() - t0, interrupt.requested()
    if interrupted:
        notes.append(f"interrupted after {seconds:.1f} s: the best order found so far")
    return OrderResult(full, peak, lower, bound, recorded, gap, status, optimal,
                       solver if method != "greedy" else "greedy", method, seconds,
                       "; ".join(notes), interrupted)


def _recorded_peak(graph: Graph) -> int | None:
    """Peak of the node-id order, or None when that order is not topological."""
    try:
        return graph.recorded_peak()
    except GraphError:
        return None


def _model_size(g: Graph) -> int:
    """Number of binaries of the whole-graph ILP (x in node windows, p in tensor spans),
    computed from ancestor/descendant counts without building the model."""
    lo, hi = g.reachability().windows()
    n_vars = int((hi - lo + 1).sum())
    for t in g.tensors:
        if t.src != LEAF and t.size > 0 and (t.sinks or t.to_end):
            last = g.n - 1 if t.to_end else max(hi[s] for s in t.sinks)
            n_vars += max(0, last - lo[t.src])
    return n_vars


def segment(g: Graph, order: Sequence[int], a: int, b: int) -> tuple[Graph, list[int]]:
    """Steps a..b-1 of ``order`` as a graph of their own, with a first node "start" that
    makes the tensors they read from earlier steps; bytes live across the whole segment
    become a leaf. Returns it and the nodes of g behind its nodes 1..b-a."""
    nodes = list(order[a:b])
    pos = {v: i for i, v in enumerate(order)}
    loc = {v: i + 1 for i, v in enumerate(nodes)}
    base = g.leaf_bytes
    tensors = [Tensor("start", 0, 0, tuple(range(1, len(nodes) + 1)))]
    for t in g.tensors:
        if t.src == LEAF:
            continue
        inside = tuple(loc[s] for s in t.sinks if s in loc)
        later = t.to_end or any(pos[s] >= b for s in t.sinks)
        if t.src in loc:
            tensors.append(Tensor(t.name, t.size, loc[t.src], inside, later))
        elif pos[t.src] < a and later:
            base += t.size  # live at every step of the segment
        elif pos[t.src] < a and inside:
            tensors.append(Tensor(t.name, t.size, 0, inside))
    tensors.append(Tensor("live across", base, LEAF))
    ops = ["start"] + [g.ops[v] for v in nodes]
    labels = ["start"] + [g.labels[v] for v in nodes]
    return Graph(ops, tensors, name=f"{g.name}[{a}:{b}]", labels=labels), nodes


def _improve_windows(g: Graph, order: list[int], lower: int, solver: str, deadline: float,
                     window: int, rel_gap: float, report: Callable[[str, int, int], None]
                     ) -> tuple[list[int], int, str]:
    """Repeatedly solve the ILP of a window of steps around a step at the peak, keeping
    the rest of the order; when no window around a peak step is left to try, double the
    window (up to WINDOW_GROWTH times). Stops there, at the bound, when time is up or at
    Ctrl-C."""
    order = list(order)
    tried: set[tuple[int, ...]] = set()
    solved = improved = 0
    span = min(window, g.n)
    while True:
        left = deadline - time.perf_counter()
        profile = g.profile(order)
        peak = int(profile.max())
        if peak - lower <= rel_gap * peak or left < MIN_SOLVE_SECONDS or interrupt.requested():
            break
        picks = [min(max(0, a), g.n - span) for t in map(int, (profile == peak).nonzero()[0])
                 for a in (t - span // 2, t - span + span // 8, t - span // 8)]
        todo = [a for a in dict.fromkeys(picks) if tuple(order[a:a + span]) not in tried]
        if not todo:
            if span >= min(g.n, WINDOW_GROWTH * window):
                break
            span = min(2 * span, g.n)
            continue
        a = todo[0]
        key = tuple(order[a:a + span])
        seg, nodes = segment(g, order, a, a + span)
        hint = list(range(seg.n))
        local = seg.peak(hint)
        seg_lower = seg.must_live_bound()
        tried.add(key)
        if local - seg_lower <= rel_gap * peak:
            continue
        r = lifetime_ilp.solve(seg, solver, min(left, WINDOW_SECONDS * span / window), hint,
                               local, seg_lower, int(rel_gap * peak))
        solved += 1
        if r.order is not None and r.peak is not None and r.peak < local:
            order[a:a + span] = [nodes[i - 1] for i in r.order if i]
            improved += 1
            report(f"window {a}:{a + span}", int(g.profile(order).max()), lower)
    return order, g.peak(order), (f"window ILPs ({window}-{span} steps): {solved} solved, "
                                  f"{improved} improved, {len(tried)} windows tried")
