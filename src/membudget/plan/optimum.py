"""The least recomputation any schedule of a recorded step needs under a budget.

Two sides, each proven by its own means:

- *lower bounds*: the gap relaxation (``remat_bound``, every size) and Checkmate's MILP
  (``checkmate``, with memory relaxed so its dual bound is a bound; run where it is small
  enough to help within the time limit). The best of them is ``lower_bound``.
- *schedules*: every candidate is an eviction plan run by the simulator (the budget holds
  at every op, or the run does not count), so its overhead is the simulator's own. The
  candidates are those of :mod:`membudget.sim.schedules` (the DTR family's and msps's
  decisions, static checkpointing with dtr-eq beyond it), Checkmate's schedule and the
  relaxation's.
  The cheapest is ``overhead``.

``proven`` when they meet. Overheads are the simulator's: executed cost over the baseline
cost, minus one, on the fungible pool with copy-on-write writes (the ideal pool: the limit
for every address-ordered method too).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from membudget.errors import MembudgetError
from membudget.plan import checkmate, interrupt
from membudget.plan.remat_bound import lower_bound as relaxation_bound
from membudget.plan.remat_problem import RematProblem, remat_problem
from membudget.sim.evictions import EvictionPlan
from membudget.sim.schedules import run_schedule, schedules
from membudget.sim.simulate import Baseline, SimResult, measure_baseline
from membudget.trace.format import Trace

CHECKMATE_MAX_VARIABLES = 400_000  # above this its program does not help within minutes
PROVEN_GAP = 1e-6


class BudgetInfeasible(MembudgetError):
    """No schedule fits: the message states the least budget that can."""

    def __init__(self, budget: int, minimum: int) -> None:
        from membudget.units import format_bytes

        super().__init__(f"no schedule fits {format_bytes(budget)}: one op needs at least "
                         f"{format_bytes(minimum)} resident (its inputs, outputs and what "
                         f"nothing may evict); give --budget {minimum} or more")
        self.budget = budget
        self.minimum = minimum


@dataclass
class Candidate:
    """One schedule tried: where it came from and what the simulator made of it."""

    source: str
    status: str  # the simulator's: ok, oom, thrashed
    overhead: float | None


@dataclass
class OptimumResult:
    """What ``membudget optimum --json`` prints (``plan`` is left out of the JSON)."""

    trace: str
    budget_bytes: int
    ratio: float | None
    baseline_cost: float
    baseline_peak_bytes: int
    status: str  # optimal | feasible (a schedule and a bound) | no-schedule (a bound only)
    overhead: float | None  # the best schedule's overhead
    lower_bound: float  # proven: no schedule has a smaller overhead
    proven: bool
    gap: float | None  # (overhead - lower_bound) / overhead, 0 when both are 0
    best: str | None  # the source of the best schedule
    seconds: float
    timed_out: bool
    min_budget_bytes: int  # below this no schedule fits
    bounds: dict[str, float] = field(default_factory=dict)  # each bound's overhead
    bound_violated: bool = False  # a bound exceeded a simulated schedule: a bug, not proof
    candidates: list[Candidate] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C stopped the solvers: the best found so far
    checkmate_variables: int = 0  # the size of Checkmate's MILP (not run above the maximum)
    plan: EvictionPlan | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["plan"]
        return out

    def beside(self, source: str, overhead: float) -> OptimumResult:
        """This result with a schedule run elsewhere (its plan unknown here) as the best, if
        it is cheaper than the best here."""
        if self.overhead is not None and overhead >= self.overhead:
            return self
        lb, gap, proven, status = _settle(self.lower_bound, overhead, self.bound_violated)
        return replace(self, overhead=overhead, best=source, lower_bound=lb, gap=gap,
                       proven=proven, status=status, plan=None)


def _settle(lb: float, over: float | None,
            violated: bool) -> tuple[float, float | None, bool, str]:
    """The bound, gap, proof and status of best schedule ``over`` against bound ``lb``."""
    if over is None:
        return lb, None, False, "no-schedule"
    lb = min(lb, over)
    gap = 0.0 if over <= 0 else (over - lb) / over
    proven = gap <= PROVEN_GAP and not violated
    return lb, gap, proven, "optimal" if proven else "feasible"


def _plan_from_drops(drops: list) -> EvictionPlan:
    before: dict[int, list[tuple[int, int]]] = {}
    for d in drops:  # evicted once its last need before the gap has run
        before.setdefault(math.floor(d.start), []).append((d.value.call, d.value.slot))
    return EvictionPlan(before, "relaxation")


@interrupt.sigint_stops()
def optimum(trace: Trace, *, budget: int | None = None, ratio: float | None = None,
            time_limit: float = 60.0, problem: RematProblem | None = None,
            baseline: Baseline | None = None,
            progress: Callable[[str], object] | None = None) -> OptimumResult:
    """Bound and approach the least overhead of ``trace`` under ``budget`` bytes (or
    ``ratio`` × its baseline peak) within about ``time_limit`` seconds. Ctrl-C stops the
    solvers (:mod:`.interrupt`): the bounds they had, and the schedules of those and of
    the DTR family, each run by the simulator as usual."""
    if (ratio is None) == (budget is None):
        raise MembudgetError("give exactly one of ratio and budget")
    if ratio is not None and not ratio > 0:
        raise MembudgetError(f"ratio must be > 0, got {ratio}")
    if not time_limit > 0:
        raise MembudgetError(f"time limit must be > 0 seconds, got {time_limit}")
    tell = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    base = baseline or measure_baseline(trace)
    prob = problem or remat_problem(trace)
    if ratio is not None:
        budget = int(base.peak_bytes * ratio)
    assert budget is not None
    deadline = t0 + time_limit
    candidates: list[Candidate] = []
    plans: dict[str, EvictionPlan] = {}

    def keep(source: str, r: SimResult) -> None:
        candidates.append(Candidate(source, r.status, r.overhead if r.status == "ok" else None))
        if r.status == "ok":
            assert r.eviction_plan is not None
            plans[source] = r.eviction_plan

    def run(source: str, plan: EvictionPlan) -> None:
        keep(source, run_schedule(trace, budget, source, "dtr-eq", plan, baseline=base,
                                  allocator="fungible", inplace="cow"))

    # the schedules first, in half the time: a bound's solver may overrun its limit (HiGHS's
    # MIP presolve ignores it), which must not cost the user the schedules
    tell("scheduling: the candidate heuristics and static checkpointing")
    for source, r in schedules(trace, budget, baseline=base, allocator="fungible",
                               inplace="cow", until=t0 + 0.5 * time_limit):
        keep(source, r)
        if interrupt.requested():
            break
    tell("bounding: the gap relaxation")
    relax = relaxation_bound(prob, budget, time_limit=max(0.5, 0.25 * time_limit))
    if not relax.feasible:
        raise BudgetInfeasible(budget, relax.min_budget)
    cost = base.cost or 1.0
    bounds = {"relaxation": relax.cost / cost}
    timed_out = not relax.exact or any(c.status == "timeout" for c in candidates)
    if relax.drops:
        tell("scheduling: the relaxation's drops")
        run("relaxation", _plan_from_drops(relax.drops))
    size = checkmate.size(prob)
    if size > CHECKMATE_MAX_VARIABLES:
        tell(f"Checkmate's MILP not run: {size:,} variables")
    elif time.perf_counter() >= deadline:
        timed_out = True
    elif not interrupt.requested():
        left = deadline - time.perf_counter()
        tell(f"solving Checkmate's MILP ({left:.0f} s)")
        cm = checkmate.solve(prob, budget, time_limit=max(1.0, left))
        bounds["checkmate"] = cm.bound / cost
        timed_out = timed_out or not cm.exact
        if cm.plan is not None:
            run("checkmate", cm.plan)
    lb = max(bounds.values())
    ok = [c for c in candidates if c.overhead is not None]
    best = min(ok, key=lambda c: c.overhead) if ok else None  # type: ignore[arg-type,return-value]
    over = best.overhead if best is not None else None
    violated = over is not None and lb > over * (1 + 1e-9) + 1e-12
    if violated:  # a bound above a schedule the simulator ran is wrong: say so, prove nothing
        import warnings

        warnings.warn(f"{trace.name}: a lower bound ({lb:.6g}) exceeds a simulated schedule "
                      f"({over:.6g}); the bound is not valid here (a bug): nothing is proven",
                      RuntimeWarning, stacklevel=2)
    lb, gap, proven, status = _settle(lb, over, violated)
    interrupted = interrupt.requested()
    return OptimumResult(
        trace.name, budget, ratio, base.cost, base.peak_bytes, status, over, lb, proven, gap,
        best.source if best else None, time.perf_counter() - t0,
        timed_out and not proven and not interrupted, relax.min_budget, bounds, violated,
        candidates, interrupted, size, plans.get(best.source) if best else None)


def optimum_planner(time_limit: float = 30.0) -> Callable[[Trace, int, str], EvictionPlan]:
    """A planner for ``membudget.budget(..., mode="planned", planner=...)``: the best
    schedule :func:`optimum` finds for the recorded step within ``time_limit`` seconds (the
    session's policy still decides what the plan leaves open)."""

    def plan(trace: Trace, budget_bytes: int, policy: str) -> EvictionPlan:
        r = optimum(trace, budget=budget_bytes, time_limit=time_limit)
        if r.plan is None:
            raise MembudgetError(f"no schedule of the recorded step fits {budget_bytes} B")
        return r.plan

    return plan
