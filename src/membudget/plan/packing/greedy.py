"""Greedy packers: place buffers one at a time in a given order, each into the lowest (first
fit) or the tightest (best fit) gap among the buffers already placed that overlap it in
time. A portfolio runs several orders, since ties between equal sizes decide the result."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from membudget.plan.packing.instance import Instance


def fit(inst: Instance, order: np.ndarray, best: bool = True,
        pinned: dict[int, int] | None = None) -> np.ndarray:
    """Unit offsets from placing the buffers in ``order``: each into the smallest free gap
    that holds it (``best``) or the lowest one, else on top; ``pinned`` buffers first, at
    the offsets given."""
    n = len(inst)
    by_lo = np.argsort(inst.lo, kind="stable")  # scanning a prefix finds every overlap
    slo, shi, ssize = inst.lo[by_lo], inst.hi[by_lo], inst.size[by_lo]
    where = np.empty(n, dtype=np.int64)
    where[by_lo] = np.arange(n)
    soff = np.full(n, -1, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i, o in (pinned or {}).items():
        soff[where[i]], placed[where[i]] = o, True
    lo_l, hi_l, size_l = inst.lo.tolist(), inst.hi.tolist(), inst.size.tolist()
    for i in order.tolist():
        k = int(where[i])
        if placed[k]:
            continue
        end = int(np.searchsorted(slo, hi_l[i]))
        conflict = np.flatnonzero(placed[:end] & (shi[:end] > lo_l[i]))
        soff[k] = gap_offset(soff[conflict], ssize[conflict], size_l[i], best)
        placed[k] = True
    return soff[where]


def gap_offset(offsets: np.ndarray, sizes: np.ndarray, need: int, best: bool) -> int:
    """Where a block of ``need`` bytes goes among blocks at ``offsets`` of ``sizes`` (in
    any order, possibly overlapping): the lowest gap that holds it, or with ``best`` the
    smallest such gap (the lowest of equal ones), else the top of them all."""
    if not len(offsets):
        return 0
    k = np.argsort(offsets, kind="stable")
    starts = offsets[k]
    ends = np.maximum.accumulate(starts + sizes[k])
    gap_lo = np.concatenate(([0], ends[:-1]))
    gap = starts - gap_lo
    fits = np.flatnonzero(gap >= need)
    if not len(fits):
        return int(ends[-1])
    return int(gap_lo[fits[np.argmin(gap[fits])] if best else fits[0]])


def pyramid(inst: Instance) -> dict[int, int]:
    """OLLA-style pre-placement: the longest-lived buffers whose lifetimes nest, stacked at
    increasing base addresses (a pyramid), as pins for a greedy pass over the rest."""
    pins: dict[int, int] = {}
    base = 0
    outer: tuple[int, int] | None = None
    for i in np.lexsort((-inst.size, -inst.width)).tolist():
        lo, hi = int(inst.lo[i]), int(inst.hi[i])
        if outer is None or (outer[0] <= lo and hi <= outer[1]):
            pins[i] = base
            base += int(inst.size[i])
            outer = (lo, hi)
    return pins


@dataclass(frozen=True)
class Greedy:
    """One greedy packer: a named order (the last key listed decides first), a fit rule."""

    name: str
    keys: Callable[[Instance], tuple[np.ndarray, ...]]
    best: bool
    pyramid: bool = False

    def __call__(self, inst: Instance) -> np.ndarray:
        order = np.lexsort((np.arange(len(inst)), *self.keys(inst)))
        return fit(inst, order, self.best, pyramid(inst) if self.pyramid else None)


def _size_id(i: Instance) -> tuple[np.ndarray, ...]:
    return (-i.size,)


def _size_start(i: Instance) -> tuple[np.ndarray, ...]:
    return (i.lo, -i.size)


def _size_lifetime(i: Instance) -> tuple[np.ndarray, ...]:
    return (i.lo, -i.width, -i.size)


def _lifetime(i: Instance) -> tuple[np.ndarray, ...]:
    return (i.lo, -i.size, -i.width)


def _area(i: Instance) -> tuple[np.ndarray, ...]:
    return (i.lo, -i.width, -(i.size * i.width))


def _start(i: Instance) -> tuple[np.ndarray, ...]:
    return (-i.width, -i.size, i.lo)


_ORDERS = (("size, then longest lifetime", _size_lifetime), ("size, then id", _size_id),
           ("size, then start", _size_start), ("start, then size", _start),
           ("area, then lifetime", _area), ("lifetime, then size", _lifetime))

#: The portfolio in the order it runs (the first is TFLite's greedy by size): every order
#: with best fit, then with first fit, then OLLA's pyramid pre-placement.
PORTFOLIO = (
    *(Greedy(f"greedy by {name}, {'best' if best else 'first'} fit", keys, best)
      for best in (True, False) for name, keys in _ORDERS),
    Greedy("pyramid pre-placement + greedy by size, best fit", _size_lifetime, True, True))


def portfolio(inst: Instance, deadline: float,
              packers: tuple[Greedy, ...] = PORTFOLIO) -> Iterator[tuple[Greedy, np.ndarray]]:
    """Each packer's offsets in turn: the first always, the others while time remains."""
    for k, packer in enumerate(packers):
        if k and time.perf_counter() > deadline:
            return
        yield packer, packer(inst)
