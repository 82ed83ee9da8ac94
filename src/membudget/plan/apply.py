"""Applying a static plan: run a real training step's aten ops in the planned order.

The step (forward and backward) is recorded once through a budget session with no limit,
which keeps every op it ran (:class:`membudget.runtime.executor.OpCall`) beside the trace.
The plan is made from that trace; :func:`run_in_order` then replays the recorded aten ops on
the live model's tensors in any valid order, below autograd, random ops drawing from the RNG
state they first drew from, and frees each value after its last use in that order. It
measures the bytes of the storages it holds at every step, so the peak of the planned order
is measured, not predicted; the loss and gradients it computes are those of the eager step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from membudget.plan.graph import from_trace
from membudget.plan.planner import Plan, plan_trace
from membudget.runtime.call import RestoredRng, Slot, below_autograd
from membudget.runtime.flat import flatten_result, unflatten
from membudget.runtime.session import Session
from membudget.runtime.tensor import RematTensor
from membudget.trace.format import CALL, GET, PUT, RELEASE, Trace

UNLIMITED = 2**62


@dataclass
class Program:
    """One recorded step: its trace, the op of each call event, the real value of each leaf
    (by trace id), the loss's trace id and each parameter's gradient's, the eager peak
    (bytes the session held, freed when released, as eager PyTorch frees them), and the
    buffers with their values before the step (BatchNorm statistics the step updates in
    place), restored before each run so that every run starts where the eager step did."""

    trace: Trace
    ops: list[Any]
    leaves: dict[int, torch.Tensor]
    loss: int
    grads: dict[str, int]
    eager_peak: int
    buffers: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AppliedPlan:
    """A plan and the step run in its order: measured peaks (bytes) of the eager step, of the
    recorded order and of the planned order, and the loss and gradients computed."""

    plan: Plan
    eager_peak: int
    recorded_peak: int
    planned_peak: int
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def record_step(model: torch.nn.Module, batch: Any,
                loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> Program:
    """Run forward and backward once (eagerly, inside an unlimited session) and keep them as
    a program; ``model``'s gradients are set as by a plain step."""
    params = dict(model.named_parameters())
    buffers = [(b, b.clone()) for b in model.buffers()]
    with Session(UNLIMITED, "dtr", record=True) as session:
        session.adopt(params.values())
        loss = loss_fn(model, batch)
        loss.backward()
        rec = session.recording
        grads = {n: rec.tid(p.grad._ref.handle) for n, p in params.items()
                 if type(p.grad) is RematTensor}
        loss_id = rec.tid(loss._ref.handle)
        leaves = session.leaves.by_id()
        trace = rec.trace({"model": type(model).__name__, "source": "membudget.plan.apply"})
        ops = list(rec.ops)
    return Program(trace, ops, leaves, loss_id, grads, session.stats.peak_bytes, buffers)


def run_in_order(program: Program, order: Sequence[int]
                 ) -> tuple[dict[int, torch.Tensor], int]:
    """Run the program's nodes (the plan graph's node ids) in ``order``; return the values
    still held at the end (by trace id) and the peak bytes of the storages held."""
    with torch.no_grad():
        for buffer, before in program.buffers:
            buffer.copy_(before)
    nodes, held_at_end = _nodes(program.trace)
    values: dict[int, torch.Tensor] = dict(program.leaves)
    refs: dict[int, list[int]] = {}  # storage -> [values referring to it, bytes]
    live = 0

    def hold(tid: int, v: torch.Tensor) -> None:
        nonlocal live
        values[tid] = v
        st = v.untyped_storage()
        entry = refs.setdefault(st._cdata, [0, st.nbytes()])
        if entry[0] == 0:
            live += entry[1]
        entry[0] += 1

    def drop(tid: int) -> None:
        nonlocal live
        key = values.pop(tid).untyped_storage()._cdata
        entry = refs[key]
        entry[0] -= 1
        if entry[0] == 0:  # freed: a later storage may reuse the address
            live -= entry[1]
            del refs[key]

    leaves = dict(values)
    values.clear()
    for tid, v in leaves.items():
        hold(tid, v)
    last = {}
    for pos, v in enumerate(order):
        ev = nodes[v][0]
        for tid in ev[3] if ev[0] == CALL else (ev[2],):
            last[tid] = pos
    peak = live
    for pos, v in enumerate(order):
        ev, k = nodes[v]
        if ev[0] == GET:
            continue
        ins, outs = ev[3], ev[4]
        call = program.ops[k]
        real = [values[t] for t in ins]
        args, kwargs = unflatten([real[x.index] if type(x) is Slot else x
                                  for x in call.leaves], call.spec)
        with below_autograd(call.grad):
            if call.rng is not None:
                with RestoredRng(call.rng):
                    out = call.func(*args, **kwargs)
            else:
                out = call.func(*args, **kwargs)
        flat = flatten_result(out)[0]
        for k, tid in zip(call.outputs, outs, strict=True):
            hold(tid, flat[k])
        peak = max(peak, live)
        for tid in {*ins, *outs}:
            if tid in values and tid not in leaves and tid not in held_at_end \
                    and last.get(tid, -1) <= pos:
                drop(tid)
    return values, peak


def _nodes(trace: Trace) -> tuple[list[tuple[tuple, int]], set[int]]:
    """The plan graph's nodes as (trace event, index of the call among the trace's calls)
    (calls and gets, in trace order: the graph's node ids), and the ids the program still
    holds at the end."""
    nodes, held = [], set()
    calls = 0
    for ev in trace.events:
        if ev[0] == GET:
            nodes.append((ev, -1))
        if ev[0] == CALL:
            nodes.append((ev, calls))
            calls += 1
            held.update(ev[4])
        elif ev[0] == PUT:
            held.add(ev[2])
        elif ev[0] == RELEASE:
            held.discard(ev[2])
    return nodes, held


def apply_plan(model: torch.nn.Module, batch: Any,
               loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
               time_limit: float = 30.0) -> AppliedPlan:
    """Record one step of ``model``, plan it, and run it in the recorded and in the planned
    order on the live model's tensors; the gradients are left in ``.grad`` as by a plain step
    (those of the planned run)."""
    program = record_step(model, batch, loss_fn)
    plan = plan_trace(program.trace, time_limit, caching=False)
    graph = from_trace(program.trace)
    _, recorded_peak = run_in_order(program, range(graph.n))
    values, planned_peak = run_in_order(program, plan.order.order)
    params = dict(model.named_parameters())
    grads = {n: values[t] for n, t in program.grads.items()}
    for n, g in grads.items():
        params[n].grad = g
    return AppliedPlan(plan, program.eager_peak, recorded_peak, planned_peak,
                       values[program.loss], grads)
