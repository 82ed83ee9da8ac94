"""The schedules a planner compares for a recorded step under a budget.

Each is a simulated run recorded as an eviction plan that replays it alone: the decisions of
the session's policy, each static checkpointing baseline that applies to the trace
(:mod:`.baselines`: √n, per-block, selective, the min-cut at the budget) with the policy
evicting whatever more the budget needs, and the decisions of the other
:data:`~membudget.core.policies.SCHEDULE_CANDIDATES`. Planned mode follows the cheapest;
``membudget optimum`` adds its solvers' schedules.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

from membudget.core.policies import SCHEDULE_CANDIDATES
from membudget.errors import MembudgetError
from membudget.sim.baselines import BASELINES, make_plan
from membudget.sim.evictions import EvictionPlan
from membudget.sim.simulate import DEFAULT_OVERHEAD_LIMIT, Baseline, SimResult, simulate
from membudget.trace.format import Trace


def run_schedule(trace: Trace, budget: int, source: str, policy: str,
                 plan: EvictionPlan | None = None, *, allocator: str | None = None,
                 inplace: str | None = None, baseline: Baseline | None = None,
                 overhead_limit: float | None = DEFAULT_OVERHEAD_LIMIT,
                 deadline: float = math.inf) -> SimResult:
    """One candidate: ``policy``'s decisions, or ``plan`` with ``policy`` deciding what it
    leaves open; its ``eviction_plan`` is the whole run's, named ``source``."""
    r = simulate(trace, policy, budget=budget, allocator=allocator, inplace=inplace,
                 baseline=baseline, overhead_limit=overhead_limit, plan=plan, record_plan=True,
                 deadline=deadline)
    if r.eviction_plan is not None:
        r.eviction_plan = EvictionPlan(r.eviction_plan.before, source)
    return r


def schedules(trace: Trace, budget: int, policy: str = "dtr-eq", *,
              allocator: str | None = None, inplace: str | None = None,
              baseline: Baseline | None = None,
              overhead_limit: float | None = DEFAULT_OVERHEAD_LIMIT,
              until: float = math.inf) -> Iterator[tuple[str, SimResult]]:
    """Each candidate schedule as (its source, its run by :func:`run_schedule`):
    ``policy``'s, the baselines' (cheap to replay: their evictions are decided ahead), then
    the other heuristics'. Past ``until`` (``time.perf_counter()``) no candidate starts and
    a running one stops ("timeout"), except ``policy``'s, which always completes. Before
    ``until``, each candidate first gets an equal share of the time left, so that one that
    thrashes slowly does not starve the rest (dtr on the DTR paper's lstm at 0.3 takes
    100 s to thrash, dtr-future 1.4 s to complete); those it stopped run again, in the
    same order, with all the time left."""

    def run(source: str, name: str, plan: EvictionPlan | None = None,
            deadline: float = until) -> SimResult:
        return run_schedule(trace, budget, source, name, plan, allocator=allocator,
                            inplace=inplace, baseline=baseline, overhead_limit=overhead_limit,
                            deadline=deadline)

    yield policy, run(policy, policy, deadline=math.inf)
    jobs: list[tuple[str, str, EvictionPlan | None]] = []
    for name in BASELINES:
        if time.perf_counter() >= until:
            return
        try:
            static = make_plan(name, trace, **({"budget": budget} if name == "min-cut" else {}))
        except MembudgetError:  # not for this trace (no backward marker, no attention, ...)
            continue
        jobs.append((name, policy, static))
    jobs += [(name, name, None) for name in SCHEDULE_CANDIDATES if name != policy]
    stopped: list[tuple[tuple[str, str, EvictionPlan | None], SimResult]] = []
    for i, (source, name, plan) in enumerate(jobs):
        now = time.perf_counter()
        if now >= until:
            break
        r = run(source, name, plan, now + (until - now) / (len(jobs) - i))
        if r.status == "timeout":
            stopped.append(((source, name, plan), r))
        else:
            yield source, r
    for (source, name, plan), r in stopped:
        if time.perf_counter() < until:
            r = run(source, name, plan)
        yield source, r


def cheapest(trace: Trace, budget: int, policy: str, *, allocator: str | None = None,
             inplace: str | None = None, overhead_limit: float | None = None,
             time_limit: float = math.inf) -> SimResult:
    """The completed schedule of least executed cost (a tie goes to the earlier: ``policy``
    first), or ``policy``'s own run if none completes; candidates past ``time_limit``
    seconds are not compared."""
    until = time.perf_counter() + time_limit
    runs = [r for _, r in schedules(trace, budget, policy, allocator=allocator,
                                    inplace=inplace, overhead_limit=overhead_limit,
                                    until=until)]
    done = [r for r in runs if r.status == "ok"]
    return min(done, key=lambda r: r.executed_cost) if done else runs[0]


__all__ = ["cheapest", "run_schedule", "schedules"]
