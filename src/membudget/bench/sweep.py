"""Sweeps: many (trace, method, ratio) simulations on all cores, with a progress bar."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from membudget.errors import MembudgetError
from membudget.sim.budgets import BudgetLimits, budget_limits
from membudget.sim.method import Method
from membudget.sim.simulate import (
    DEFAULT_OVERHEAD_LIMIT,
    Baseline,
    SimResult,
    check_config,
    measure_baseline,
    simulate,
)
from membudget.trace import load_trace
from membudget.trace.format import Trace

DEFAULT_POLICIES = ("dtr", "dtr-eq", "msps", "lru", "size")
DEFAULT_RATIOS = (0.9, 0.7, 0.5, 0.4, 0.3, 0.2)

J = TypeVar("J", bound=tuple)
R = TypeVar("R")

_TRACES: list[Trace] = []
_BASELINES: list[Baseline] = []


def _init(traces: list[Trace], baselines: list[Baseline]) -> None:
    global _TRACES, _BASELINES
    _TRACES, _BASELINES = traces, baselines


def _simulate(job: tuple[int, Method, float], opts: dict[str, Any]) -> SimResult:
    i, m, ratio = job
    r = simulate(_TRACES[i], m.policy, ratio=ratio, baseline=_BASELINES[i],
                 allocator=m.allocator, inplace=m.inplace, swap=m.swap, **opts)
    r.method = m.name
    return r


def _limits(job: tuple[int, Method], opts: dict[str, Any]) -> BudgetLimits:
    i, m = job
    return budget_limits(_TRACES[i], m.policy, allocator=m.allocator, inplace=m.inplace,
                         baseline=_BASELINES[i], method=m.name, swap=m.swap, **opts)


def _methods(methods: Sequence[Method | str], semantics: str,
             swaps: Sequence[str] = ("off",)) -> list[Method]:
    """Each method once per swap mode of ``swaps``, checked before any work."""
    if not swaps:
        raise MembudgetError("give at least one swap mode")
    parsed = [m if isinstance(m, Method) else Method.parse(m) for m in methods]
    out = [replace(m, swap=s) for m in parsed for s in swaps]
    for m in out:  # bad names and combinations fail before any work
        check_config(m.policy, m.allocator, m.inplace, semantics, swap=m.swap)
    return out


def _load(traces: Sequence[Trace | str]) -> tuple[list[Trace], list[Baseline]]:
    loaded = [t if isinstance(t, Trace) else load_trace(t) for t in traces]
    return loaded, [measure_baseline(t) for t in loaded]


def _parallel(fn: Callable[[J, dict[str, Any]], R], jobs: list[J], opts: dict[str, Any],
              loaded: list[Trace], baselines: list[Baseline], workers: int | None,
              console: Console | None, progress: bool, what: str,
              describe: Callable[[J], str]) -> dict[J, R]:
    """Run ``fn(job, opts)`` for every job on ``workers`` processes that share the traces;
    the longest traces go first so the cores finish together."""
    console = console or Console(stderr=True, emoji=False)
    order = sorted(jobs, key=lambda j: -len(loaded[j[0]].events))
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    results: dict[J, R] = {}
    bar = Progress(TextColumn(f"[bold]{what}[/]"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.description}", markup=False),
                   console=console, disable=not progress, transient=False)
    with bar:
        task = bar.add_task("", total=len(jobs))
        if workers == 1:
            _init(loaded, baselines)
            for job in order:
                results[job] = fn(job, opts)
                bar.update(task, advance=1, description=describe(job))
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                                     initargs=(loaded, baselines)) as pool:
                futures = {pool.submit(fn, job, opts): job for job in order}
                for fut in as_completed(futures):
                    job = futures[fut]
                    results[job] = fut.result()
                    bar.update(task, advance=1, description=describe(job))
    return results


def sweep(traces: Sequence[Trace | str], methods: Sequence[Method | str] = DEFAULT_POLICIES,
          ratios: Sequence[float] = DEFAULT_RATIOS, *, semantics: str = "membudget",
          overhead_limit: float | None = DEFAULT_OVERHEAD_LIMIT, workers: int | None = None,
          seed: int = 0, console: Console | None = None,
          progress: bool = True, swaps: Sequence[str] = ("off",)) -> list[SimResult]:
    """Simulate every method (a policy name, ``policy@allocator+inplace`` or a
    :class:`Method`) under every swap mode at every ratio on every trace; results in (trace,
    method, ratio) order. Traces are loaded once; ``workers`` processes (default: all cores)
    share them."""
    ms = _methods(methods, semantics, swaps)
    for r in ratios:
        if not r > 0:
            raise ValueError(f"ratios must be > 0, got {r}")
    loaded, baselines = _load(traces)
    jobs = [(i, m, r) for i in range(len(loaded)) for m in ms for r in ratios]
    opts = {"semantics": semantics, "overhead_limit": overhead_limit, "seed": seed}
    results = _parallel(_simulate, jobs, opts, loaded, baselines, workers, console, progress,
                        "sweep", lambda j: f"{loaded[j[0]].name} {j[1].name} @ {j[2]:g}")
    return [results[j] for j in jobs]


def limits(traces: Sequence[Trace | str], methods: Sequence[Method | str] = DEFAULT_POLICIES,
           *, semantics: str = "membudget",
           overhead_limit: float | None = DEFAULT_OVERHEAD_LIMIT, tolerance: float = 0.01,
           workers: int | None = None, seed: int = 0, console: Console | None = None,
           progress: bool = True, swaps: Sequence[str] = ("off",)) -> list[BudgetLimits]:
    """The minimum and cutoff budget of every method under every swap mode on every trace,
    by bisection."""
    ms = _methods(methods, semantics, swaps)
    loaded, baselines = _load(traces)
    jobs = [(i, m) for i in range(len(loaded)) for m in ms]
    opts = {"semantics": semantics, "overhead_limit": overhead_limit, "seed": seed,
            "tolerance": tolerance}
    results = _parallel(_limits, jobs, opts, loaded, baselines, workers, console, progress,
                        "bisect", lambda j: f"{loaded[j[0]].name} {j[1].name}")
    return [results[j] for j in jobs]
