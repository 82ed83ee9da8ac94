"""Ops on parallel streams (compute, communication, copy) and which tensors may share memory
on every interleaving of them (MindSpore's safe static allocation, MLSys'23).

A :class:`StreamProgram` puts each op of a :class:`~membudget.plan.graph.Graph` on a stream.
Ops of one stream run in their id order (the recorded order); an op is ordered after an op of
another stream only by a dependency: a tensor between them (data, or a size-0 ordering
tensor) or an explicit wait. A tensor's lifetime is then an interval per stream only: two
tensors may share memory iff every use of one (its producing write included) happens before
the other's first write, whatever the interleaving. :func:`conflict_graph` derives that
relation from the reachability bit rows of those dependencies, not from one serial order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from membudget.plan.graph import LEAF, Graph, Tensor
from membudget.plan.problem import PlanError


class StreamError(PlanError):
    """A stream program that is not well formed: a bad stream id, a wait naming an op that
    does not exist, or dependencies that form a cycle; the message names the culprit."""


def buffer_id(k: int, t: Tensor) -> str:
    """The buffer id of tensor ``k`` of a graph: the one
    :func:`membudget.plan.planner.location_problem` gives it, so plans of both compare."""
    return f"{k}:{t.name}"


class StreamProgram:
    """The ops of ``graph`` on streams: op ``v`` runs on stream ``streams[v]``; a wait
    ``(u, v)`` keeps op ``v`` from starting before op ``u`` has finished (an event recorded
    after ``u`` and waited on before ``v``). ``names`` names the streams, e.g. ``{0:
    "compute", 1: "comm"}``; when given, every stream used must be among them."""

    def __init__(self, graph: Graph, streams: Sequence[int],
                 waits: Iterable[tuple[int, int]] = (),
                 names: Mapping[int, str] | None = None) -> None:
        self.graph = graph
        self.streams = tuple(streams)
        self.waits = tuple((u, v) for u, v in waits)
        self.names = dict(names) if names is not None else None
        n = graph.n
        if len(self.streams) != n:
            raise StreamError(f"{len(self.streams)} stream ids for the {n} ops of "
                              f"{graph.name!r}: give one per op")
        for v, s in enumerate(self.streams):
            if not isinstance(s, int) or isinstance(s, bool) or s < 0:
                raise StreamError(f"op {graph.labels[v]} has stream id {s!r}: expected an "
                                  f"integer >= 0")
            if self.names is not None and s not in self.names:
                known = ", ".join(f"{i} ({name})" for i, name in sorted(self.names.items()))
                raise StreamError(f"op {graph.labels[v]} is on stream {s}, which is not one "
                                  f"of the named streams {known}")
        for u, v in self.waits:
            for w in (u, v):
                if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w < n:
                    raise StreamError(f"wait ({u!r}, {v!r}) names op {w!r}, but the ops of "
                                      f"{graph.name!r} are 0..{n - 1}")
            if u == v:
                raise StreamError(f"op {self.describe(u)} waits for itself")
        self._check_acyclic()

    def stream_name(self, s: int) -> str:
        """Stream ``s`` as messages name it."""
        return f"stream {self.names[s]!r}" if self.names is not None else f"stream {s}"

    def describe(self, v: int) -> str:
        """Op ``v`` as messages name it: its label and its stream."""
        return f"{self.graph.labels[v]} ({self.stream_name(self.streams[v])})"

    def stream_edges(self) -> list[tuple[int, int]]:
        """(u, v) for each op ``v`` and the op ``u`` before it on its stream."""
        last: dict[int, int] = {}
        edges = []
        for v, s in enumerate(self.streams):
            if s in last:
                edges.append((last[s], v))
            last[s] = v
        return edges

    def _check_acyclic(self) -> None:
        """Raise StreamError naming a cycle of the dependencies (stream order, tensors and
        waits together), if there is one: then no execution runs them all."""
        why: dict[tuple[int, int], str] = {}
        for u, v in self.stream_edges():
            why[(u, v)] = f"the order of {self.stream_name(self.streams[v])}"
        for u, v in self.waits:
            why.setdefault((u, v), "a wait")
        for t in self.graph.tensors:
            if t.src != LEAF:
                for s in t.sinks:
                    why.setdefault((t.src, s), f"tensor {t.name!r}")
        preds: list[list[int]] = [[] for _ in range(self.graph.n)]
        succs: list[list[int]] = [[] for _ in range(self.graph.n)]
        for u, v in why:
            preds[v].append(u)
            succs[u].append(v)
        indeg = [len(p) for p in preds]
        ready = [v for v in range(self.graph.n) if indeg[v] == 0]
        done = 0
        while ready:
            u = ready.pop()
            done += 1
            for v in succs[u]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        if done == self.graph.n:
            return
        stuck = {v for v in range(self.graph.n) if indeg[v] > 0}
        path = [next(iter(stuck))]  # walk backwards: every stuck op has a stuck predecessor
        seen = {path[0]: 0}
        while True:
            u = next(p for p in preds[path[-1]] if p in stuck)
            if u in seen:
                cycle = path[seen[u]:][::-1]  # each op a predecessor of the next
                break
            seen[u] = len(path)
            path.append(u)
        steps = [f"{self.describe(a)} -> {self.describe(b)} by {why[(a, b)]}"
                 for a, b in zip(cycle, [*cycle[1:], cycle[0]], strict=True)]
        raise StreamError("the dependencies form a cycle, so no execution runs every op: "
                          + "; ".join(steps))


def happens_before_graph(program: StreamProgram) -> Graph:
    """The program's graph with a size-0 ordering tensor for every stream-order edge and
    wait: its reachability is happens-before (op u is before op v on every execution iff v
    is a descendant of u), and its ``must_live_bound`` bounds every safe plan."""
    g = program.graph
    extra = [Tensor(f"order@{g.labels[u]}", 0, u, (v,))
             for u, v in (*program.stream_edges(), *program.waits)]
    return Graph(g.ops, [*g.tensors, *extra], name=g.name, labels=g.labels)


@dataclass(frozen=True)
class Conflicts:
    """The tensors of size > 0 of a program (``ids``: their buffer ids, in the graph's
    order) and ``matrix[i, j]``: tensors i and j may be live at once on some
    interleaving, so must not overlap in address (symmetric, False on the diagonal).
    ``first`` is each tensor's producing op (LEAF for a leaf); ``lower_bound`` the most
    bytes that are pairwise in conflict, so that no safe plan is lower: those live at one op
    on every execution, or at one step of an execution (:func:`lower_bound`)."""

    ids: tuple[str, ...]
    sizes: np.ndarray
    first: np.ndarray
    matrix: np.ndarray
    lower_bound: int


def conflict_graph(program: StreamProgram) -> Conflicts:
    """Which tensors may share memory: i before j iff the producer of j follows every use of
    i in happens-before (bit rows of descendants, ANDed over i's uses); i and j conflict iff
    neither is before the other. Leaves and tensors held to the end precede nothing.
    Takes O(T²) bytes for T tensors of size > 0 (a few thousand: tens of MiB)."""
    hb = happens_before_graph(program)
    reach = hb.reachability()
    rows = [k for k, t in enumerate(program.graph.tensors) if t.size > 0]
    tensors = [program.graph.tensors[k] for k in rows]
    after = np.zeros((len(rows), reach.desc.shape[1]), dtype=np.uint8)  # follows every use
    for i, t in enumerate(tensors):
        if t.src == LEAF or t.to_end:
            continue
        row = reach.desc[t.src].copy()
        for s in t.sinks:
            row &= reach.desc[s]
        after[i] = row
    first = np.array([t.src for t in tensors], dtype=np.int64)
    made = np.flatnonzero(first != LEAF)
    src = first[made]
    before = np.zeros((len(rows), len(rows)), dtype=bool)  # before[i, j]: i dies before j
    before[:, made] = (after[:, src >> 3] & (0x80 >> (src & 7)).astype(np.uint8)) != 0
    matrix = ~(before | before.T)
    np.fill_diagonal(matrix, False)
    return Conflicts(tuple(buffer_id(k, t) for k, t in zip(rows, tensors, strict=True)),
                     np.array([t.size for t in tensors], dtype=np.int64), first, matrix,
                     lower_bound(program, hb))


def lower_bound(program: StreamProgram, hb: Graph | None = None) -> int:
    """Bytes no safe plan goes below: the tensors live at one op on every execution (the
    graph's must-live bound over happens-before) and those live at one step of any one
    execution (the peak of the op order, if it is one, and of a topological order) are
    pairwise in conflict, so they never share an address."""
    hb = happens_before_graph(program) if hb is None else hb
    orders = [hb.topo]
    if all(u < v for v in range(hb.n) for u in hb.preds[v]):
        orders.append(list(range(hb.n)))
    return max(hb.must_live_bound(), *(hb.peak(order) for order in orders))
