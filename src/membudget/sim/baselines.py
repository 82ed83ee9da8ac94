"""Static checkpointing baselines in the simulator, as eviction plans.

A static strategy keeps a set of forward values (:mod:`membudget.sim.keepsets` chooses it);
:func:`plan_from_keep` turns it into an :class:`~membudget.sim.evictions.EvictionPlan`:

1. every other forward value the program still holds is evicted once its last forward
   read has run (values the program has released are already gone: the engine evicts a
   released value eagerly, so only held values can be kept at all);
2. in the backward the engine recomputes an evicted value when something reads it, from
   the nearest values still resident: that is the strategy's recomputation. A recomputed
   value the program no longer holds would then stay resident (a budget would evict it, an
   unlimited run never does), so the plan evicts it again just before the call after its
   last read, as a checkpointed segment's recomputed intermediates are freed after their
   backward. Where that is, a replay of the plan so far tells (the engine decides what it
   recomputes, and when); an eviction listed before a value's last read would add a
   recomputation, and none is.

Forward values the program reads after the backward started other than through a call (the
loss it prints, what it holds at the end or when the optimizer writes the parameters) are
always kept (:meth:`~membudget.sim.keepsets.StepGraph.results`). A plan acts between calls
only: what one call recomputes on the way to what it reads stays resident until the next
call, where a checkpointing runtime frees each intermediate once the recomputation has used
it; :func:`unheld_at_peak` measures how much of a plan's peak that is.

Run with an unlimited budget (:func:`run_plan`) the simulation executes exactly the plan:
its peak is the strategy's peak, its overhead the strategy's recomputation. ``BASELINES``
names the four: ``chen-sqrt``, ``per-block``, ``selective`` (Megatron's SAR) and ``min-cut``
(the knapsack of torch.compile's activation memory budget; takes ``budget`` bytes).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from membudget.core.engine import Engine
from membudget.core.executor import Executor
from membudget.core.records import ComputePath, Storage, Tensor
from membudget.errors import UnknownNameError
from membudget.sim import keepsets
from membudget.sim.evictions import EvictionPlan, ValueKey
from membudget.sim.replay import replay
from membudget.sim.simulate import Baseline, SimResult, simulate
from membudget.trace.format import Trace

UNLIMITED = 2**62  # a budget no trace reaches: the run is the plan's
POLICY = "dtr-eq"  # decides nothing under UNLIMITED; named so the run is reproducible


# ---------------------------------------------------------------------------------- plans
def forward_evictions(g: keepsets.StepGraph, keep: set[int]) -> dict[int, list[ValueKey]]:
    """Step 1 of the module docstring: each forward value not in ``keep`` that the program
    still holds after its last forward read, evicted just before the next call."""
    released = g.releases
    before: dict[int, list[ValueKey]] = defaultdict(list)
    for v in g.forward_values():
        if v.index in keep or v.nbytes == 0 or v.key is None:
            continue
        j = g.last_forward_read(v) + 1
        if released.get(v.index, math.inf) > j:
            before[j].append(v.key)
    return before


class _Accesses(Executor):
    """A simulated executor that notes, per call of the trace, the storages each executed
    path (the call itself or a recomputation it needed) read or made."""

    def __init__(self) -> None:
        self.call = -1
        self.reads: dict[Storage, int] = {}  # storage -> last call that needed it resident
        self.remade: set[Storage] = set()

    def run(self, path: ComputePath, remat: bool) -> float:
        k = self.call
        for t in path.inputs:
            self.reads[t.storage] = k
        if path.outputs is not None:
            for t in path.outputs:
                self.reads[t.storage] = k
                if remat:
                    self.remade.add(t.storage)
        return path.cost

    def drop(self, storage: Storage) -> None:
        return None

    def value(self, tensor: Tensor) -> object:
        return None


class _Follow:
    """The replay hooks of a dry run: evict ``plan.before[k]`` just before call ``k`` (the
    plans built here say *before which call*; :func:`_as_plan` turns that into the
    :class:`~membudget.sim.evictions.EvictionPlan` convention, where a value listed at
    ``k`` goes once call ``k`` has run), map each storage to its value key and tell the
    executor which call is running."""

    def __init__(self, engine: Engine, plan: EvictionPlan, seen: _Accesses) -> None:
        self.engine = engine
        self.plan = plan
        self.seen = seen
        self.made: dict[ValueKey, Tensor] = {}
        self.keys: dict[Storage, ValueKey] = {}
        self.done: set[tuple[int, ValueKey]] = set()  # (call, key) evictions carried out

    def before_call(self, k: int) -> None:
        self.seen.call = k
        for key in self.plan.before.get(k, ()):
            t = self.made.get(key)
            if t is not None and t.storage.resident and self.engine.evict(t):
                self.done.add((k, key))

    def after_call(self, k: int, inputs: list[Tensor], results: list[Tensor]) -> None:
        for j, t in enumerate(results):
            if not t.alias:
                self.made[(k, j)] = t
                self.keys[t.storage] = (k, j)


def _as_plan(before: dict[int, list[ValueKey]], source: str, shift: int) -> EvictionPlan:
    """``before`` with every call index moved by ``shift`` (-1: from "evict before call k"
    to the plans' "evict once call k - 1 has run"; +1 back)."""
    return EvictionPlan({k + shift: list(v) for k, v in sorted(before.items())
                         if v and k + shift >= 0}, source)


def _dry_run(trace: Trace, plan: EvictionPlan) -> tuple[_Accesses, _Follow]:
    seen = _Accesses()
    engine = Engine(UNLIMITED, POLICY, executor=seen)
    follow = _Follow(engine, plan, seen)
    replay(engine, trace.events, trace.path, follow)
    return seen, follow


def plan_from_keep(trace: Trace, g: keepsets.StepGraph, keep: set[int],
                   source: str) -> EvictionPlan:
    """The eviction plan of a static strategy that keeps the forward values ``keep``
    (indices into ``g.values``): see the module docstring. Two replays: the forward
    evictions alone (to see what the backward recomputes, and its last reads), then the
    whole plan, whose evictions of values already gone are dropped."""
    before = forward_evictions(g, keep | g.results())
    seen, follow = _dry_run(trace, EvictionPlan(dict(before), source))
    index = g.by_key()
    for s in seen.remade:
        key = follow.keys.get(s)
        if key is None:
            continue
        k = max(seen.reads.get(s, -1), g.late_reads.get(index[key], 0) - 1) + 1
        if k < g.calls:
            before[k].append(key)
    # keep only what a replay carries out (a value already gone is no eviction)
    _, check = _dry_run(trace, EvictionPlan(dict(before), source))
    return _as_plan({k: [key for key in keys if (k, key) in check.done]
                     for k, keys in before.items()}, source, -1)


def unheld_at_peak(trace: Trace, plan: EvictionPlan) -> tuple[int, int]:
    """A diagnostic replay of ``plan`` (unlimited budget): the most bytes held at the end of
    a call, and how many of those were values the program no longer holds that the call
    recomputed on the way to what it read. A plan evicts only between calls, so these stay
    until the next one; a checkpointing runtime frees each as soon as its last consumer in
    the recomputation has run. The first number bounds the run's peak from below (within a
    call a temporary can add to it), the difference estimates that runtime's peak."""
    seen = _Accesses()
    engine = Engine(UNLIMITED, POLICY, executor=seen)

    class Peak(_Follow):
        best = (0, 0)

        def after_call(self, k: int, inputs: list[Tensor], results: list[Tensor]) -> None:
            super().after_call(k, inputs, results)
            used = engine.used_bytes
            if used > self.best[0]:
                unheld = sum(s.nbytes for s in seen.remade
                             if s.resident and not s.pinned and not s.ext_refs and not s.locks)
                self.best = (used, unheld)

    follow = Peak(engine, _as_plan(plan.before, plan.source, +1), seen)
    replay(engine, trace.events, trace.path, follow)
    return follow.best


# ---------------------------------------------------------------------------------- baselines
def _graph(trace: Trace, graph: keepsets.StepGraph | None) -> keepsets.StepGraph:
    return graph if graph is not None else keepsets.StepGraph(trace)


def chen_sqrt(trace: Trace, *, segments: int | None = None,
              graph: keepsets.StepGraph | None = None) -> EvictionPlan:
    """Chen et al.'s √n checkpointing (:func:`membudget.sim.keepsets.chen_sqrt`)."""
    g = _graph(trace, graph)
    return plan_from_keep(trace, g, keepsets.chen_sqrt(g, segments).keep, "chen-sqrt")


def per_block(trace: Trace, *, blocks: list[tuple[int, int]] | None = None,
              graph: keepsets.StepGraph | None = None) -> EvictionPlan:
    """Per-block checkpointing over the trace header's ``blocks`` (recorded by
    :func:`membudget.trace.capture.capture_step`) or blocks inferred from the forward graph
    (:func:`membudget.sim.keepsets.per_block`)."""
    g = _graph(trace, graph)
    if blocks is None:
        blocks = header_blocks(trace)
    return plan_from_keep(trace, g, keepsets.per_block(g, blocks).keep, "per-block")


def header_blocks(trace: Trace) -> list[tuple[int, int]] | None:
    """The ``blocks`` of a trace header as ``[begin, end)`` call ranges, or None."""
    blocks = trace.header.get("blocks")
    return [(int(b), int(e)) for b, e in blocks] if blocks else None


def selective(trace: Trace, *, graph: keepsets.StepGraph | None = None) -> EvictionPlan:
    """Megatron-LM's selective recomputation (:func:`membudget.sim.keepsets.selective`);
    raises :class:`~membudget.sim.keepsets.NotATransformer` on a trace with no attention."""
    g = _graph(trace, graph)
    return plan_from_keep(trace, g, keepsets.selective(g).keep, "selective")


def min_cut(trace: Trace, *, budget: int, fusion_aware: bool = False,
            graph: keepsets.StepGraph | None = None) -> EvictionPlan:
    """The activation-budget knapsack (:func:`membudget.sim.keepsets.min_cut`): saved
    activations within ``budget`` bytes."""
    g = _graph(trace, graph)
    return plan_from_keep(trace, g, keepsets.min_cut(g, budget, fusion_aware).keep,
                          "min-cut" + ("-fused" if fusion_aware else ""))


BASELINES: dict[str, Callable[..., EvictionPlan]] = {
    "chen-sqrt": chen_sqrt, "per-block": per_block, "selective": selective, "min-cut": min_cut}


def make_plan(name: str, trace: Trace, **options: Any) -> EvictionPlan:
    """The plan of baseline ``name`` on ``trace`` (``min-cut`` needs ``budget=``)."""
    try:
        fn = BASELINES[name]
    except KeyError:
        raise UnknownNameError("baseline", name, BASELINES) from None
    return fn(trace, **options)


def run_plan(trace: Trace, plan: EvictionPlan, baseline: Baseline | None = None) -> SimResult:
    """Simulate ``plan`` alone: an unlimited budget, so the policy never decides."""
    return simulate(trace, POLICY, budget=UNLIMITED, plan=plan, baseline=baseline,
                    overhead_limit=None)
