"""The dataflow graph of one training step, built from a trace, for operator-order planning.

Nodes are operators; a tensor is an edge with one source node and many sink nodes, at the
level of storages: views and in-place writes are folded into the storage they share, so a
write extends its storage's lifetime and adds ordering edges (size 0) instead of new memory.
Leaves (``put``) have no source and are live for the whole step. A tensor is live from its
source's step to its last sink's step (to the end of the step if the program still holds it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce

import numpy as np

from membudget.errors import MembudgetError
from membudget.trace.format import CALL, COPY, COPY_FROM, GET, PIN, PUT, RELEASE, Trace

LEAF = -1  # the source of a leaf: live from before the first node to after the last


class GraphError(MembudgetError, ValueError):
    """A graph that is not a DAG or names nodes that do not exist; names a culprit."""


@dataclass(frozen=True)
class Tensor:
    """A storage of ``size`` bytes made by node ``src`` (LEAF: always live) and read or
    written by ``sinks``; ``to_end``: still held at the end of the step. Size 0 = ordering."""

    name: str
    size: int
    src: int
    sinks: tuple[int, ...] = ()
    to_end: bool = False


class Graph:
    """Operators ``ops[i]`` (node ids 0..n-1) and tensors between them; must be acyclic.
    From a trace, ids follow the recorded order (``range(n)`` is the order the program ran)
    and ``labels[i]`` names node i in messages by its op and trace line."""

    def __init__(self, ops: Sequence[str], tensors: Sequence[Tensor], name: str = "graph",
                 labels: Sequence[str] | None = None) -> None:
        self.name = name
        self.ops = list(ops)
        self.labels = list(labels) if labels is not None else [f"{op}#{i}"
                                                               for i, op in enumerate(ops)]
        self.tensors = list(tensors)
        n = len(self.ops)
        self.inputs: list[list[int]] = [[] for _ in range(n)]  # tensor ids each node reads
        self.outputs: list[list[int]] = [[] for _ in range(n)]  # tensor ids each node makes
        succ: list[set[int]] = [set() for _ in range(n)]
        for k, t in enumerate(self.tensors):
            if t.size < 0:
                raise GraphError(f"tensor {t.name!r} has negative size {t.size}")
            if not (t.src == LEAF or 0 <= t.src < n) or any(not 0 <= s < n for s in t.sinks):
                raise GraphError(f"tensor {t.name!r} names a node outside 0..{n - 1}")
            if t.src == LEAF:
                continue
            self.outputs[t.src].append(k)
            for s in set(t.sinks):
                self.inputs[s].append(k)
                if s == t.src:
                    raise GraphError(f"cycle: node {self.labels[s]} reads its own output "
                                     f"{t.name!r}")
                succ[t.src].add(s)
        self.succs: list[list[int]] = [sorted(s) for s in succ]
        self.preds: list[list[int]] = [[] for _ in range(n)]
        for u in range(n):
            for v in self.succs[u]:
                self.preds[v].append(u)
        self.topo = self._topological_order()
        self.leaf_bytes = sum(t.size for t in self.tensors if t.src == LEAF)
        self.out_bytes = [sum(self.tensors[k].size for k in ks) for ks in self.outputs]
        self._reach: Reach | None = None

    @property
    def n(self) -> int:
        return len(self.ops)

    def _topological_order(self) -> list[int]:
        """Kahn's algorithm (smallest ready id first); a cycle raises naming one of its nodes."""
        indeg = [len(p) for p in self.preds]
        ready = [v for v in range(self.n) if indeg[v] == 0]
        order: list[int] = []
        while ready:
            v = ready.pop()
            order.append(v)
            for w in self.succs[v]:
                indeg[w] -= 1
                if indeg[w] == 0:
                    ready.append(w)
        if len(order) < self.n:
            v = self._node_on_cycle(indeg)
            raise GraphError(f"the graph has a cycle through node {self.labels[v]}")
        return order

    def _node_on_cycle(self, indeg: list[int]) -> int:
        """A node on a cycle among the nodes Kahn's algorithm could not order."""
        stuck = {v for v in range(self.n) if indeg[v] > 0}
        v = next(iter(stuck))
        seen: dict[int, int] = {}
        while v not in seen:  # walk backwards: every stuck node has a stuck predecessor
            seen[v] = len(seen)
            v = next(p for p in self.preds[v] if p in stuck)
        return v

    # ------------------------------------------------------------------ memory of an order
    def lifetimes(self, order: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first step, last step, size) of every non-leaf tensor of size > 0 under ``order``."""
        pos = np.empty(self.n, dtype=np.int64)
        pos[np.asarray(order, dtype=np.int64)] = np.arange(self.n)
        rows = [(k, t) for k, t in enumerate(self.tensors) if t.src != LEAF and t.size > 0]
        start = np.array([pos[t.src] for _, t in rows], dtype=np.int64)
        end = np.array([self.n - 1 if t.to_end else max((pos[s] for s in t.sinks),
                                                        default=pos[t.src]) for _, t in rows],
                       dtype=np.int64)
        size = np.array([t.size for _, t in rows], dtype=np.int64)
        return start, end, size

    def profile(self, order: Sequence[int]) -> np.ndarray:
        """Bytes live at each step of ``order`` (leaves included); assumes a valid order."""
        start, end, size = self.lifetimes(order)
        diff = np.zeros(self.n + 1, dtype=np.int64)
        np.add.at(diff, start, size)
        np.add.at(diff, end + 1, -size)
        return np.cumsum(diff[:-1]) + self.leaf_bytes

    def peak(self, order: Sequence[int]) -> int:
        """Peak bytes of a valid order: tensors live from their source to their last sink."""
        return int(self.profile(order).max()) if self.n else self.leaf_bytes

    def recorded_peak(self) -> int:
        """Peak of the recorded order (node ids ascending), as the program ran it."""
        if any(u > v for v in range(self.n) for u in self.preds[v]):
            raise GraphError("node ids are not a topological order: no recorded order")
        return self.peak(range(self.n))

    # ------------------------------------------------------------------ lower bounds
    def working_set(self, v: int) -> int:
        """Bytes node ``v`` touches (its distinct inputs and outputs), leaves excluded."""
        return sum(self.tensors[k].size for k in set(self.inputs[v]) | set(self.outputs[v]))

    def lower_bound(self) -> int:
        """Largest single-op working set plus the leaves (OLLA's minimum memory); also the
        last step holds every ``to_end`` tensor and the working set of some node without
        successors."""
        if not self.n:
            return self.leaf_bytes
        ends = {k for k, t in enumerate(self.tensors) if t.to_end and t.src != LEAF}
        last = min(sum(self.tensors[k].size for k in ends | set(self.inputs[v])
                       | set(self.outputs[v])) for v in range(self.n) if not self.succs[v])
        return self.leaf_bytes + max(last, max(self.working_set(v) for v in range(self.n)))

    def reachability(self) -> Reach:
        """Ancestor and descendant sets of every node (bit matrices; computed once)."""
        if self._reach is None:
            self._reach = Reach(self)
        return self._reach

    def must_live_bound(self, reach: Reach | None = None) -> int:
        """Lower bound on every order's peak: at node v's step, each tensor whose source
        precedes-or-is v and one of whose sinks follows-or-is v (or is held to the end) is
        live, whatever the order. Dominates ``working_set``; O(n²/8) bytes of memory."""
        if not self.n:
            return self.leaf_bytes
        r = reach or self.reachability()
        acc = np.zeros(self.n, dtype=np.int64)
        for t in self.tensors:
            if t.src == LEAF or t.size == 0:
                continue
            after = r.desc_or_self(t.src)
            if not t.to_end:
                after = after & reduce(np.bitwise_or, (r.anc_or_self(s) for s in t.sinks),
                                       r.only(t.src))
            acc += t.size * np.unpackbits(after, count=self.n).astype(np.int64)
        return self.leaf_bytes + int(acc.max())


def layered(seed: int, layers: int = 6, width: int = 6) -> Graph:
    """A random layered DAG (each tensor feeds 1-3 nodes of the next two layers): small
    graphs whose greedy order is not provably optimal, for tests and benchmarks."""
    rng = random.Random(seed)
    n = layers * width
    tensors = []
    for v in range(n):
        layer = v // width
        sinks: tuple[int, ...] = ()
        if layer < layers - 1:
            sinks = tuple(sorted(rng.sample(range((layer + 1) * width,
                                                  min(n, (layer + 3) * width)),
                                            rng.randint(1, 3))))
        tensors.append(Tensor(f"t{v}", rng.randint(1, 20) * 256, v, sinks,
                              layer == layers - 1))
    return Graph([f"op{v}" for v in range(n)], tensors, name=f"layered {layers}x{width} #{seed}")


class Reach:
    """Transitive closure of a graph as packed bit rows: ``anc[v]``, ``desc[v]`` exclude v."""

    def __init__(self, g: Graph) -> None:
        n, width = g.n, max(1, math.ceil(g.n / 8))
        self.n = n
        self.anc = np.zeros((n, width), dtype=np.uint8)
        self.desc = np.zeros((n, width), dtype=np.uint8)
        for rows, order, nexts in ((self.anc, g.topo, g.preds),
                                   (self.desc, g.topo[::-1], g.succs)):
            for v in order:
                row = rows[v]
                for u in nexts[v]:
                    row |= rows[u]
                    row[u >> 3] |= 0x80 >> (u & 7)
        self.n_anc = np.unpackbits(self.anc, axis=1, count=n).sum(axis=1, dtype=np.int64)
        self.n_desc = np.unpackbits(self.desc, axis=1, count=n).sum(axis=1, dtype=np.int64)

    def only(self, v: int) -> np.ndarray:
        """The bit row of {v}."""
        row = np.zeros(self.anc.shape[1], dtype=np.uint8)
        row[v >> 3] = 0x80 >> (v & 7)
        return row

    def anc_or_self(self, v: int) -> np.ndarray:
        return self.anc[v] | self.only(v)

    def desc_or_self(self, v: int) -> np.ndarray:
        return self.desc[v] | self.only(v)

    def windows(self) -> tuple[np.ndarray, np.ndarray]:
        """Earliest and latest step of each node when one node runs per step (ASAP/ALAP:
        after all its ancestors, before all its descendants)."""
        return self.n_anc.copy(), self.n - 1 - self.n_desc


# ---------------------------------------------------------------------------------- traces
class _Storage:
    """A storage while the trace is read: its accesses and the writes that order them."""

    __slots__ = ("accessors", "creator", "last_writer", "name", "readers", "size")

    def __init__(self, name: str, size: int, creator: int) -> None:
        self.name, self.size, self.creator = name, size, creator
        self.accessors: set[int] = set()
        self.last_writer = creator  # the node whose version is current
        self.readers: list[int] = []  # nodes that read the current version


def from_trace(trace: Trace) -> Graph:
    """The storage-level dataflow graph of a trace (calls, and ``get`` events as nodes that
    read their tensor). Node ids follow the trace. An overwriting ``pin`` announces that the
    next call writes that tensor outside the recorded history (an optimizer update): that
    call becomes its writer."""
    ops: list[str] = []
    labels: list[str] = []
    storages: list[_Storage] = []
    handles: dict[int, tuple[_Storage, int]] = {}  # handle -> (storage, node that bound it)
    order_edges: set[tuple[int, int]] = set()
    overwritten: list[_Storage] = []  # written by the next call (overwriting pins)

    def new_node(op: str, line: int | None) -> int:
        ops.append(op)
        labels.append(f"{op}@{line}" if line is not None else f"{op}#{len(ops) - 1}")
        return len(ops) - 1

    def read(v: int, h: int, line: int | None) -> _Storage:
        try:
            st, binder = handles[h]
        except KeyError:
            raise GraphError(f"{trace.path}:{line}: tensor {h} is not live here") from None
        for u in (binder, st.last_writer):
            if u not in (LEAF, v):
                order_edges.add((u, v))
        st.accessors.add(v)
        st.readers.append(v)
        return st

    def write(v: int, st: _Storage) -> None:
        for u in (*st.readers, st.last_writer):
            if u not in (LEAF, v):
                order_edges.add((u, v))
        st.accessors.add(v)
        st.last_writer, st.readers = v, []

    for ev in trace.events:
        kind, line = ev[0], ev[1]
        if kind == CALL:
            _, _, op, ins, outs, nbytes, alias, _cost, mut = ev
            v = new_node(op, line)
            read_st = [read(v, h, line) for h in ins]
            for m in mut:
                write(v, read_st[m])
                handles[ins[m]] = (read_st[m], v)
            for st in overwritten:
                write(v, st)
            overwritten = []
            for h, b, a in zip(outs, nbytes, alias, strict=True):
                if a >= 0:
                    handles[h] = (read_st[a], v)
                else:
                    st = _Storage(f"t{h}@{line}", b, v)
                    storages.append(st)
                    handles[h] = (st, v)
        elif kind == PUT:
            st = _Storage(f"t{ev[2]}@{line}", ev[3], LEAF)
            storages.append(st)
            handles[ev[2]] = (st, LEAF)
        elif kind in (COPY, COPY_FROM):
            if ev[2] not in handles:
                raise GraphError(f"{trace.path}:{line}: tensor {ev[2]} is not live here")
            handles[ev[3]] = handles[ev[2]]
        elif kind == RELEASE:
            if handles.pop(ev[2], None) is None:
                raise GraphError(f"{trace.path}:{line}: tensor {ev[2]} is not live here")
        elif kind == GET:
            v = new_node("get", line)
            read(v, ev[2], line)
        elif kind == PIN and len(ev) > 3 and ev[3]:  # the next call writes it (optimizer)
            if ev[2] not in handles:
                raise GraphError(f"{trace.path}:{line}: tensor {ev[2]} is not live here")
            overwritten.append(handles[ev[2]][0])

    held = {id(st) for st, _ in handles.values()}
    tensors: list[Tensor] = []
    data_edges: set[tuple[int, int]] = set()
    for st in storages:
        sinks = tuple(sorted(st.accessors - {st.creator}))
        tensors.append(Tensor(st.name, st.size, st.creator, sinks,
                              st.creator != LEAF and id(st) in held))
        if st.creator != LEAF:
            data_edges.update((st.creator, s) for s in sinks)
    control: dict[int, list[int]] = {}
    for u, v in sorted(order_edges - data_edges):
        control.setdefault(u, []).append(v)
    tensors += [Tensor(f"ctrl@{labels[u]}", 0, u, tuple(vs)) for u, vs in control.items()]
    return Graph(ops, tensors, name=trace.name, labels=labels)
