"""Replay a trace's commands through an engine: the simulator's inner loop."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from membudget.core.engine import Engine
from membudget.core.records import Tensor
from membudget.errors import TraceError
from membudget.trace.format import (
    CALL,
    COPY,
    COPY_FROM,
    GET,
    PHASE,
    PIN,
    PUT,
    RELEASE,
    Event,
)


class CallHooks(Protocol):
    """What a replay tells an observer about each call: ``k`` counts the trace's calls from 0
    (the same index in a live step, so a plan made on a trace applies to the live run)."""

    def before_call(self, k: int) -> None:
        """Call ``k`` is about to run."""

    def after_call(self, k: int, inputs: list[Tensor], results: list[Tensor]) -> None:
        """Call ``k`` ran on ``inputs``: its outputs, then the new versions of the inputs it
        wrote."""


def replay(engine: Engine, events: Iterable[Event], source: object = "<trace>",
           hooks: CallHooks | None = None) -> dict[int, Tensor]:
    """Run every event on ``engine``, then materialize every value the program still holds
    (a step's outputs and gradients are read after it; an evicted one must be recomputed).
    Returns those values by trace id."""
    handles: dict[int, Tensor] = {}
    ev: Event = ("", None)
    k = -1
    try:
        for ev in events:
            kind = ev[0]
            if kind is CALL or kind == CALL:
                _, _, op, ins, outs, nbytes, alias, cost, mut = ev
                inputs = [handles[i] for i in ins]
                k += 1
                if hooks is not None:
                    hooks.before_call(k)
                results = engine.apply(op, inputs, nbytes, alias, cost, mut)
                if hooks is not None:
                    hooks.after_call(k, inputs, results)
                for tid, t in zip(outs, results, strict=False):
                    handles[tid] = t
                for j, idx in enumerate(mut):  # copy-on-write: rebind, then drop the old
                    tid = ins[idx]
                    old = handles[tid]
                    handles[tid] = results[len(outs) + j]
                    engine.release(old)
            elif kind == RELEASE:
                engine.release(handles.pop(ev[2]))
            elif kind == COPY:
                t = handles[ev[2]]
                engine.retain(t)
                handles[ev[3]] = t
            elif kind == PUT:
                handles[ev[2]] = engine.put(ev[3], ev[4])
            elif kind == COPY_FROM:
                t = handles[ev[2]]
                old = handles.get(ev[3])
                if old is not t:
                    if old is not None:
                        engine.release(old)
                    engine.retain(t)
                    handles[ev[3]] = t
            elif kind == GET:
                engine.get_value(handles[ev[2]])
            elif kind == PIN:
                engine.pin(handles[ev[2]], ev[3])
            elif kind == PHASE:  # what the program computes from here on
                engine.output_kind = "gradient" if ev[2] == "backward" else "activation"
            else:
                raise TraceError(source, ev[1], f"unknown event kind {kind!r}")
    except KeyError as e:
        raise TraceError(source, ev[1], f"tensor {e.args[0]} is not live here (never defined, "
                                        "or already released)") from None
    for t in handles.values():
        if not t.defined:
            engine.get_value(t)
    return handles
