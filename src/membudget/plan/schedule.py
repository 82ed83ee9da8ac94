"""Memory-aware list scheduling, and the contraction of nodes that allocate nothing.

The greedy orders are the ILP's warm start and the answer when there is no time to solve.
Contraction is exact: a node that makes no bytes (a view, an in-place write, an optimizer
update) never raises the peak when run right after its last predecessor, so the solvers
only order the other nodes and each contracted node is put back there (OLLA pins weight
updates early with anchor edges; this is the same idea for every such node).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from membudget.plan.graph import LEAF, Graph, Tensor

GREEDY_RULES = ("delta", "smallest-step", "recorded")
START = -1  # the anchor of a contracted node without predecessors: it runs first


def greedy_order(g: Graph, rule: str = "delta") -> list[int]:
    """A topological order built by always running the ready node that is best by ``rule``:
    ``delta`` (bytes made minus bytes freed, then recorded position), ``smallest-step``
    (bytes made, then delta) or ``recorded`` (node ids ascending, when that is topological)."""
    if rule == "recorded":
        if all(u < v for v in range(g.n) for u in g.preds[v]):
            return list(range(g.n))
        rule = "delta"
    if rule not in GREEDY_RULES:
        raise ValueError(f"unknown greedy rule {rule!r}; known: {', '.join(GREEDY_RULES)}")
    tensors = g.tensors
    sized = [t.src != LEAF and t.size > 0 and not t.to_end for t in tensors]
    remaining = [len(set(t.sinks)) for t in tensors]
    freed = [0] * g.n  # bytes running the node now would free
    for k, t in enumerate(tensors):
        if sized[k] and remaining[k] == 0:
            freed[t.src] += t.size  # made and never read: dead right after its step
        elif sized[k] and remaining[k] == 1:
            freed[t.sinks[0]] += t.size
    made = g.out_bytes

    def key(v: int) -> tuple[int, int, int]:
        delta = made[v] - freed[v]
        return (delta, 0, v) if rule == "delta" else (made[v], delta, v)

    indeg = [len(p) for p in g.preds]
    done = [False] * g.n
    heap = [(key(v), v) for v in range(g.n) if indeg[v] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        k, v = heapq.heappop(heap)
        if done[v] or k != key(v):
            continue  # a stale entry: the node's key changed after it was pushed
        done[v] = True
        order.append(v)
        touched: list[int] = []
        for e in g.inputs[v]:
            if not sized[e]:
                continue
            remaining[e] -= 1
            if remaining[e] == 1:
                u = next(s for s in tensors[e].sinks if not done[s])
                freed[u] += tensors[e].size
                touched.append(u)
        for u in touched:
            if indeg[u] == 0:
                heapq.heappush(heap, (key(u), u))
        for w in g.succs[v]:
            indeg[w] -= 1
            if indeg[w] == 0:
                heapq.heappush(heap, (key(w), w))
    return order


def best_greedy(g: Graph, rules: Sequence[str] = GREEDY_RULES) -> tuple[list[int], int, str]:
    """The lowest-peak order among the greedy rules: (order, peak, rule)."""
    best: tuple[list[int], int, str] | None = None
    for rule in rules:
        order = greedy_order(g, rule)
        peak = g.peak(order)
        if best is None or peak < best[1]:
            best = (order, peak, rule)
    assert best is not None
    return best


@dataclass
class Contraction:
    """``graph`` without the nodes that allocate nothing; ``kept[i]`` is the original id of
    its node i. ``expand`` puts each contracted node back right after its last predecessor."""

    original: Graph
    graph: Graph
    kept: list[int]

    def expand(self, order: Sequence[int]) -> list[int]:
        """The original-graph order of a contracted-graph order; same peak."""
        g = self.original
        key: dict[int, tuple[int, int]] = {self.kept[i]: (pos, 0) for pos, i in enumerate(order)}
        seq = 0
        for v in g.topo:
            if v not in key:
                seq += 1
                key[v] = (max((key[p][0] for p in g.preds[v]), default=-1), seq)
        return sorted(range(g.n), key=key.__getitem__)

    def lift(self, order: Sequence[int]) -> list[int]:
        """The contracted-graph order that keeps the relative order of the kept nodes."""
        index = {v: i for i, v in enumerate(self.kept)}
        return [index[v] for v in order if v in index]


def contract(g: Graph) -> Contraction:
    """Remove every node that makes no bytes and whose predecessors have one last member m
    (all others are ancestors of m), or none: it runs right after m (first), so its reads
    move to m and its successors follow m. Other zero-byte nodes stay (m depends on order)."""
    tpos = [0] * g.n
    for i, v in enumerate(g.topo):
        tpos[v] = i
    drop = [False] * g.n
    anchor: dict[int, int] = {}  # contracted node -> the kept node it runs right after
    for v in g.topo:
        if g.out_bytes[v]:
            continue
        cands = {anchor.get(p, p) for p in g.preds[v]} - {START}
        m = max(cands, key=tpos.__getitem__, default=START)
        if all(_precedes(g, r, m, tpos) for r in cands - {m}):
            drop[v], anchor[v] = True, m
    kept = [v for v in range(g.n) if not drop[v]]
    index = {v: i for i, v in enumerate(kept)}

    def mapped(sinks: Sequence[int]) -> set[int]:
        return {anchor.get(s, s) for s in sinks} - {START}

    tensors: list[Tensor] = []
    for t in g.tensors:
        if t.src == LEAF:
            tensors.append(Tensor(t.name, t.size, LEAF, tuple(sorted(index[s] for s in
                                                                     mapped(t.sinks)))))
        elif not drop[t.src]:
            sinks = mapped(t.sinks) - {t.src}
            tensors.append(Tensor(t.name, t.size, index[t.src],
                                  tuple(sorted(index[s] for s in sinks)), t.to_end))
        elif anchor[t.src] != START and (sinks := mapped(t.sinks) - {anchor[t.src]}):
            # size 0: an ordering edge
            tensors.append(Tensor(t.name, 0, index[anchor[t.src]],
                                  tuple(sorted(index[s] for s in sinks))))
    cg = Graph([g.ops[v] for v in kept], tensors, name=g.name,
               labels=[g.labels[v] for v in kept])
    return Contraction(g, cg, kept)


def _precedes(g: Graph, a: int, b: int, tpos: list[int], limit: int = 4096) -> bool:
    """Whether ``a`` is an ancestor of ``b`` (a backward search from b that skips nodes
    before a in the topological order; gives up, answering False, after ``limit`` nodes)."""
    stack, seen = [b], {b}
    while stack and len(seen) <= limit:
        for p in g.preds[stack.pop()]:
            if p == a:
                return True
            if p not in seen and tpos[p] > tpos[a]:
                seen.add(p)
                stack.append(p)
    return False
