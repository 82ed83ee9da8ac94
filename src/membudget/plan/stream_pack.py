"""Offsets against a conflict graph: a plan for ops on parallel streams, safe on every
interleaving.

Lifetimes on several streams are not intervals, so the interval packers of
:mod:`membudget.plan.pack` do not apply; a greedy portfolio does: each order places every
tensor at the lowest gap (first fit) or the tightest one (best fit) among the tensors it
conflicts with that are already placed, and the lowest packing is kept. The plan is checked
by the independent multi-stream validator before it is returned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from membudget.plan.packing.greedy import gap_offset
from membudget.plan.stream_validate import validate_streams
from membudget.plan.streams import Conflicts, StreamProgram, conflict_graph


@dataclass(frozen=True)
class StreamPlan:
    """A validated plan of a stream program: an offset per buffer id, the arena height, the
    clique lower bound no safe plan goes below, the greedy that won, the seconds taken and
    each greedy tried with its height."""

    offsets: dict[str, int]
    height: int
    lower_bound: int
    method: str
    seconds: float
    tried: tuple[tuple[str, int], ...]


def _orders(c: Conflicts) -> dict[str, np.ndarray]:
    """The portfolio's orders of the tensors (indices into ``c``), each tie broken by index."""
    idx = np.arange(len(c.sizes))
    near = np.array([int(c.sizes[row].sum()) for row in c.matrix], dtype=np.int64)
    degree = c.matrix.sum(axis=1, dtype=np.int64)
    return {
        "size": np.lexsort((idx, -c.sizes)),
        "size, then conflicting bytes": np.lexsort((idx, -near, -c.sizes)),
        "conflicting bytes": np.lexsort((idx, -(near + c.sizes))),
        "size × conflicts": np.lexsort((idx, -(c.sizes * degree))),
        "first write, then size": np.lexsort((idx, -c.sizes, c.first)),
    }


def place(c: Conflicts, order: np.ndarray, best: bool) -> np.ndarray:
    """Offsets of the tensors of ``c`` placed one by one in ``order``, each in the lowest
    (or, ``best``, the tightest) gap between the placed tensors it conflicts with."""
    offsets = np.zeros(len(c.sizes), dtype=np.int64)
    placed = np.zeros(len(c.sizes), dtype=bool)
    for i in order:
        near = np.flatnonzero(c.matrix[i] & placed)
        offsets[i] = gap_offset(offsets[near], c.sizes[near], int(c.sizes[i]), best)
        placed[i] = True
    return offsets


def plan_streams(program: StreamProgram, conflicts: Conflicts | None = None) -> StreamPlan:
    """Give every tensor of size > 0 of ``program`` an offset such that no two that may be
    live at once on any interleaving overlap: the lowest of the greedy portfolio (stopping
    at the lower bound), checked by :func:`~membudget.plan.stream_validate.validate_streams`.
    ``conflicts``: ``conflict_graph(program)`` if the caller has it already."""
    t0 = time.perf_counter()
    c = conflict_graph(program) if conflicts is None else conflicts
    results: list[tuple[int, int, str, np.ndarray]] = []  # height, rank, method, offsets
    for name, order in _orders(c).items():
        for fit_name, best in (("best fit", True), ("first fit", False)):
            offsets = place(c, order, best)
            height = int((offsets + c.sizes).max()) if len(c.sizes) else 0
            results.append((height, len(results), f"greedy by {name}, {fit_name}", offsets))
        if min(results)[0] <= c.lower_bound:
            break
    height, _, method, offsets = min(results)
    plan = {bid: int(o) for bid, o in zip(c.ids, offsets, strict=True)}
    validate_streams(program, plan, capacity=height)
    return StreamPlan(plan, height, c.lower_bound, method, time.perf_counter() - t0,
                      tuple((m, h) for h, _, m, _ in results))
