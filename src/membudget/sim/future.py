"""What a replay tells a policy that knows the future (``needs_future``): where the program
is, and when each storage it makes will be read, from one pass over the trace's events.
Positions are call indices, or with the policy's ``by_time`` the recorded cost of the calls
before, in units of the mean call's."""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import accumulate

from membudget.core.policies.future import DTRFuture
from membudget.core.records import Tensor
from membudget.sim.replay import CallHooks
from membudget.trace.format import CALL, COPY, COPY_FROM, GET, PUT, RELEASE, Event


def read_times(events: list[Event]) -> tuple[list[list[float]], list[list[int]],
                                              list[list[int]]]:
    """Each value's reads (calls by index; a ``get`` between calls k and k + 1 at
    k + 0.5; what the program holds at the end at the number of calls) by value number, and
    for each call the value numbers of its inputs and of its results (outputs, then new
    versions of the inputs it wrote), in the order the engine gives them."""
    reads: list[list[float]] = []
    inputs_of: list[list[int]] = []
    results_of: list[list[int]] = []
    bound: dict[int, int] = {}  # trace id -> value number

    def new() -> int:
        reads.append([])
        return len(reads) - 1

    k = -1
    for ev in events:
        kind = ev[0]
        if kind == CALL:
            ins, outs, mut = ev[3], ev[4], ev[8]
            k += 1
            values = [bound[i] for i in ins]
            for v in values:
                reads[v].append(k)
            inputs_of.append(values)
            results = []
            for o in outs:
                bound[o] = v = new()
                results.append(v)
            for idx in mut:
                bound[ins[idx]] = v = new()
                results.append(v)
            results_of.append(results)
        elif kind == RELEASE:
            del bound[ev[2]]
        elif kind in (COPY, COPY_FROM):
            bound[ev[3]] = bound[ev[2]]
        elif kind == PUT:
            bound[ev[2]] = new()
        elif kind == GET:
            reads[bound[ev[2]]].append(k + 0.5)
    for v in set(bound.values()):
        reads[v].append(k + 1)
    return reads, inputs_of, results_of


class FutureReads:
    """Replay hooks that keep ``policy`` told of the program's position and of the reads of
    every storage as it appears (a call's results; a value put before, at its first read),
    then pass each call on to ``inner``."""

    def __init__(self, policy: DTRFuture, events: list[Event],
                 inner: CallHooks | None = None) -> None:
        self.policy, self.inner = policy, inner
        self.reads, self.inputs_of, self.results_of = read_times(events)
        self.told: set[int] = set()  # value numbers whose reads the policy has
        costs = [float(ev[7]) for ev in events if ev[0] == CALL] if policy.by_time else []
        if costs:
            unit = (sum(costs) / len(costs)) or 1.0
            starts = list(accumulate([c / unit for c in costs], initial=0.0))
            # a read between calls k and k + 1 (k + 0.5) sits at the end of call k
            self.position: Callable[[float], float] = lambda r: starts[math.ceil(r)]
        else:
            self.position = float

    def before_call(self, k: int) -> None:
        self.policy.at(self.position(k))
        if self.inner is not None:
            self.inner.before_call(k)

    def after_call(self, k: int, inputs: list[Tensor], results: list[Tensor]) -> None:
        told, reads, policy = self.told, self.reads, self.policy
        for tensors, values in ((inputs, self.inputs_of[k]), (results, self.results_of[k])):
            for t, v in zip(tensors, values, strict=True):
                if v not in told:
                    told.add(v)
                    policy.will_read(t.storage, [self.position(r) for r in reads[v] if r > k])
        if self.inner is not None:
            self.inner.after_call(k, inputs, results)
