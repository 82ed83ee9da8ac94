"""A static plan of one training step: an operator order (lifetimes) and an offset for every
tensor in one arena (locations), each checked by the independent validators.

The order comes from :func:`membudget.plan.order.optimize_order`; the tensors' lifetimes under
it become an offset-assignment problem (leaves such as parameters live for the whole step)
that :func:`membudget.plan.pack.pack` solves. The baselines are the recorded order (the order
PyTorch ran, tensors freed at last use) and a replay of the trace through the model of
PyTorch's CUDA caching allocator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from membudget.plan import interrupt
from membudget.plan.graph import LEAF, Graph, from_trace
from membudget.plan.order import OrderResult, optimize_order
from membudget.plan.pack import PackResult, pack
from membudget.plan.problem import Buffer, PlanError, Problem
from membudget.plan.validate import validate_plan
from membudget.trace.format import Trace

ORDER_SHARE = 0.5  # of the time limit, for the order; the rest for the offsets


@dataclass
class Plan:
    """A validated plan: the order, the offsets, and the figures to judge them by (bytes,
    seconds). ``max_live`` is the planned order's peak: the arena can be no smaller."""

    name: str
    order: OrderResult
    problem: Problem
    packing: PackResult
    recorded_peak: int
    caching_peak: int | None  # reserved bytes of the caching-allocator model, recorded order

    @property
    def max_live(self) -> int:
        return self.order.peak

    @property
    def arena(self) -> int:
        return self.packing.height

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C stopped the search: the plan is the best found so far."""
        return self.order.interrupted or self.packing.interrupted

    @property
    def fragmentation(self) -> float:
        """(arena − max live) / arena: what the offsets waste."""
        return (self.arena - self.max_live) / self.arena if self.arena else 0.0

    def summary(self) -> dict[str, object]:
        """The plan's figures, as ``membudget plan`` prints and ``-o`` writes them."""
        o, p = self.order, self.packing
        return {
            "trace": self.name, "interrupted": self.interrupted, "ops": len(o.order),
            "recorded_peak": self.recorded_peak,
            "caching_allocator_peak": self.caching_peak, "planned_peak": o.peak,
            "lower_bound": o.lower_bound, "order_bound": o.bound, "order_gap": o.gap,
            "order_status": o.status, "order_solver": o.solver, "order_seconds": o.seconds,
            "arena": p.height, "arena_lower_bound": p.lower_bound,
            "arena_optimal": p.proven_optimal, "pack_method": p.method,
            "pack_seconds": p.seconds, "fragmentation": self.fragmentation,
            "reduction_from_order": 1 - o.peak / self.recorded_peak,
            "reduction_total": 1 - p.height / self.recorded_peak,
            "messages": [m for m in (o.message, p.message) if m],
        }


def location_problem(graph: Graph, order: Sequence[int] | None = None) -> Problem:
    """The offset problem of ``order`` (default: the recorded order, as the program ran):
    each tensor of size > 0 is a buffer live from its source's step to its last sink's step
    (half-open: one past it); leaves the whole step."""
    if order is None:
        order = range(graph.n)
    pos = {v: i for i, v in enumerate(order)}
    n = len(order)
    buffers = []
    for k, t in enumerate(graph.tensors):
        if t.size <= 0:
            continue
        if t.src == LEAF:
            lower, upper = 0, max(n, 1)
        else:
            lower = pos[t.src]
            upper = n if t.to_end else max((pos[s] for s in t.sinks), default=lower) + 1
        buffers.append(Buffer(f"{k}:{t.name}", lower, upper, t.size))
    return Problem(tuple(buffers))


@interrupt.sigint_stops()
def plan_trace(trace: Trace, time_limit: float = 30.0, solver: str | None = None,
               caching: bool = True,
               progress: Callable[[str], None] | None = None) -> Plan:
    """Plan ``trace``'s step within about ``time_limit`` seconds (Ctrl-C stops the search:
    the best order and offsets found so far, without the caching allocator's peak; see
    :mod:`.interrupt`); the order and the offsets are checked by the validators before the
    plan is returned."""
    tell = progress or (lambda stage: None)
    graph = from_trace(trace)
    recorded = graph.recorded_peak()
    if recorded == 0:
        raise PlanError(f"{trace.path}: nothing to plan: the step holds no memory (no calls "
                        "and no puts of any bytes)")
    tell("order")
    kwargs = {} if solver is None else {"solver": solver}
    order = optimize_order(graph, time_limit=time_limit * ORDER_SHARE, **kwargs)
    tell("offsets")
    problem = location_problem(graph, order.order)
    packing = pack(problem, time_limit=time_limit * (1 - ORDER_SHARE))
    validate_plan(graph, order.order, order.peak, problem, packing.offsets, packing.height)
    caching_peak = _caching_peak(trace) if caching and not interrupt.requested() else None
    return Plan(trace.name, order, problem, packing, recorded, caching_peak)


def _caching_peak(trace: Trace) -> int:
    """Peak reserved bytes when the trace runs in its recorded order, nothing evicted, on the
    model of PyTorch's CUDA caching allocator."""
    from membudget.sim import simulate

    engines = []
    simulate(trace, "dtr", budget=2**62, allocator="torch-caching", on_engine=engines.append)
    return engines[0].allocator.peak_reserved
