"""A DDP-style training step on two streams, and what a serial-order plan of it shares
unsafely.

:func:`ddp_step` takes one step's graph (its ops in the recorded order) and its parameters'
gradients. The gradients are grouped into buckets in the order backward makes them (a bucket
closes once it holds ``bucket_bytes``, as DDP's ``bucket_cap_mb``), and each bucket gets an
all-reduce on the communication stream, launched right after its last gradient: it reads the
bucket's gradients and writes the reduced bucket, which the optimizer reads instead of them.
Each all-reduce depends on its bucket's gradients; the optimizer's first op waits on every
all-reduce. The recorded order with the all-reduces inserted is the serial order: its
lifetimes free a gradient at its all-reduce's launch, so a later backward tensor may take
that memory while the all-reduce may still be reading it on the other stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from membudget.plan.graph import LEAF, Graph, Tensor, from_trace
from membudget.plan.pack import pack
from membudget.plan.planner import location_problem
from membudget.plan.problem import PlanError
from membudget.plan.stream_pack import StreamPlan, plan_streams
from membudget.plan.stream_validate import UnsafePair, unsafe_pairs
from membudget.plan.streams import StreamProgram, conflict_graph
from membudget.trace.format import CALL, GET, PHASE, Trace

COMPUTE, COMM = 0, 1
STREAM_NAMES = {COMPUTE: "compute", COMM: "comm"}
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
ALL_REDUCE = "c10d.allreduce_"


@dataclass(frozen=True)
class DDPStep:
    """A DDP-style step: the stream program, each bucket's gradients (tensor indices in
    ``program.graph``, in the order backward makes them) and each bucket's all-reduce op."""

    program: StreamProgram
    buckets: tuple[tuple[int, ...], ...]
    all_reduces: tuple[int, ...]

    @property
    def gradient_bytes(self) -> int:
        """Bytes of all the gradients the all-reduces read."""
        return sum(self.program.graph.tensors[k].size for ks in self.buckets for k in ks)


def optimizer_gradients(trace: Trace, graph: Graph) -> tuple[list[int], int]:
    """The parameters' gradients of a step (the tensors of size > 0 made before its
    ``optimizer`` phase and read in it, as indices into ``graph = from_trace(trace)``) and
    the first op of that phase."""
    phases: list[str] = []
    phase = ""
    for ev in trace.events:
        if ev[0] == PHASE:
            phase = ev[2]
        elif ev[0] in (CALL, GET):  # the events from_trace makes nodes of
            phases.append(phase)
    if len(phases) != graph.n:
        raise PlanError(f"trace {trace.name!r} has {len(phases)} ops but its graph {graph.n}: "
                        f"the graph is not from_trace(trace)")
    start = next((v for v, p in enumerate(phases) if p == "optimizer"), None)
    if start is None:
        raise PlanError(f"trace {trace.name!r} has no 'optimizer' phase, so its gradients "
                        f"cannot be told from its other tensors")
    grads = [k for k, t in enumerate(graph.tensors) if t.src != LEAF and t.size > 0
             and t.src < start and any(s >= start for s in t.sinks)]
    if not grads:
        raise PlanError(f"the optimizer of trace {trace.name!r} reads no tensor made before it")
    return grads, start


def _buckets(graph: Graph, grads: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """``grads`` in the order they are made, cut into buckets of at least ``bucket_bytes``
    (the last one may hold less)."""
    buckets: list[list[int]] = [[]]
    held = 0
    for k in sorted(grads, key=lambda k: (graph.tensors[k].src, k)):
        buckets[-1].append(k)
        held += graph.tensors[k].size
        if held >= bucket_bytes:
            buckets.append([])
            held = 0
    return [b for b in buckets if b]


def ddp_step(graph: Graph, grads: Sequence[int], optimizer_start: int,
             bucket_bytes: int = BUCKET_BYTES) -> DDPStep:
    """The two-stream program of ``graph``'s step under DDP: ``grads`` (tensor indices)
    all-reduced in buckets on the communication stream while backward goes on, ops from
    ``optimizer_start`` on (the optimizer) reading the reduced buckets after every
    all-reduce. Tensor indices are kept; the reduced buckets are appended after them."""
    if bucket_bytes <= 0:
        raise PlanError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    if not 0 <= optimizer_start < graph.n:
        raise PlanError(f"optimizer_start {optimizer_start} is not an op of {graph.name!r} "
                        f"(0..{graph.n - 1})")
    for k in grads:
        t = graph.tensors[k]
        if t.src == LEAF or t.src >= optimizer_start or t.size <= 0:
            raise PlanError(f"tensor {t.name!r} is not a gradient: it must have a size and "
                            f"be made by an op before the optimizer's first, "
                            f"{graph.labels[optimizer_start]}")
    buckets = _buckets(graph, grads, bucket_bytes)
    launch_after: dict[int, list[int]] = {}
    for b, ks in enumerate(buckets):
        launch_after.setdefault(graph.tensors[ks[-1]].src, []).append(b)
    ops: list[str] = []
    labels: list[str] = []
    streams: list[int] = []
    new_id: list[int] = []
    all_reduces = [0] * len(buckets)
    for v in range(graph.n):
        new_id.append(len(ops))
        ops.append(graph.ops[v])
        labels.append(graph.labels[v])
        streams.append(COMPUTE)
        for b in launch_after.get(v, ()):
            all_reduces[b] = len(ops)
            ops.append(ALL_REDUCE)
            labels.append(f"all_reduce[bucket {b}]")
            streams.append(COMM)
    bucket_of = {k: b for b, ks in enumerate(buckets) for k in ks}
    readers: list[set[int]] = [set() for _ in buckets]  # optimizer ops of each reduced bucket
    held = [False] * len(buckets)
    tensors = []
    for k, t in enumerate(graph.tensors):
        src = LEAF if t.src == LEAF else new_id[t.src]
        b = bucket_of.get(k)
        if b is None:
            tensors.append(Tensor(t.name, t.size, src, tuple(new_id[s] for s in t.sinks),
                                  t.to_end))
            continue
        readers[b].update(new_id[s] for s in t.sinks if s >= optimizer_start)
        held[b] = held[b] or t.to_end
        sinks = sorted({new_id[s] for s in t.sinks if s < optimizer_start} | {all_reduces[b]})
        tensors.append(Tensor(t.name, t.size, src, tuple(sinks)))
    for b, ks in enumerate(buckets):
        tensors.append(Tensor(f"reduced_bucket{b}", sum(graph.tensors[k].size for k in ks),
                              all_reduces[b], tuple(sorted(readers[b])), held[b]))
    waits = [(a, new_id[optimizer_start]) for a in all_reduces]
    program = StreamProgram(Graph(ops, tensors, name=f"{graph.name} (DDP)", labels=labels),
                            streams, waits, STREAM_NAMES)
    return DDPStep(program, tuple(tuple(ks) for ks in buckets), tuple(all_reduces))


def ddp_from_trace(trace: Trace, bucket_bytes: int = BUCKET_BYTES) -> DDPStep:
    """:func:`ddp_step` of a recorded step, its gradients told by its optimizer phase."""
    graph = from_trace(trace)
    grads, start = optimizer_gradients(trace, graph)
    return ddp_step(graph, grads, start, bucket_bytes)


@dataclass(frozen=True)
class Comparison:
    """A serial-order plan of a stream program against the safe plan (bytes). ``unsafe``:
    the pairs the serial plan puts at shared addresses although some interleaving has both
    live; ``unsafe_bytes``: the addresses they share (each counted once); ``serial_only``:
    the pairs the serial lifetimes keep apart that some interleaving has live at once."""

    tensors: int
    serial_arena: int
    serial_max_load: int
    serial_method: str
    unsafe: tuple[UnsafePair, ...]
    unsafe_bytes: int
    serial_only: int
    safe: StreamPlan

    @property
    def cost_of_safety(self) -> float:
        """How much larger the safe arena is than the serial one, as a fraction of it."""
        return self.safe.height / self.serial_arena - 1 if self.serial_arena else 0.0


def _union_length(ranges: Sequence[tuple[int, int]]) -> int:
    """Bytes covered by half-open address ranges, overlaps counted once."""
    total = end = 0
    for low, high in sorted(ranges):
        if high > end:
            total += high - max(low, end)
            end = high
    return total


def compare(program: StreamProgram, time_limit: float = 10.0) -> Comparison:
    """Plan ``program`` twice: from the lifetimes of its serial order (its op ids, as the
    single-stream planner does, packed by :func:`membudget.plan.pack.pack` within
    ``time_limit`` seconds) and safely (:func:`plan_streams`); find what the first shares
    unsafely with the independent validator."""
    graph = program.graph
    problem = location_problem(graph)
    serial = pack(problem, time_limit=time_limit)
    unsafe = unsafe_pairs(program, serial.offsets)
    safe_conflicts = conflict_graph(program)
    serial_conflicts = conflict_graph(StreamProgram(graph, [0] * graph.n))
    serial_only = int(np.count_nonzero(safe_conflicts.matrix & ~serial_conflicts.matrix)) // 2
    safe = plan_streams(program, safe_conflicts)
    return Comparison(len(problem), serial.height, serial.max_load, serial.method,
                      tuple(unsafe), _union_length([(p.low, p.high) for p in unsafe]),
                      serial_only, safe)
