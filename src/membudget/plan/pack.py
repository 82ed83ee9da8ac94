"""Offset packing: give every buffer an address in one arena, as low as the lifetimes allow.

A portfolio of greedy packers first (several orders and tie-breaks, best and first fit,
OLLA's pyramid pre-placement), on the whole problem. Then the problem is split into its
independent components (:mod:`.packing.decompose`), and each one whose packing is above what
is needed is searched, within the time left: whole by the exact solvers racing
(:mod:`.packing.exact`: CP-SAT and the canonical search) up to
:data:`~.packing.exact.EXACT_MAX_BUFFERS` buffers, window by window above that
(:mod:`.packing.windows`). Every result is checked by the independent validator.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from membudget.errors import UnknownNameError
from membudget.plan import interrupt
from membudget.plan.minimalloc_csv import read_csv, write_csv
from membudget.plan.packing import windows
from membudget.plan.packing.canonical import DEFAULT_OPTIONS, Options
from membudget.plan.packing.decompose import components
from membudget.plan.packing.exact import EXACT_MAX_BUFFERS, SOLVERS, Incumbent, Progress, race
from membudget.plan.packing.greedy import portfolio
from membudget.plan.packing.instance import Instance
from membudget.plan.problem import Problem
from membudget.plan.validate import validate

__all__ = ["EXACT_MAX_BUFFERS", "SOLVERS", "PackResult", "pack", "pack_file"]

#: Share of the time limit the greedy portfolio may use beyond its first packer.
GREEDY_SHARE = 0.25


@dataclass(frozen=True)
class PackResult:
    """A packing and what is known about it (all sizes in bytes, time in seconds).

    ``lower_bound`` is the best proven bound: the max load, or higher once a search has
    ruled out every height below it. ``interrupted``: Ctrl-C stopped the run, which
    returned its best packing so far. ``greedy`` lists each greedy packer that ran with its
    height; ``searched`` says what searched after them (empty when the greedy packing
    needed no search or no time was left)."""

    offsets: dict[str, int]
    height: int
    lower_bound: int
    greedy_height: int
    proven_optimal: bool
    proven_infeasible: bool
    method: str
    seconds: float
    message: str
    capacity: int | None = None
    max_load: int = 0
    greedy: tuple[tuple[str, int], ...] = ()
    searched: str = ""
    interrupted: bool = False

    @property
    def fits(self) -> bool:
        """Whether every buffer lies within the capacity (always true without one)."""
        return self.capacity is None or self.height <= self.capacity

    @property
    def gap(self) -> float:
        """How far the height is above the lower bound, as a fraction of the bound."""
        return self.height / self.lower_bound - 1 if self.lower_bound else 0.0


@interrupt.sigint_stops()
def pack(problem: Problem, capacity: int | None = None, time_limit: float = 10.0,
         progress: Progress | None = None, solvers: Sequence[str] = SOLVERS,
         options: Options = DEFAULT_OPTIONS) -> PackResult:
    """Give every buffer an offset: minimise the arena height, or with a ``capacity`` (bytes)
    find a packing within it (once that is proven impossible, minimise with the time left).
    Returns the best valid packing found in ``time_limit`` seconds (at least one greedy
    packing), checked by the independent validator; Ctrl-C stops the search and returns the
    best packing so far (:mod:`.interrupt`). ``solvers`` picks among SOLVERS and ``options``
    switches the canonical search's rules (ablations)."""
    for name in solvers:
        if name not in SOLVERS:
            raise UnknownNameError("solver", name, SOLVERS)
    start = time.perf_counter()
    deadline = start + time_limit
    say = progress or (lambda _message: None)
    inst = Instance(problem)
    max_load = problem.max_load()
    best, method, runs = np.zeros(0, dtype=np.int64), "nothing to place", []
    bound = inst.max_load()
    for packer, off in portfolio(inst, start + GREEDY_SHARE * time_limit):
        runs.append((packer.name, inst.bytes(inst.height(off))))
        if not len(best) or inst.height(off) < inst.height(best):
            best, method = off, packer.name
        if inst.height(best) <= bound or interrupt.requested():
            break  # optimal (no packer can do better), or Ctrl-C
    greedy_height = inst.bytes(inst.height(best))
    say(f"{method}: height {greedy_height:,} B ({len(runs)} greedy packers; max load "
        f"{max_load:,} B)")
    solve = _Components(inst, best, method, solvers, options, say)
    target = None if capacity is None else capacity // inst.gcd - inst.floor
    solve.run(deadline, target)
    if solve.infeasible:  # minimise with the time left
        solve.run(deadline, None)
    infeasible = solve.infeasible
    return _result(problem, inst, solve, capacity, infeasible, max_load, greedy_height,
                   tuple(runs), time.perf_counter() - start, time_limit, interrupt.requested())


class _Components:
    """The packing of each independent component and what is proven about it; searches
    the ones that stand in the way of the goal, highest first."""

    def __init__(self, inst: Instance, off: np.ndarray, method: str, solvers: Sequence[str],
                 options: Options, say: Progress) -> None:
        self.inst = inst
        self.offsets = off.copy()
        self.parts = (components(inst) if options.decompose
                      else [np.arange(len(inst))] if len(inst) else [])
        loads = [inst.part(p).max_load() for p in self.parts]
        self.lower = dict(enumerate(loads))  # proven lower bound of each part
        self.method = {k: method for k in range(len(self.parts))}
        self.bound = max(loads, default=0)  # no packing of the whole is lower
        self.solvers, self.options, self.say = solvers, options, say
        self.infeasible = False
        self.ran: set[str] = set()
        self.windows = 0  # windows tried by the windowed search

    def height(self, k: int | None = None) -> int:
        """Height (units) of part k, or of the whole."""
        if k is None:
            return self.inst.height(self.offsets)
        part = self.parts[k]
        return int((self.offsets[part] + self.inst.size[part]).max())

    def optimal(self, k: int) -> bool:
        """Whether part k is proven optimal (no packing of it is lower)."""
        return self.height(k) <= self.lower[k]

    def run(self, deadline: float, target: int | None) -> None:
        """Search the parts above ``target`` (deciding) or above the best bound (minimising),
        each with a share of the time left in proportion to its buffers."""
        if target is not None and self.bound > target:
            self.infeasible = True
            return
        todo = [k for k in range(len(self.parts))
                if self.height(k) > (self.bound if target is None else target)
                and not self.optimal(k)]
        left = sum(len(self.parts[k]) for k in todo)
        for k in sorted(todo, key=lambda k: -self.height(k)):
            now = time.perf_counter()
            if now >= deadline or interrupt.requested():
                return
            share = now + (deadline - now) * len(self.parts[k]) / left
            left -= len(self.parts[k])
            if self._search(k, share, target).infeasible:
                self.infeasible = True
                return

    def _search(self, k: int, deadline: float, target: int | None) -> Incumbent:
        """Search part k until it is settled or the deadline passes; keep what it found."""
        part = self.parts[k]
        sub = self.inst.part(part)
        inc = Incumbent(sub, self.offsets[part], self.method[k], self.lower[k], target,
                        enough=self.bound, progress=self.say)
        with interrupt.stopping(inc.done.set):  # Ctrl-C settles it as it is
            if len(sub) <= EXACT_MAX_BUFFERS:
                race(inc, deadline, self.solvers, self.options, self.say)
            elif not inc.done.is_set() and "cp-sat" in self.solvers:
                self.say(f"windowed CP-SAT on a part of {len(sub):,} buffers")
                windows.improve(inc, deadline)
        self.ran.update(inc.ran)
        self.windows += inc.windows
        self.offsets[part] = inc.offsets
        self.method[k] = inc.method
        self.lower[k] = inc.lower
        if inc.infeasible and target is not None:  # nothing fits the target
            self.lower[k] = max(inc.lower, target + 1)
        self.bound = max(self.bound, self.lower[k])
        return inc

    @property
    def proven_optimal(self) -> bool:
        """Whether the whole is proven optimal: at the bound, or every part as high as the
        whole is proven optimal."""
        h = self.height()
        return h <= self.bound or all(self.optimal(k) for k in range(len(self.parts))
                                      if self.height(k) == h)

    def winner(self) -> str:
        """What made the highest part's packing."""
        h = self.height()
        return next((self.method[k] for k in range(len(self.parts)) if self.height(k) == h),
                    next(iter(self.method.values()), "nothing to place"))


def _result(problem: Problem, inst: Instance, solve: _Components, capacity: int | None,
            infeasible: bool, max_load: int, greedy_height: int,
            runs: tuple[tuple[str, int], ...], seconds: float, time_limit: float,
            interrupted: bool) -> PackResult:
    """Check the packing independently and describe what is known about it."""
    offsets = inst.offsets(solve.offsets)
    height = validate(problem, offsets)
    lower = max(max_load, inst.bytes(solve.bound))
    if infeasible and capacity is not None:
        lower = max(lower, capacity + 1)
    optimal = height <= lower or solve.proven_optimal
    fits = capacity is None or height <= capacity
    if height <= max_load:
        what = f"height {height:,} B is optimal (= max load)"
    elif optimal:
        what = f"height {height:,} B is optimal (exhaustive search; max load " \
               f"{max_load:,} B)"
    else:
        what = (f"height {height:,} B, lower bound {lower:,} B (gap "
                f"{height / lower - 1:.3%}): not proven optimal")
    if capacity is not None:
        if fits:
            what = f"fits capacity {capacity:,} B; {what}"
        elif infeasible:
            why = "max load exceeds it" if max_load > capacity else \
                "exhaustive search"
            what = f"proven: nothing fits capacity {capacity:,} B ({why}); best {what}"
        else:
            what = (f"no packing within capacity {capacity:,} B found in {time_limit:g} s "
                    f"(not proven impossible); best {what}")
    searched = ", ".join(sorted(solve.ran) + (
        [f"windowed CP-SAT ({solve.windows:,} window(s))"] if solve.windows else []))
    what += f"; {len(runs)} greedy packer(s)" + (f", then {searched}" if searched else "")
    if len(solve.parts) > 1:
        what += f" on {len(solve.parts):,} independent parts"
    if interrupted:
        what += f" (interrupted after {seconds:.1f} s: the best packing found so far)"
    elif not optimal and seconds >= time_limit:
        what += f" (time limit {time_limit:g} s reached)"
    return PackResult(offsets=offsets, height=height, lower_bound=lower,
                      greedy_height=greedy_height, proven_optimal=optimal,
                      proven_infeasible=infeasible, method=solve.winner(),
                      seconds=seconds, message=what, capacity=capacity,
                      max_load=max_load, greedy=runs, searched=searched,
                      interrupted=interrupted)


def pack_file(path: str | Path, capacity: int | None = None, time_limit: float = 10.0,
              out: str | Path | None = None, progress: Progress | None = None,
              write_unfit: bool = False) -> tuple[PackResult, int]:
    """Pack a MiniMalloc CSV and write the solution (with ``offset``) to ``out`` if given:
    a packing that does not fit the capacity only with ``write_unfit``.

    Exit code 130 when Ctrl-C stopped the search, else 0 when every buffer fits (always,
    without a capacity), else 1.
    """
    problem = read_csv(path)
    result = pack(problem, capacity, time_limit, progress)
    if out is not None and (result.fits or write_unfit):
        write_csv(out, problem.with_offsets(result.offsets))
    return result, (interrupt.EXIT_CODE if result.interrupted else 0 if result.fits else 1)
