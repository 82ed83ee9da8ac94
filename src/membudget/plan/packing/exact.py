"""The exact solvers run side by side on one instance and share the incumbent: CP-SAT (in
a thread: it releases the GIL) beside the canonical search by restarts and by discrepancies.
Each decides "does a packing fit under this height?"; minimising, they probe heights between
the proven lower bound and the incumbent."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from membudget.plan.packing.canonical import (
    DEFAULT_OPTIONS,
    CanonicalSearch,
    Interrupted,
    Options,
    Stop,
)
from membudget.plan.packing.cp_sat import CpSat
from membudget.plan.packing.instance import Instance

Progress = Callable[[str], None]
Strategy = Callable[[int, Stop], "np.ndarray | None"]

#: The exact strategies: CP-SAT and the canonical search by restarts and by discrepancies.
SOLVERS = ("cp-sat", "restarts", "discrepancies")
#: Largest instance the exact solvers take whole: the canonical search's tables grow as n²
#: and a node costs O(n); CP-SAT's NoOverlap2D memory grows as n² (over 1 GB at 2,000
#: buffers). Larger parts are improved window by window (:mod:`.windows`).
EXACT_MAX_BUFFERS = 1000


class Incumbent:
    """The best packing of one instance so far and its bounds (units), shared by the solver
    threads. Minimising, it is settled at ``enough`` (a height that needs no improving) or
    at the proven lower bound; deciding (``target``), once a packing fits or none can."""

    def __init__(self, inst: Instance, off: np.ndarray, method: str, lower: int,
                 target: int | None = None, enough: int = 0,
                 progress: Progress | None = None) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.inst = inst
        self.offsets, self.method, self.height = off, method, inst.height(off)
        self.lower = lower
        self.target = target
        self.enough = enough
        self.infeasible = False
        self.progress = progress
        self.ran: list[str] = []  # the searches started on it, as messages name them
        self.windows = 0  # windows tried by the windowed search
        self._check()

    def offer(self, off: np.ndarray, method: str) -> None:
        """Keep ``off`` if it is lower than the incumbent."""
        h = self.inst.height(off)
        with self.lock:
            if h >= self.height:
                return
            self.offsets, self.method, self.height = off, method, h
        if self.progress is not None:
            self.progress(f"{method}: height {self.inst.bytes(h):,} B")
        self._check()

    def raise_lower(self, lower: int) -> None:
        """Record a proof that no packing is lower than ``lower``."""
        with self.lock:
            self.lower = max(self.lower, lower)
        self._check()

    def prove_infeasible(self) -> None:
        """Record a proof that nothing fits the target."""
        self.infeasible = True
        self.done.set()

    @property
    def proven_optimal(self) -> bool:
        """Whether no packing is lower than the incumbent."""
        return self.height <= self.lower

    def _check(self) -> None:
        if self.target is not None:
            if self.height <= self.target:
                self.done.set()
            elif self.lower > self.target:
                self.prove_infeasible()
        elif self.height <= max(self.lower, self.enough):
            self.done.set()


def _probe(name: str, strategy: Strategy, inc: Incumbent, deadline: float,
           first_slice: float) -> None:
    """Run one exact strategy at the target, or, minimising, on goal heights: the lower
    bound first (for ``first_slice`` seconds), then bisection between the bounds. Packings
    are far easier to find than to rule out, so each goal gets a time slice; a goal that
    times out counts as too low until no goal is left between the bounds, when the slices
    double and the sweep starts again from the lower bound."""
    soft_lower, slice_, first = 0, first_slice / 2, True
    while not inc.done.is_set():
        until = deadline
        if inc.target is not None:
            goal = inc.target
        else:
            with inc.lock:
                low, high = max(soft_lower, inc.lower, inc.enough), inc.height - 1
                if first or low > high:
                    soft_lower, slice_ = 0, 2 * slice_
                    low = max(inc.lower, inc.enough)
                goal = low if first or low == max(inc.lower, inc.enough) else (low + high) // 2
            first = False
            until = min(deadline, time.perf_counter() + slice_)

        def stop(goal: int = goal, until: float = until) -> bool:
            return (inc.done.is_set() or time.perf_counter() > until
                    or (inc.target is None and not inc.lower <= goal < inc.height))

        try:
            off = strategy(goal, stop)
        except Interrupted:
            if inc.done.is_set() or time.perf_counter() > deadline:
                return
            if time.perf_counter() > until:
                soft_lower = goal + 1
            continue
        if off is not None:
            inc.offer(off, name)
        elif inc.target is not None:
            inc.prove_infeasible()
        else:
            inc.raise_lower(goal + 1)


def race(inc: Incumbent, deadline: float, solvers: Sequence[str] = SOLVERS,
         options: Options = DEFAULT_OPTIONS, progress: Progress | None = None) -> None:
    """CP-SAT beside the canonical searches (sharing one core) until one settles the
    question, the deadline passes or ``inc.done`` is set (as Ctrl-C does); every solver
    thread has stopped when it returns, or raises (KeyboardInterrupt: a hard stop).
    ``inc.ran`` names the solvers started."""
    inst = inc.inst
    if inc.done.is_set() or time.perf_counter() >= deadline or not len(inst):
        return
    searches = [name for name in SOLVERS[1:] if name in solvers]
    cp_sat = CpSat(inst, workers=max(1, (os.cpu_count() or 2) - (1 if searches else 0)))
    cp_sat.solver.parameters.max_time_in_seconds = max(deadline - time.perf_counter(), 0.01)
    ran = ([f"CP-SAT ({cp_sat.solver.parameters.num_workers} worker(s))"]
           if "cp-sat" in solvers else []) + [f"canonical search by {name}"
                                              for name in searches]
    inc.ran += ran
    if progress is not None:
        progress(f"exact search on {len(inst):,} buffers: " + ", ".join(ran))
    errors: list[BaseException] = []

    def run(name: str, strategy: Strategy, first_slice: float) -> threading.Thread:
        def target() -> None:
            try:
                _probe(name, strategy, inc, deadline, first_slice)
            except BaseException as e:  # re-raised in the calling thread below
                errors.append(e)
                inc.done.set()
        return threading.Thread(target=target, daemon=True)

    threads = []
    if "cp-sat" in solvers:  # minimising, it first spends a quarter of the time at the bound
        threads.append(run("cp-sat", cp_sat, max(1.0, (deadline - time.perf_counter()) / 4)))
    if searches:
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 3 * len(inst) + 1000))
        search = CanonicalSearch(inst, options)
        threads += [run(f"canonical search, {name}", getattr(search, name), 1.0)
                    for name in searches]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                cp_sat.poll()
                if inc.done.is_set() or time.perf_counter() > deadline:
                    cp_sat.solver.stop_search()
                thread.join(0.05)
    finally:
        inc.done.set()
        cp_sat.solver.stop_search()
        for thread in threads:  # a solver thread alive at exit aborts the process
            while thread.is_alive():
                cp_sat.solver.stop_search()
                thread.join(0.05)
    if errors:
        raise errors[0]
