"""A packing problem preprocessed for the solvers: integer units, compressed times, and the
buffers that need no search (zero sizes, buffers live throughout) set aside."""

from __future__ import annotations

import math

import numpy as np

from membudget.plan.problem import Problem


class Instance:
    """The buffers left to place, as arrays: sizes divided by their gcd, times compressed to
    event indices. Zero-size buffers sit at offset 0, and buffers live throughout (which
    overlap all others, so stacking them at the bottom loses nothing) are pre-placed below a
    ``floor``; offsets of the rest are in units above it."""

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
        events = np.unique(np.array([t for b in bufs for t in (b.lower, b.upper)],
                                    dtype=np.int64))
        self.lo = np.searchsorted(events, [b.lower for b in bufs]).astype(np.int64)
        self.hi = np.searchsorted(events, [b.upper for b in bufs]).astype(np.int64)
        self.size = np.array([b.size // self.gcd for b in bufs], dtype=np.int64)
        #: Lifetimes in the problem's own time units (compression would distort them).
        self.width = np.array([b.upper - b.lower for b in bufs], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def part(self, idx: np.ndarray) -> Instance:
        """The buffers ``idx`` alone, as an instance with the same units and floor."""
        sub = object.__new__(Instance)
        sub.gcd, sub.base, sub.floor = self.gcd, {}, self.floor
        sub.ids = [self.ids[i] for i in idx.tolist()]
        sub.lo, sub.hi, sub.size = self.lo[idx], self.hi[idx], self.size[idx]
        sub.width = self.width[idx]
        return sub

    def max_load(self) -> int:
        """Max load of the buffers left to place, in units: no packing is lower."""
        return load_profile(self.lo, self.hi, self.size).max(initial=0).item()

    def height(self, off: np.ndarray) -> int:
        """Height in units above the floor of the unit offsets ``off``."""
        return int((off + self.size).max()) if len(self) else 0

    def bytes(self, units: int) -> int:
        """Arena bytes of a height of ``units`` above the floor."""
        return (units + self.floor) * self.gcd

    def offsets(self, units: np.ndarray) -> dict[str, int]:
        """Byte offsets of all buffers from unit offsets of the ones left to place."""
        out = dict(self.base)
        out.update((bid, (int(u) + self.floor) * self.gcd)
                   for bid, u in zip(self.ids, units, strict=True))
        return out


def load_profile(lo: np.ndarray, hi: np.ndarray, size: np.ndarray) -> np.ndarray:
    """The total size live in each compressed time step (half-open lifetimes)."""
    if not len(lo):
        return np.zeros(0, dtype=np.int64)
    delta = np.zeros(int(hi.max()) + 1, dtype=np.int64)
    np.add.at(delta, lo, size)
    np.add.at(delta, hi, -size)
    return np.cumsum(delta)[:-1]
