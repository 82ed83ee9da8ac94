"""Offset packing: give every buffer an address in one arena, as low as the lifetimes allow.

First a portfolio of greedy packers (TFLite/XLA best-fit orders, OLLA's pyramid
pre-placement); then, within the time limit, three exact strategies side by side: CP-SAT
(``NoOverlap2D``, in a thread: it releases the GIL) and a MiniMalloc-style canonical DFS
run two ways (restarts, discrepancy search). Each decides "does a packing fit under this
height?"; minimising, they probe heights between the max-load bound and the incumbent.
Every result is checked by the independent validator.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ortools.sat.python import cp_model

from membudget.errors import UnknownNameError
from membudget.plan.minimalloc_csv import read_csv, write_csv
from membudget.plan.problem import Problem
from membudget.plan.validate import validate

Progress = Callable[[str], None]

#: The exact strategies run side by side after the greedy portfolio: CP-SAT and the
#: canonical search by restarts and by discrepancies.
SOLVERS = ("cp-sat", "restarts", "discrepancies")
#: Above this many buffers the canonical search is skipped: its tables grow as n², a node
#: costs O(n) and it recurses once per buffer placed.
SEARCH_MAX_BUFFERS = 1000
#: Above this many buffers CP-SAT is skipped too: its NoOverlap2D memory grows as n²
#: (about 1.2 GB at 2,000 buffers), so larger problems get the greedy packing only.
CP_SAT_MAX_BUFFERS = 2000


@dataclass(frozen=True)
class PackResult:
    """A packing and what is known about it (all sizes in bytes, time in seconds)."""

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

    @property
    def fits(self) -> bool:
        """Whether every buffer lies within the capacity (always true without one)."""
        return self.capacity is None or self.height <= self.capacity


class _Instance:
    """The buffers to place, preprocessed: sizes divided by their gcd, times compressed to
    event indices; zero-size buffers sit at offset 0 and buffers live throughout (which
    overlap all others, so stacking them at the bottom loses nothing) are pre-placed."""

    def __init__(self, problem: Problem) -> None:
        bufs = [b for b in problem.buffers if b.size > 0]
        self.gcd = math.gcd(*(b.size for b in bufs)) if bufs else 1
        self.base: dict[str, int] = {b.id: 0 for b in problem.buffers if b.size == 0}
        floor = 0
        while bufs:  # stack whole-span buffers; removing some may expose more
            first, last = min(b.lower for b in bufs), max(b.upper for b in bufs)
            whole = [b for b in bufs if b.lower == first and b.upper == last]
            if not whole:
                break
            for b in sorted(whole, key=lambda b: (-b.size, b.id)):
                self.base[b.id] = floor
                floor += b.size
            bufs = [b for b in bufs if not (b.lower == first and b.upper == last)]
        self.floor = floor // self.gcd
        self.ids = [b.id for b in bufs]
        events = np.unique([t for b in bufs for t in (b.lower, b.upper)])
        self.lo = np.searchsorted(events, [b.lower for b in bufs]).astype(np.int64)
        self.hi = np.searchsorted(events, [b.upper for b in bufs]).astype(np.int64)
        self.size = np.array([b.size // self.gcd for b in bufs], dtype=np.int64)
        self.width = np.array([b.upper - b.lower for b in bufs], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def max_load(self) -> int:
        """Max load of the buffers left to place, in units."""
        if not len(self):
            return 0
        delta = np.zeros(int(self.hi.max()) + 1, dtype=np.int64)
        np.add.at(delta, self.lo, self.size)
        np.add.at(delta, self.hi, -self.size)
        return int(np.cumsum(delta).max())

    def offsets(self, units: np.ndarray) -> dict[str, int]:
        """Byte offsets of all buffers from unit offsets of the ones left to place."""
        out = dict(self.base)
        out.update((bid, (int(u) + self.floor) * self.gcd)
                   for bid, u in zip(self.ids, units, strict=True))
        return out


# ---------------------------------------------------------------------------------------
# Greedy portfolio


def _best_fit(inst: _Instance, order: np.ndarray, first_fit: bool = False,
              pinned: dict[int, int] | None = None) -> np.ndarray:
    """Place buffers in ``order`` into the smallest free gap (or lowest, with
    ``first_fit``) among the time-overlapping buffers already placed, else on top."""
    n = len(inst)
    lo, hi, size = inst.lo, inst.hi, inst.size
    off = np.full(n, -1, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i, o in (pinned or {}).items():
        off[i] = o
        placed[i] = True
    for i in order:
        if placed[i]:
            continue
        conflict = np.flatnonzero(placed & (lo < hi[i]) & (lo[i] < hi))
        if len(conflict) == 0:
            off[i] = 0
        else:
            starts = off[conflict]
            k = np.argsort(starts, kind="stable")
            starts = starts[k]
            ends = np.maximum.accumulate(starts + size[conflict][k])
            gap_lo = np.concatenate(([0], ends[:-1]))
            gap = starts - gap_lo
            fit = np.flatnonzero(gap >= size[i])
            if len(fit) == 0:
                off[i] = ends[-1]
            elif first_fit:
                off[i] = gap_lo[fit[0]]
            else:
                off[i] = gap_lo[fit[np.argmin(gap[fit])]]
        placed[i] = True
    return off


def _pyramid(inst: _Instance) -> dict[int, int]:
    """OLLA-style pre-placement: the longest-lived buffers whose lifetimes nest, stacked at
    increasing base addresses (a pyramid), as pins for a best-fit pass over the rest."""
    pins: dict[int, int] = {}
    base = 0
    outer: tuple[int, int] | None = None
    for i in np.lexsort((-inst.size, -inst.width)):
        lo, hi = int(inst.lo[i]), int(inst.hi[i])
        if outer is None or (outer[0] <= lo and hi <= outer[1]):
            pins[int(i)] = base
            base += int(inst.size[i])
            outer = (lo, hi)
    return pins


def _greedy_portfolio(inst: _Instance, deadline: float) -> tuple[np.ndarray, str]:
    """Run the greedy packers (the first always, the others while time remains) and keep
    the lowest packing."""
    size, width = inst.size, inst.width
    by_size = np.lexsort((inst.lo, -width, -size))  # TFLite greedy-by-size, XLA spatial
    by_life = np.lexsort((inst.lo, -size, -width))  # XLA temporal
    by_area = np.lexsort((inst.lo, -width, -(size * width)))
    runs: list[tuple[str, Callable[[], np.ndarray]]] = [
        ("greedy by size, best fit", lambda: _best_fit(inst, by_size)),
        ("greedy by lifetime, best fit", lambda: _best_fit(inst, by_life)),
        ("greedy by area, best fit", lambda: _best_fit(inst, by_area)),
        ("greedy by size, first fit", lambda: _best_fit(inst, by_size, first_fit=True)),
        ("pyramid pre-placement + best fit", lambda: _best_fit(inst, by_size,
                                                                pinned=_pyramid(inst))),
    ]
    best, best_name = runs[0][1](), runs[0][0]
    for name, run in runs[1:]:
        if time.perf_counter() > deadline:
            break
        off = run()
        if _height(inst, off) < _height(inst, best):
            best, best_name = off, name
    return best, best_name


def _height(inst: _Instance, off: np.ndarray) -> int:
    """Height (units, above the pre-placed floor) of unit offsets ``off``."""
    return int((off + inst.size).max()) if len(inst) else 0


# ---------------------------------------------------------------------------------------
# Canonical depth-first search (after MiniMalloc, Moffitt ASPLOS'23)


class _Interrupted(Exception):
    """The search was stopped (time limit, node limit or another solver finished)."""


class _NodeLimit(_Interrupted):
    """One heuristic's node budget ran out; round robin tries the next."""


class _CanonicalSearch:
    """Decides whether the buffers fit under a capacity by a DFS over canonical packings.

    Every packing can be pushed down until each buffer rests on 0 or on a buffer it
    overlaps in time; listing those buffers by (offset, static rank) gives one canonical
    sequence, so the search places one buffer at a time at its lowest free offset, in
    non-decreasing order. Pruning (all sound): per-section load (floor + unplaced sizes
    within capacity), dominance (no buffer at or above the lowest top any unplaced buffer
    could reach), "hatless" buffers (nothing left above them: no alternative needed),
    and splitting into independent time ranges once no unplaced buffer crosses a cut.
    The tables are read-only, so several threads can search at once.
    """

    HEURISTICS = ("WAT", "TAW", "TWA")  # static ranks: Width, Area, section Total

    def __init__(self, inst: _Instance) -> None:
        self.n = n = len(inst)
        self.size = inst.size
        self.width = inst.width
        lo, hi = inst.lo, inst.hi
        # Sections: the slots between consecutive events that end with some buffer's end
        # (the others are subsets of the next slot).
        t = int(hi.max()) + 1
        ends = np.zeros(t + 1, dtype=bool)
        ends[hi] = True
        remap = np.concatenate(([0], np.cumsum(ends[1:t])))
        self.lo, self.hi = remap[lo], remap[hi]
        self.sections = s = int(remap[-1])
        spans = self.hi - self.lo
        member_sec = np.repeat(self.lo, spans) + (
            np.arange(int(spans.sum())) - np.repeat(np.cumsum(spans) - spans, spans))
        member_buf = np.repeat(np.arange(n), spans)
        k = np.lexsort((member_buf, member_sec))
        self.members = member_buf[k]
        self.indptr = np.searchsorted(member_sec[k], np.arange(s + 1))
        self.total0 = np.zeros(s, dtype=np.int64)
        np.add.at(self.total0, member_sec, self.size[member_buf])
        self.neighbours = []
        self.block = []  # (first, last+1) section touched by the buffer or a neighbour
        for i in range(n):
            nb = np.flatnonzero((self.lo < self.hi[i]) & (self.lo[i] < self.hi))
            nb = nb[nb != i]
            self.neighbours.append(nb)
            self.block.append((int(min(self.lo[i], self.lo[nb].min(initial=s))),
                               int(max(self.hi[i], self.hi[nb].max(initial=0)))))
        cuts = np.zeros(s + 1, dtype=np.int64)  # cuts[k]: buffers live in both k and k+1
        np.add.at(cuts, self.lo, 1)
        np.add.at(cuts, self.hi - 1, -1)
        self.cuts0 = np.cumsum(cuts)[: max(s - 1, 0)]

    def restarts(self, capacity: int, stop: Callable[[], bool]) -> np.ndarray | None:
        """Offsets (units) of a packing within ``capacity``, or None if none exists.

        MiniMalloc's round robin: each static rank in turn, with a node limit doubling
        every round. Raises _Interrupted when ``stop()`` turns true (polled every 64 nodes).
        """
        if int(self.total0.max(initial=0)) > capacity:
            return None
        limit = self.n
        while True:
            limit *= 2
            for heuristic in self.HEURISTICS:
                try:
                    return self._run(capacity, heuristic, stop, node_limit=limit)[0]
                except _NodeLimit:
                    continue

    def discrepancies(self, capacity: int, stop: Callable[[], bool]) -> np.ndarray | None:
        """Like ``restarts`` but by depth-first discrepancy search on the TWA rank: taking
        a node's k-th viable child costs k, and the budget grows 0, 1, 2, ... until a
        packing turns up or a run cuts nothing (which proves there is none). It finds
        packings whose few wrong turns are near the root, where plain DFS thrashes."""
        if int(self.total0.max(initial=0)) > capacity:
            return None
        budget = 0
        while True:
            offsets, cut = self._run(capacity, "TWA", stop, discrepancies=budget)
            if offsets is not None or not cut:
                return offsets
            budget += 1

    def _rank(self, bufs: np.ndarray, total: np.ndarray, heuristic: str,
              rank: np.ndarray) -> np.ndarray:
        """A copy of ``rank`` with ``bufs`` ranked by the heuristic (descending keys)."""
        keys = {"W": self.width[bufs], "A": self.width[bufs] * self.size[bufs],
                "T": np.array([int(total[self.lo[i]:self.hi[i]].max()) for i in bufs])}
        order = np.lexsort([bufs] + [-keys[c] for c in reversed(heuristic)])
        out = rank.copy()
        out[bufs[order]] = np.arange(len(bufs))
        return out

    def _run(self, capacity: int, heuristic: str, stop: Callable[[], bool],
             node_limit: int | None = None,
             discrepancies: int | None = None) -> tuple[np.ndarray | None, bool]:
        """One DFS; returns (offsets or None, whether the discrepancy budget cut a branch).
        Raises _NodeLimit past ``node_limit`` nodes."""
        n, size, lo, hi = self.n, self.size, self.lo, self.hi
        members, indptr, neighbours, block = (self.members, self.indptr, self.neighbours,
                                              self.block)
        lo_l, hi_l, size_l = lo.tolist(), hi.tolist(), size.tolist()
        big = np.int64(1 << 62)
        no_cut = np.zeros(0, dtype=np.int64)
        offsets = np.full(n, -1, dtype=np.int64)
        nodes = [0]
        cut = [False]
        spare0 = n * n if discrepancies is None else discrepancies  # n² never binds

        def search(pa: int, pb: int, bufs: np.ndarray, rank: np.ndarray,
                   min_off: np.ndarray, free: np.ndarray, top: np.ndarray,
                   total: np.ndarray, cuts: np.ndarray, last: tuple[int, int],
                   spare: int) -> bool:
            """Place the unplaced ``bufs`` of sections [pa, pb); True once all fit."""
            nodes[0] += 1
            if node_limit is not None and nodes[0] > node_limit:
                raise _NodeLimit
            if nodes[0] % 64 == 0 and stop():
                raise _Interrupted
            todo = bufs[free[bufs]]
            if len(todo) == 0:
                return True
            cand_off = min_off[todo]
            lowest_top = int((cand_off + size[todo]).min())
            tp = total[pa:pb]
            before = np.maximum.accumulate(tp)
            after = np.maximum.accumulate(tp[::-1])[::-1]
            viable = 0
            for k in np.lexsort((rank[todo], cand_off)).tolist():
                j = int(todo[k])
                off = int(cand_off[k])
                if off >= lowest_top:
                    break  # dominated: a lower buffer could go here instead
                if (off, int(rank[j])) < last:
                    continue  # not canonical
                a, b = block[j]
                a, b = max(a, pa), min(b, pb)
                outside = max(int(before[a - 1 - pa]) if a > pa else 0,
                              int(after[b - pa]) if b < pb else 0)
                lj, hj = lo_l[j], hi_l[j]
                if off + outside > capacity or off + int(total[lj:hj].max()) > capacity:
                    continue
                new_top = off + size_l[j]
                nb = neighbours[j]
                nb = nb[free[nb]]
                m2 = min_off.copy()
                m2[nb] = np.maximum(m2[nb], new_top)
                f2 = free.copy()
                f2[j] = False
                t2 = total.copy()
                t2[lj:hj] -= size_l[j]
                top2 = top.copy()
                top2[lj:hj] = new_top
                seg = members[indptr[a]:indptr[b]]
                lowest = np.minimum.reduceat(np.where(f2[seg], m2[seg], big),
                                             indptr[a:b] - indptr[a])
                lowest[lowest == big] = 0
                floor = np.maximum(np.maximum(lowest, top2[a:b]), off)
                if (floor + t2[a:b] > capacity).any():
                    continue
                if viable > spare:
                    cut[0] = True
                    return False
                left = spare - viable
                viable += 1
                offsets[j] = off
                c2, zero = cuts, no_cut
                if hj - lj > 1:
                    c2 = cuts.copy()
                    c2[lj:hj - 1] -= 1
                    zero = np.flatnonzero(c2[lj:hj - 1] == 0) + lj + 1
                if len(zero):  # independent parts: each must be packed, in any order
                    ok = True
                    for x, y, part in self._split(pa, pb, zero, bufs[f2[bufs]]):
                        ok = search(x, y, part, self._rank(part, t2, heuristic, rank), m2, f2,
                                    top2, t2, c2, (0, -1), left)
                        if not ok:
                            break
                else:
                    ok = search(pa, pb, bufs, rank, m2, f2, top2, t2, c2,
                                (off, int(rank[j])), left)
                if ok:
                    return True
                if len(nb) == 0:
                    return False  # hatless: nothing could go above j, so no other choice helps
            return False

        free0 = np.ones(n, dtype=bool)
        rank0 = np.zeros(n, dtype=np.int64)
        for x, y, part in self._split(0, self.sections, np.flatnonzero(self.cuts0 == 0) + 1,
                                      np.arange(n)):
            if not search(x, y, part, self._rank(part, self.total0, heuristic, rank0),
                          np.zeros(n, dtype=np.int64), free0,
                          np.zeros(self.sections, dtype=np.int64), self.total0.copy(),
                          self.cuts0.copy(), (0, -1), spare0):
                return None, cut[0]
        return offsets, cut[0]

    def _split(self, pa: int, pb: int, cuts_at: np.ndarray,
               bufs: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
        """The non-empty independent parts (section range, buffers) of [pa, pb) cut at
        ``cuts_at``."""
        bounds = [pa, *cuts_at.tolist(), pb]
        for x, y in itertools.pairwise(bounds):
            part = bufs[(self.lo[bufs] >= x) & (self.hi[bufs] <= y)]
            if len(part):
                yield x, y, part


# ---------------------------------------------------------------------------------------
# The exact solvers run side by side and share the incumbent


class _Shared:
    """The best packing so far and the bounds (units), shared by the solver threads."""

    def __init__(self, inst: _Instance, off: np.ndarray, method: str, lower: int,
                 target: int | None, progress: Progress | None) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.inst = inst
        self.offsets, self.method, self.height = off, method, _height(inst, off)
        self.lower = lower
        self.target = target
        self.infeasible = False
        self.progress = progress

    def offer(self, off: np.ndarray, method: str) -> None:
        """Keep ``off`` if it is lower than the incumbent."""
        h = _height(self.inst, off)
        with self.lock:
            if h >= self.height:
                return
            self.offsets, self.method, self.height = off, method, h
        self._say(f"{method}: height {(h + self.inst.floor) * self.inst.gcd:,} B")
        self._check()

    def raise_lower(self, lower: int) -> None:
        """Record a proof that no packing is lower than ``lower``."""
        with self.lock:
            self.lower = max(self.lower, lower)
        self._check()

    def prove_infeasible(self) -> None:
        """Record a proof that nothing fits the target capacity."""
        self.infeasible = True
        self.done.set()

    def _check(self) -> None:
        if self.height <= self.lower or (self.target is not None
                                         and self.height <= self.target):
            self.done.set()

    def _say(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)


class _CpSat:
    """CP-SAT as a decision procedure on the compressed instance: ``NoOverlap2D`` of the
    fixed lifetime intervals and the offset intervals, with every offset interval inside
    [0, goal). No hint: the incumbent lies above the goal, and such a hint misleads."""

    def __init__(self, inst: _Instance, workers: int) -> None:
        self.inst = inst
        self.solver = cp_model.CpSolver()
        self.solver.parameters.num_workers = workers
        self.watch: Callable[[], bool] | None = None

    def __call__(self, goal: int, stop: Callable[[], bool]) -> np.ndarray | None:
        """Offsets (units) of a packing under ``goal``, or None if none exists; raises
        _Interrupted once ``poll`` sees ``stop()`` turn true."""
        inst = self.inst
        if int(inst.size.max()) > goal:
            return None
        model = cp_model.CpModel()
        ys, xs, yi = [], [], []
        for i, (lo, hi, s) in enumerate(zip(inst.lo.tolist(), inst.hi.tolist(),
                                             inst.size.tolist(), strict=True)):
            y = model.new_int_var(0, goal - s, f"y{i}")
            ys.append(y)
            xs.append(model.new_fixed_size_interval_var(lo, hi - lo, f"t{i}"))
            yi.append(model.new_fixed_size_interval_var(y, s, f"a{i}"))
        model.add_no_overlap_2d(xs, yi)
        self.watch = stop
        try:
            status = self.solver.solve(model)
        finally:
            self.watch = None
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return np.array([self.solver.value(y) for y in ys], dtype=np.int64)
        if status == cp_model.INFEASIBLE:
            return None
        raise _Interrupted

    def poll(self) -> None:
        """Stop the running solve if its ``stop()`` is true (CP-SAT cannot poll itself)."""
        watch = self.watch
        if watch is not None and watch():
            self.solver.stop_search()


def _search(name: str, strategy: Callable[[int, Callable[[], bool]], np.ndarray | None],
            shared: _Shared, deadline: float, first_slice: float) -> None:
    """Run one exact strategy at the target capacity, or, minimising, on goal heights: the
    lower bound first (for ``first_slice`` seconds), then bisection between the bounds.
    Packings are far easier to find than to rule out, so each goal gets a time slice; a
    goal that times out counts as too low until no goal is left between the bounds, when
    the slices double and the sweep starts again from the lower bound."""
    soft_lower, slice_, first = 0, first_slice / 2, True
    while not shared.done.is_set():
        until = deadline
        if shared.target is not None:
            goal = shared.target
        else:
            with shared.lock:
                low, high = max(soft_lower, shared.lower), shared.height - 1
                if first or low > high:
                    soft_lower, slice_, low = 0, 2 * slice_, shared.lower
                goal = low if first or low == shared.lower else (low + high) // 2
            first = False
            until = min(deadline, time.perf_counter() + slice_)

        def stop(goal: int = goal, until: float = until) -> bool:
            return (shared.done.is_set() or time.perf_counter() > until
                    or (shared.target is None
                        and not shared.lower <= goal < shared.height))

        try:
            off = strategy(goal, stop)
        except _Interrupted:
            if shared.done.is_set() or time.perf_counter() > deadline:
                return
            if time.perf_counter() > until:
                soft_lower = goal + 1
            continue
        if off is not None:
            shared.offer(off, name)
        elif shared.target is not None:
            shared.prove_infeasible()
        else:
            shared.raise_lower(goal + 1)


def pack(problem: Problem, capacity: int | None = None, time_limit: float = 10.0,
         progress: Progress | None = None, solvers: Sequence[str] = SOLVERS) -> PackResult:
    """Give every buffer an offset: minimise the arena height, or with a ``capacity`` (bytes)
    find a packing within it (once that is proven impossible, minimise with the time left).
    Returns the best valid packing found in ``time_limit`` seconds (at least a greedy one),
    checked by the independent validator. ``solvers`` picks among SOLVERS (ablations)."""
    for name in solvers:
        if name not in SOLVERS:
            raise UnknownNameError("solver", name, SOLVERS)
    start = time.perf_counter()
    deadline = start + time_limit
    say = progress or (lambda _message: None)
    lower_bytes = problem.max_load()
    inst = _Instance(problem)
    off, method = _greedy_portfolio(inst, deadline)
    greedy_height = (_height(inst, off) + inst.floor) * inst.gcd
    say(f"{method}: height {greedy_height:,} B (max load {lower_bytes:,} B)")
    lower = inst.max_load()
    infeasible = False
    if capacity is not None:
        target = capacity // inst.gcd - inst.floor
        shared = _Shared(inst, off, method, lower, target, progress)
        if lower > target:
            shared.prove_infeasible()
        _solve(inst, shared, deadline, say, solvers)
        infeasible = shared.infeasible
        off, method = shared.offsets, shared.method
        if infeasible:
            lower = max(lower, target + 1)
    shared = _Shared(inst, off, method, lower, None, progress)
    if capacity is None or infeasible:
        _solve(inst, shared, deadline, say, solvers)
    return _result(problem, inst, shared, capacity, infeasible, lower_bytes, greedy_height,
                   time.perf_counter() - start, time_limit)


def _solve(inst: _Instance, shared: _Shared, deadline: float, say: Progress,
           solvers: Sequence[str]) -> None:
    """Run the exact solvers unless the incumbent already settles the question."""
    shared.raise_lower(shared.lower)  # sets done when the incumbent is good enough
    if (0 < len(inst) <= CP_SAT_MAX_BUFFERS and not shared.done.is_set()
            and time.perf_counter() < deadline):
        _exact(inst, shared, deadline, say, solvers)


def _exact(inst: _Instance, shared: _Shared, deadline: float, say: Progress,
           solvers: Sequence[str]) -> None:
    """CP-SAT (which releases the GIL) beside the canonical searches (restarts and
    discrepancy search, sharing one core), until one settles the question or the deadline
    passes; each solver thread stops soon after the shared ``done`` is set."""
    searches = ([name for name in SOLVERS[1:] if name in solvers]
                if len(inst) <= SEARCH_MAX_BUFFERS else [])
    cp_sat = _CpSat(inst, workers=max(1, (os.cpu_count() or 2) - (1 if searches else 0)))
    cp_sat.solver.parameters.max_time_in_seconds = max(deadline - time.perf_counter(), 0.01)
    say("exact search: " + ", ".join(
        ([f"CP-SAT ({cp_sat.solver.parameters.num_workers} worker(s))"]
         if "cp-sat" in solvers else []) + [f"canonical search by {name}" for name in searches]))
    errors: list[BaseException] = []

    def run(name: str, strategy: Callable[[int, Callable[[], bool]], np.ndarray | None],
            first_slice: float) -> threading.Thread:
        def target() -> None:
            try:
                _search(name, strategy, shared, deadline, first_slice)
            except BaseException as e:  # re-raised in the calling thread below
                errors.append(e)
                shared.done.set()
        return threading.Thread(target=target, daemon=True)

    threads = []
    if "cp-sat" in solvers:  # minimising, it first spends a quarter of the time at the bound
        threads.append(run("cp-sat", cp_sat, max(1.0, (deadline - time.perf_counter()) / 4)))
    if searches:
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 3 * len(inst) + 1000))
        search = _CanonicalSearch(inst)
        threads += [run(f"canonical search, {name}", getattr(search, name), 1.0)
                    for name in searches]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                cp_sat.poll()
                if shared.done.is_set() or time.perf_counter() > deadline:
                    cp_sat.solver.stop_search()
                thread.join(0.05)
    finally:
        shared.done.set()
        cp_sat.solver.stop_search()
    if errors:
        raise errors[0]


def _result(problem: Problem, inst: _Instance, shared: _Shared, capacity: int | None,
            infeasible: bool, lower: int, greedy_height: int, seconds: float,
            time_limit: float) -> PackResult:
    """Check the packing independently and describe what is known about it."""
    offsets = inst.offsets(shared.offsets)
    height = validate(problem, offsets)
    optimal = height <= lower or shared.height <= shared.lower
    fits = capacity is None or height <= capacity
    if optimal and height == lower:
        what = f"height {height:,} B is optimal (= max load)"
    elif optimal:
        what = f"height {height:,} B is optimal (exhaustive search; max load {lower:,} B)"
    else:
        what = f"height {height:,} B, max load {lower:,} B: not proven optimal"
    if capacity is not None:
        if fits:
            what = f"fits capacity {capacity:,} B; {what}"
        elif infeasible:
            why = "max load exceeds it" if lower > capacity else "exhaustive search"
            what = f"proven: nothing fits capacity {capacity:,} B ({why}); best {what}"
        else:
            what = (f"no packing within capacity {capacity:,} B found in {time_limit:g} s "
                    f"(not proven impossible); best {what}")
    if not optimal and (capacity is None or infeasible):
        what += (f" (time limit {time_limit:g} s reached)" if len(inst) <= CP_SAT_MAX_BUFFERS
                 else f" (greedy only above {CP_SAT_MAX_BUFFERS:,} buffers)")
    return PackResult(offsets=offsets, height=height, lower_bound=lower,
                      greedy_height=greedy_height, proven_optimal=optimal,
                      proven_infeasible=infeasible, method=shared.method,
                      seconds=seconds, message=what, capacity=capacity)


def pack_file(path: str | Path, capacity: int | None = None, time_limit: float = 10.0,
              out: str | Path | None = None,
              progress: Progress | None = None) -> tuple[PackResult, int]:
    """Pack a MiniMalloc CSV; write the solution (with ``offset``) to ``out`` if given.

    Exit code 0 when every buffer fits (always, without a capacity), else 1.
    """
    problem = read_csv(path)
    result = pack(problem, capacity, time_limit, progress)
    if out is not None:
        write_csv(out, problem.with_offsets(result.offsets))
    return result, 0 if result.fits else 1
