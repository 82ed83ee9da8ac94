"""An independent check of an operator order: it trusts no solver or scheduler.

It re-derives everything from the graph's tensors alone (not from the graph's adjacency or
memory helpers): the order is a permutation of the nodes, every tensor's source (control
edges included) runs before each of its sinks, and the peak recomputed by a sweep over the
steps (a tensor is live from its source's step to its last sink's step, to the last step if
held to the end; leaves at every step) equals the claimed one.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from membudget.plan.graph import LEAF, Graph, GraphError


class OrderError(GraphError):
    """An order that is not a topological permutation, or whose claimed peak is wrong."""


def order_peak(graph: Graph, order: Sequence[int]) -> int:
    """Check that ``order`` is a topological permutation of the nodes; return its peak."""
    n = len(graph.ops)
    pos: dict[int, int] = {}
    for i, v in enumerate(order):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not 0 <= v < n:
            raise OrderError(f"order position {i} holds {v!r}, not a node id in 0..{n - 1}")
        v = int(v)
        if v in pos:
            raise OrderError(f"node {graph.labels[v]} appears twice (positions {pos[v]} "
                             f"and {i})")
        pos[v] = i
    if len(pos) != n:
        missing = next(v for v in range(n) if v not in pos)
        raise OrderError(f"the order misses {n - len(pos)} node(s), e.g. {graph.labels[missing]}")
    delta = [0] * (n + 1)
    always = 0
    for t in graph.tensors:
        if t.src == LEAF:
            always += t.size
            continue
        start = pos[t.src]
        for s in t.sinks:
            if pos[s] <= start:
                raise OrderError(f"node {graph.labels[s]} (position {pos[s]}) runs before "
                                 f"node {graph.labels[t.src]} (position {start}), which makes "
                                 f"{t.name!r} it reads")
        end = n - 1 if t.to_end else max((pos[s] for s in t.sinks), default=start)
        delta[start] += t.size
        delta[end + 1] -= t.size
    peak = live = 0
    for i in range(n):
        live += delta[i]
        peak = max(peak, live)
    return always + peak


def check_order(graph: Graph, order: Sequence[int], claimed_peak: int) -> None:
    """Raise OrderError unless ``order`` is a valid order of ``graph`` with peak
    ``claimed_peak`` bytes."""
    peak = order_peak(graph, order)
    if peak != claimed_peak:
        raise OrderError(f"claimed peak {claimed_peak:,} B, but the order's peak is {peak:,} B")
