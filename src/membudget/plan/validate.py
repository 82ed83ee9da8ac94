"""Independent checks of plans: they trust no solver and re-derive every conflict.

``validate`` checks a packing; ``validate_plan`` a whole plan (order, lifetimes, packing).

A sweep over time keeps the live buffers sorted by offset; a new buffer can only collide
with its neighbours in that order, so the check is O(n log n), not O(n²).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral

from sortedcontainers import SortedList

from membudget.plan.check_order import check_order
from membudget.plan.graph import LEAF, Graph
from membudget.plan.problem import Buffer, PlanError, Problem


class PackingError(PlanError):
    """A packing that is not valid; the message names the offending buffers."""


def validate(problem: Problem, offsets: Mapping[str, int] | None = None,
             capacity: int | None = None) -> int:
    """Check a packing and return its height (max offset + size; 0 for no buffers).

    ``offsets`` maps buffer ids to offsets (default: the buffers' own ``offset`` fields).
    Raises PackingError naming the buffers at fault.
    """
    if offsets is None:
        offsets = problem.offsets()
    ids = {b.id for b in problem.buffers}
    unknown = sorted(set(offsets) - ids)
    if unknown:
        raise PackingError(f"offsets given for {len(unknown)} unknown buffer(s), e.g. "
                           f"{unknown[0]!r}")
    height = 0
    for b in problem.buffers:
        height = max(height, checked_offset(b.id, b.size, offsets, capacity) + b.size)
    _check_no_overlap(problem.buffers, offsets)
    return height


def checked_offset(bid: str, size: int, offsets: Mapping[str, int],
                   capacity: int | None) -> int:
    """The offset of buffer ``bid`` of ``size`` bytes, once it is known to be given, a
    non-negative integer and (with a ``capacity``) within it; else PackingError."""
    if bid not in offsets:
        raise PackingError(f"buffer {bid!r} has no offset")
    off = offsets[bid]
    if not isinstance(off, Integral) or isinstance(off, bool):
        raise PackingError(f"buffer {bid!r} has a non-integer offset {off!r}")
    if off < 0:
        raise PackingError(f"buffer {bid!r} has negative offset {off}")
    if capacity is not None and off + size > capacity:
        raise PackingError(f"buffer {bid!r} at [{off}, {off + size}) exceeds the "
                           f"capacity {capacity}")
    return int(off)


def _check_no_overlap(buffers: tuple[Buffer, ...], offsets: Mapping[str, int]) -> None:
    """Sweep time (frees before allocations at equal times: lifetimes are half-open) and
    check each newly live buffer against its address neighbours among the live ones."""
    events = sorted((t, kind, i) for i, b in enumerate(buffers) if b.size > 0
                    for t, kind in ((b.lower, 1), (b.upper, 0)))
    live: SortedList = SortedList()  # (offset, index), pairwise disjoint in address
    for t, kind, i in events:
        b = buffers[i]
        key = (offsets[b.id], i)
        if kind == 0:
            live.remove(key)
            continue
        pos = live.bisect_left(key)
        if pos > 0:
            _, j = live[pos - 1]
            _raise_if_overlap(buffers[j], b, offsets, t)
        if pos < len(live):
            _, j = live[pos]
            _raise_if_overlap(b, buffers[j], offsets, t)
        live.add(key)


def _raise_if_overlap(low: Buffer, high: Buffer, offsets: Mapping[str, int], t: int) -> None:
    """Raise if ``low`` (the lower offset of two buffers live at time ``t``) reaches into
    ``high``."""
    lo, hi = offsets[low.id], offsets[high.id]
    if lo + low.size > hi:
        raise PackingError(
            f"buffers {low.id!r} (time [{low.lower}, {low.upper}), address [{lo}, "
            f"{lo + low.size})) and {high.id!r} (time [{high.lower}, {high.upper}), address "
            f"[{hi}, {hi + high.size})) are both live at time {t} and overlap in address")


def validate_plan(graph: Graph, order: Sequence[int], peak: int, problem: Problem,
                  offsets: Mapping[str, int], arena: int) -> None:
    """Check a whole plan: the order is a topological permutation with the claimed peak
    (:func:`membudget.plan.check_order.check_order`), every tensor of size > 0 has a buffer
    live from its producer's step to its last consumer's under that order, and the packing
    puts them all within ``arena`` bytes without overlap."""
    check_order(graph, order, peak)
    pos = {v: i for i, v in enumerate(order)}
    n = len(order)
    by_id = {b.id: b for b in problem.buffers}
    for k, t in enumerate(graph.tensors):
        if t.size <= 0:
            continue
        b = by_id.get(f"{k}:{t.name}")
        if b is None or b.size != t.size:
            raise PackingError(f"tensor {t.name!r} ({t.size} B) has no buffer of its size")
        first = 0 if t.src == LEAF else pos[t.src]
        last = n - 1 if t.src == LEAF or t.to_end else max(
            (pos[s] for s in t.sinks), default=first)
        if b.lower > first or b.upper <= last:
            raise PackingError(f"tensor {t.name!r} is live over steps [{first}, {last}] but "
                               f"its buffer only over [{b.lower}, {b.upper})")
    if validate(problem, offsets, capacity=arena) > arena:
        raise PackingError(f"the packing does not fit the arena of {arena} B")
