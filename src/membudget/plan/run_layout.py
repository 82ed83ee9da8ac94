"""Tensor locations for a rematerializing schedule: OLLA's placement of DTR's step.

A training loop repeats one step. Its first run, with a policy on the fungible pool (no
addresses, so no fragmentation), fixes every storage's lifetime: made, evicted, recomputed,
freed. :func:`lay_out` logs those lifetimes and packs them (:func:`membudget.plan.pack.pack`,
whose result the independent validator checks) into an arena of the budget's bytes. Where
the packing fits, every later step runs that schedule on address-ordered memory with each
storage at its planned offset: the fungible pool's overhead, with no fragmentation, no
moves and no extra evictions. Where it does not, the run is repeated a little below the
budget (``shrinks``), which makes its lifetimes easier to pack at some recomputation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from membudget.core.allocators.fungible import FungibleAllocator
from membudget.core.engine import Engine
from membudget.core.policies import make_policy
from membudget.core.records import Storage
from membudget.errors import MembudgetError
from membudget.plan.pack import PackResult, Progress, pack
from membudget.plan.problem import Buffer, Problem
from membudget.sim.simulate import Baseline, SimResult, measure_baseline, simulate
from membudget.trace.format import Trace

SHRINKS = (0.0, 0.01, 0.02, 0.04)  # run budgets tried, as shares below the budget


class LifetimeLog(FungibleAllocator):
    """The fungible pool (only the byte total matters), logging each storage's lifetime as a
    half-open interval of allocation events: ``[made, given back)``."""

    def __init__(self, capacity: float) -> None:
        super().__init__(capacity)
        self.events = 0
        self.open: dict[int, tuple[int, int]] = {}  # id() of a held storage -> (start, bytes)
        self.closed: list[tuple[int, int, int]] = []  # (start, end, bytes)

    def allocate(self, s: Storage) -> bool:
        if not super().allocate(s):
            return False
        self.events += 1
        self.open[id(s)] = (self.events, s.nbytes)
        return True

    def free(self, s: Storage) -> None:
        super().free(s)
        self.events += 1
        start, nbytes = self.open.pop(id(s))
        self.closed.append((start, self.events, nbytes))

    def transfer(self, old: Storage, new: Storage) -> None:
        """An in-place update: ``new`` keeps the bytes (and so the interval) of ``old``."""
        super().transfer(old, new)
        start, nbytes = self.open.pop(id(old))
        self.open[id(new)] = (start, max(nbytes, new.nbytes))

    def problem(self) -> Problem:
        """Every lifetime of the run as a buffer; those still held end after the last
        event."""
        end = self.events + 1
        spans = self.closed + [(start, end, n) for start, n in self.open.values()]
        return Problem(tuple(Buffer(str(k), start, stop, n)
                             for k, (start, stop, n) in enumerate(spans) if n > 0))


@dataclass
class RunLayout:
    """A schedule and the placement of its storages in an arena of ``budget`` bytes.

    ``run``: the policy's run on the fungible pool at ``run_budget`` bytes (its overhead is
    the step's); ``problem``: its lifetimes, and ``packing`` their offsets with the budget as
    the capacity (both None when the run did not complete); ``fits``: every storage lies
    within the budget. ``tried`` lists each run budget tried with the packing's height
    (None: no packing)."""

    budget: int
    run_budget: int
    run: SimResult
    problem: Problem | None
    packing: PackResult | None
    tried: list[tuple[int, int | None]]

    @property
    def fits(self) -> bool:
        return self.packing is not None and self.packing.fits


def check_policy(policy: str) -> None:
    """Refuse an unknown policy, or one that chooses by addresses (a layout is made from a
    run on the fungible pool, which has none)."""
    if make_policy(policy).needs_layout:  # (an unknown name is refused here)
        raise MembudgetError(f"policy {policy!r} chooses by addresses; a layout is made from "
                             "a run on the fungible pool: give a policy that needs none "
                             "(dtr, dtr-eq, ...)")


def logged_run(trace: Trace, policy: str, budget: int,
               baseline: Baseline) -> tuple[SimResult, LifetimeLog | None]:
    """``policy``'s run on the fungible pool at ``budget`` bytes, with the log of its
    lifetimes if it completed within the budget (None if not, or if its budget was raised
    at the end to hand the program its last values: the run went on past the log)."""
    engines: list[Engine] = []
    log = LifetimeLog(budget)

    def attach(engine: Engine) -> None:
        engines.append(engine)
        engine.allocator = log

    run = simulate(trace, policy, budget=budget, allocator="fungible", baseline=baseline,
                   on_engine=attach)
    return run, log if run.status == "ok" and engines[0].allocator is log else None


def lay_out(trace: Trace, *, budget: int | None = None, ratio: float | None = None,
            policy: str = "dtr", time_limit: float = 5.0,
            shrinks: tuple[float, ...] = SHRINKS, baseline: Baseline | None = None,
            progress: Progress | None = None) -> RunLayout:
    """Run ``policy`` on the fungible pool at the budget and pack its lifetimes into the
    budget's bytes (``time_limit`` seconds for each packing); if they do not fit, run again
    at each budget of ``shrinks`` below it. Returns the first that fits, else the last
    tried (or the one whose packing Ctrl-C stopped). ``progress`` hears each step."""
    if (ratio is None) == (budget is None):
        raise MembudgetError("give exactly one of ratio and budget")
    if not shrinks or any(not 0 <= s < 1 for s in shrinks):
        raise MembudgetError(f"shrinks must be shares in [0, 1), got {shrinks!r}")
    check_policy(policy)
    say = progress or (lambda _message: None)
    base = baseline or measure_baseline(trace)
    if ratio is not None:
        budget = int(base.peak_bytes * ratio)
    assert budget is not None
    tried: list[tuple[int, int | None]] = []
    result: RunLayout | None = None
    for k, share in enumerate(shrinks):
        run_budget = math.floor(budget * (1 - share))
        step = f"run {k + 1} of {len(shrinks)}"
        say(f"{step}: {policy} at {run_budget:,} B")
        run, log = logged_run(trace, policy, run_budget, base)
        problem: Problem | None = None
        packing: PackResult | None = None
        if log is not None:
            problem = log.problem()

            def heard(message: str, step: str = step) -> None:
                say(f"{step}: {message}")

            packing = pack(problem, capacity=budget, time_limit=time_limit, progress=heard)
        tried.append((run_budget, None if packing is None else packing.height))
        result = RunLayout(budget, run_budget, run, problem, packing, tried)
        if result.fits or (packing is not None and packing.interrupted):
            break  # (Ctrl-C stopped a packing: its best so far is the result)
    assert result is not None
    return result
