"""Canonical depth-first search (after MiniMalloc, Moffitt ASPLOS'23): does a packing fit
under a capacity?

Every packing can be pushed down until each buffer rests on 0 or on a buffer it overlaps in
time, so the search places one buffer at a time right on top of its placed neighbours. Its
rules are named options (:class:`Options`), each sound on its own, so they can be switched
off and checked against brute force one by one. The state is changed in place and undone
from a trail, and the tables are read-only, so several threads can search at once. Compiled
by mypyc, like the core (setup.py): it is the inner loop of ``membudget pack``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import numpy as np

from membudget.plan.packing.instance import Instance

Stop = Callable[[], bool]


@dataclass(frozen=True)
class Options:
    """The search's rules; every combination is exact, the defaults are the fastest."""

    #: Only canonical sequences: buffers placed in non-decreasing (offset, rank), so each
    #: packing is visited once. Off: every order of placement (the brute force).
    canonical: bool = True
    #: Section inference: prune once a time section's floor plus the sizes still to place
    #: in it exceed the capacity.
    section_load: bool = True
    #: Dominance: no buffer at or above the lowest top some unplaced buffer could reach
    #: (that buffer could go below it instead). Needs ``canonical``.
    dominance: bool = True
    #: Hatless pruning: once a buffer with nothing unplaced above it fails, no alternative
    #: at that node can help.
    hatless: bool = True
    #: Decomposition: once no unplaced buffer crosses a time cut, pack the sides
    #: separately (each must succeed); :func:`membudget.plan.pack.pack` also splits the
    #: whole problem into its independent components first.
    decompose: bool = True

    @classmethod
    def combinations(cls) -> Iterator[Options]:
        """Every combination of the rules (for tests and ablations)."""
        names = [f.name for f in fields(cls)]
        for values in itertools.product((False, True), repeat=len(names)):
            yield cls(**dict(zip(names, values, strict=True)))


DEFAULT_OPTIONS = Options()


class Interrupted(Exception):
    """The search was stopped (time limit, node limit or another solver finished)."""


class NodeLimit(Interrupted):
    """One heuristic's node budget ran out; round robin tries the next."""


class CanonicalSearch:
    """The read-only tables of one instance (sections, members, neighbours) and the two
    ways to run the search: MiniMalloc's restarts and discrepancy search."""

    HEURISTICS = ("WAT", "TAW", "TWA")  # static ranks: Width, Area, section Total

    def __init__(self, inst: Instance, options: Options = DEFAULT_OPTIONS) -> None:
        self.options = options
        self.n = n = len(inst)
        size = inst.size
        # Sections: the slots between consecutive events that end with some buffer's end
        # (the others are subsets of the next slot).
        t = int(inst.hi.max()) + 1 if n else 1
        ends = np.zeros(t + 1, dtype=bool)
        ends[inst.hi] = True
        remap = np.concatenate(([0], np.cumsum(ends[1:t])))
        lo, hi = remap[inst.lo], remap[inst.hi]
        self.sections = s = int(remap[-1])
        spans = hi - lo
        member_sec = np.repeat(lo, spans) + (
            np.arange(int(spans.sum())) - np.repeat(np.cumsum(spans) - spans, spans))
        member_buf = np.repeat(np.arange(n), spans)
        k = np.lexsort((member_buf, member_sec))
        indptr = np.searchsorted(member_sec[k], np.arange(s + 1))
        total = np.zeros(s, dtype=np.int64)
        np.add.at(total, member_sec, size[member_buf])
        cuts = np.zeros(s + 1, dtype=np.int64)  # cuts[k]: buffers live in both k and k+1
        np.add.at(cuts, lo, 1)
        np.add.at(cuts, hi - 1, -1)
        ids = np.arange(n)
        neighbours = [np.flatnonzero((lo < hi[i]) & (lo[i] < hi) & (ids != i)) for i in ids]
        # The search reads plain lists (see _Dfs); the arrays above only build them.
        self.lo: list[int] = lo.tolist()
        self.hi: list[int] = hi.tolist()
        self.size: list[int] = size.tolist()
        self.width: list[int] = inst.width.tolist()
        self.members: list[list[int]] = (  # the buffers live in each section
            [m.tolist() for m in np.split(member_buf[k], indptr[1:-1])] if s else [])
        self.total0: list[int] = total.tolist()  # sizes live in each section
        self.cuts0: list[int] = np.cumsum(cuts)[: max(s - 1, 0)].tolist()
        self.neighbours: list[list[int]] = [nb.tolist() for nb in neighbours]
        self.block: list[tuple[int, int]] = [  # sections touched by i or a neighbour
            (int(min(lo[i], lo[nb].min(initial=s))), int(max(hi[i], hi[nb].max(initial=0))))
            for i, nb in enumerate(neighbours)]

    def restarts(self, capacity: int, stop: Stop) -> np.ndarray | None:
        """Offsets (units) of a packing within ``capacity``, or None if none exists.

        MiniMalloc's round robin: each static rank in turn, with a node limit doubling
        every round. Raises Interrupted once ``stop()`` turns true (polled every 64 nodes).
        """
        if max(self.total0, default=0) > capacity:
            return None
        limit = self.n
        while True:
            limit *= 2
            for heuristic in self.HEURISTICS:
                try:
                    return _Dfs(self, capacity, heuristic, stop, node_limit=limit).run()[0]
                except NodeLimit:
                    continue

    def discrepancies(self, capacity: int, stop: Stop) -> np.ndarray | None:
        """Like ``restarts`` but by depth-first discrepancy search on the TWA rank: taking
        a node's k-th viable child costs k, and the budget grows 0, 1, 2, ... until a
        packing turns up or a run cuts nothing (which proves there is none). It finds
        packings whose few wrong turns are near the root, where plain DFS thrashes."""
        if max(self.total0, default=0) > capacity:
            return None
        budget = 0
        while True:
            offsets, cut = _Dfs(self, capacity, "TWA", stop, discrepancies=budget).run()
            if offsets is not None or not cut:
                return offsets
            budget += 1

    def rank(self, bufs: list[int], total: list[int], heuristic: str,
             rank: list[int]) -> None:
        """Rank ``bufs`` in place in ``rank`` by the heuristic (descending keys, then id)."""
        lo, hi, width, size = self.lo, self.hi, self.width, self.size
        keys = {"W": lambda i: width[i], "A": lambda i: width[i] * size[i],
                "T": lambda i: max(total[lo[i]:hi[i]])}
        order = sorted(bufs, key=lambda i: (*(-keys[c](i) for c in heuristic), i))
        for r, i in enumerate(order):
            rank[i] = r

    def split(self, pa: int, pb: int, cuts_at: list[int],
              bufs: list[int]) -> Iterator[tuple[int, int, list[int]]]:
        """The non-empty independent parts (section range, buffers) of [pa, pb) cut at
        ``cuts_at``."""
        lo, hi = self.lo, self.hi
        for x, y in itertools.pairwise([pa, *cuts_at, pb]):
            part = [i for i in bufs if lo[i] >= x and hi[i] <= y]
            if part:
                yield x, y, part


class _Dfs:
    """One depth-first search at one capacity: the mutable state (offsets, lowest offset
    each unplaced buffer can take, sizes left and top per section, buffers crossing each
    section boundary) and a trail to undo placements. Plain lists of ints, not arrays: a tried
    placement reads single entries and short runs, where each numpy call cost more than its
    work (the module is compiled with mypyc, setup.py)."""

    def __init__(self, tables: CanonicalSearch, capacity: int, heuristic: str, stop: Stop,
                 node_limit: int | None = None, discrepancies: int | None = None) -> None:
        self.t = tables
        self.o = tables.options
        self.capacity = capacity
        self.heuristic = heuristic
        self.stop = stop
        self.node_limit = node_limit
        self.discrepancies = discrepancies
        n = tables.n
        self.offsets = [-1] * n
        self.min_off = [0] * n
        self.free = [True] * n
        self.total = tables.total0.copy()
        self.top = [0] * tables.sections
        self.cuts = tables.cuts0.copy()
        self.rank = [0] * n
        self.trail: list[tuple[int, list[int], list[int], list[int]]] = []
        self.nodes = 0
        self.cut = False
        self.lo, self.hi, self.size = tables.lo, tables.hi, tables.size

    def run(self) -> tuple[np.ndarray | None, bool]:
        """Offsets of a packing (or None) and whether the discrepancy budget cut a branch."""
        t = self.t
        spare = t.n * t.n if self.discrepancies is None else self.discrepancies
        everyone = list(range(t.n))
        parts = (t.split(0, t.sections, [k + 1 for k, c in enumerate(self.cuts) if c == 0],
                         everyone) if self.o.decompose else [(0, t.sections, everyone)])
        for x, y, part in parts:
            t.rank(part, self.total, self.heuristic, self.rank)
            if not self._search(x, y, part, (0, -1), spare):
                return None, self.cut
        return np.array(self.offsets, dtype=np.int64), self.cut

    def _place(self, j: int, off: int) -> list[int]:
        """Put buffer j at ``off``; returns its unplaced neighbours."""
        lj, hj, top = self.lo[j], self.hi[j], off + self.size[j]
        free, min_off, total = self.free, self.min_off, self.total
        nb = [i for i in self.t.neighbours[j] if free[i]]
        self.trail.append((j, nb, [min_off[i] for i in nb], self.top[lj:hj]))
        self.offsets[j] = off
        free[j] = False
        for i in nb:
            if min_off[i] < top:
                min_off[i] = top
        sj = self.size[j]
        for k in range(lj, hj):
            total[k] -= sj
        self.top[lj:hj] = [top] * (hj - lj)
        cuts = self.cuts
        for k in range(lj, hj - 1):
            cuts[k] -= 1
        return nb

    def _undo(self, mark: int) -> None:
        """Take back every placement made since the trail had ``mark`` entries."""
        min_off, total, cuts = self.min_off, self.total, self.cuts
        while len(self.trail) > mark:
            j, nb, old_min, old_top = self.trail.pop()
            lj, hj, sj = self.lo[j], self.hi[j], self.size[j]
            self.offsets[j] = -1
            self.free[j] = True
            for i, m in zip(nb, old_min, strict=True):
                min_off[i] = m
            for k in range(lj, hj):
                total[k] += sj
            self.top[lj:hj] = old_top
            for k in range(lj, hj - 1):
                cuts[k] += 1

    def _overloaded(self, off: int, a: int, b: int) -> bool:
        """Whether some section in [a, b) cannot hold what is left to place in it: each
        unplaced buffer goes on top of the placed ones it overlaps (and, in canonical
        order, not below ``off``)."""
        members, free, min_off, top = self.t.members, self.free, self.min_off, self.top
        base = off if self.o.canonical else 0
        for k in range(a, b):
            left = self.total[k]
            if not left:
                continue
            limit = self.capacity - left  # the highest floor that still holds what is left
            if base > limit or top[k] > limit:
                return True
            for i in members[k]:
                if free[i] and min_off[i] <= limit:
                    break  # one unplaced buffer can start low enough
            else:
                return True
        return False

    def _search(self, pa: int, pb: int, bufs: list[int], last: tuple[int, int],
                spare: int) -> bool:
        """Place the unplaced ``bufs`` of sections [pa, pb); True once all fit (their
        placements stay), False with the state as it was."""
        self.nodes += 1
        if self.node_limit is not None and self.nodes > self.node_limit:
            raise NodeLimit
        if self.nodes % 64 == 0 and self.stop():
            raise Interrupted
        o, t, size, free, min_off, rank = (self.o, self.t, self.size, self.free,
                                           self.min_off, self.rank)
        todo = [i for i in bufs if free[i]]
        if not todo:
            return True
        lowest_top = min(min_off[i] + size[i] for i in todo)
        before: list[int] = []
        after: list[int] = []
        if o.section_load and o.canonical:
            before = list(itertools.accumulate(self.total[pa:pb], max))
            after = list(itertools.accumulate(reversed(self.total[pa:pb]), max))[::-1]
        mark = len(self.trail)
        viable = 0
        capacity = self.capacity
        todo.sort(key=lambda i: (min_off[i], rank[i]))
        for j in todo:
            off = min_off[j]
            if off + size[j] > capacity:
                continue
            if o.canonical:
                if o.dominance and off >= lowest_top:
                    break  # dominated: a lower buffer could go here instead
                if (off, rank[j]) < last:
                    continue  # not canonical
            a, b = t.block[j]
            a, b = max(a, pa), min(b, pb)
            lj, hj = self.lo[j], self.hi[j]
            if o.section_load:
                outside = 0
                if o.canonical:  # everything left goes at or above off
                    outside = max(before[a - 1 - pa] if a > pa else 0,
                                  after[b - pa] if b < pb else 0)
                if off + outside > capacity or off + max(self.total[lj:hj]) > capacity:
                    continue
            nb = self._place(j, off)
            if o.section_load and self._overloaded(off, a, b):
                self._undo(mark)
                continue
            if viable > spare:
                self._undo(mark)
                self.cut = True
                return False
            left = spare - viable
            viable += 1
            if self._descend(pa, pb, bufs, j, off, left):
                return True
            self._undo(mark)
            if o.hatless and not nb:
                return False  # hatless: nothing could go above j, so no other choice helps
        return False

    def _descend(self, pa: int, pb: int, bufs: list[int], j: int, off: int,
                 spare: int) -> bool:
        """Go on after placing j at ``off``: in independent parts if j's placement left a
        cut that no unplaced buffer crosses, else in the same range."""
        lj, hj = self.lo[j], self.hi[j]
        zero: list[int] = []
        if self.o.decompose and hj - lj > 1:
            zero = [k + 1 for k in range(lj, hj - 1) if self.cuts[k] == 0]
        if not zero:
            return self._search(pa, pb, bufs, (off, self.rank[j]), spare)
        rank = self.rank.copy()
        free = self.free
        for x, y, part in self.t.split(pa, pb, zero, [i for i in bufs if free[i]]):
            self.t.rank(part, self.total, self.heuristic, self.rank)
            if not self._search(x, y, part, (0, -1), spare):
                self.rank = rank
                return False
        self.rank = rank
        return True
