"""Sweeps: many (trace, policy, ratio) simulations on all cores, with a progress bar."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from membudget.core.policies import make_policy
from membudget.sim.simulate import (
    DEFAULT_OVERHEAD_LIMIT,
    Baseline,
    SimResult,
    measure_baseline,
    simulate,
)
from membudget.trace import load_trace
from membudget.trace.format import Trace

DEFAULT_POLICIES = ("dtr", "dtr-eq", "msps", "lru", "size")
DEFAULT_RATIOS = (0.9, 0.7, 0.5, 0.4, 0.3, 0.2)


@dataclass(frozen=True)
class Job:
    trace: int  # index into the sweep's traces
    policy: str
    ratio: float


_TRACES: list[Trace] = []
_BASELINES: list[Baseline] = []


def _init(traces: list[Trace], baselines: list[Baseline]) -> None:
    global _TRACES, _BASELINES
    _TRACES, _BASELINES = traces, baselines


def _run(job: Job, semantics: str, overhead_limit: float | None, seed: int) -> SimResult:
    return simulate(_TRACES[job.trace], job.policy, ratio=job.ratio, semantics=semantics,
                    overhead_limit=overhead_limit, baseline=_BASELINES[job.trace], seed=seed)


def sweep(traces: Sequence[Trace | str], policies: Sequence[str] = DEFAULT_POLICIES,
          ratios: Sequence[float] = DEFAULT_RATIOS, *, semantics: str = "membudget",
          overhead_limit: float | None = DEFAULT_OVERHEAD_LIMIT, workers: int | None = None,
          seed: int = 0, console: Console | None = None,
          progress: bool = True) -> list[SimResult]:
    """Simulate every policy at every ratio on every trace; results in (trace, policy, ratio)
    order. Traces are loaded once; ``workers`` processes (default: all cores) share them."""
    for p in policies:
        make_policy(p)  # unknown names fail before any work
    for r in ratios:
        if not r > 0:
            raise ValueError(f"ratios must be > 0, got {r}")
    console = console or Console(stderr=True)
    loaded = [t if isinstance(t, Trace) else load_trace(t) for t in traces]
    baselines = [measure_baseline(t) for t in loaded]
    jobs = [Job(i, p, r) for i in range(len(loaded)) for p in policies for r in ratios]
    # Longest first (big traces, small ratios) so the cores finish together.
    order = sorted(jobs, key=lambda j: (-len(loaded[j.trace].events), j.ratio))
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    results: dict[Job, SimResult] = {}
    bar = Progress(TextColumn("[bold]sweep[/]"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.description}"), console=console,
                   disable=not progress, transient=False)
    with bar:
        task = bar.add_task("", total=len(jobs))
        if workers == 1:
            _init(loaded, baselines)
            for job in order:
                results[job] = _run(job, semantics, overhead_limit, seed)
                bar.update(task, advance=1, description=_describe(loaded, job))
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                                     initargs=(loaded, baselines)) as pool:
                futures = {pool.submit(_run, job, semantics, overhead_limit, seed): job
                           for job in order}
                for fut in as_completed(futures):
                    job = futures[fut]
                    results[job] = fut.result()
                    bar.update(task, advance=1, description=_describe(loaded, job))
    return [results[j] for j in jobs]


def _describe(traces: list[Trace], job: Job) -> str:
    return f"{traces[job.trace].name} {job.policy} @ {job.ratio:g}"
