"""The rematerialization problem of one recorded step, as the optimum needs it.

The trace is replayed once with no budget through the engine itself, so views, in-place
writes (copy-on-write versions), pinning and the engine's frees mean here exactly what they
mean in the simulator. What comes out is, at the level of storages:

- *stages*: the step's calls in their recorded order (call ``k`` is stage ``k``);
- *values*: every storage a call makes that the engine may evict (not pinned), with its
  bytes, the call that makes it, and the times it is needed: each call that reads it
  (stage ``k``), a pin that freezes it (between two stages, ``k - 0.5``), and the end of
  the step if the program still holds it (``n``);
- ``fixed[k]``: bytes no schedule can evict at stage ``k`` (pinned storages: parameters,
  inputs, what the program pinned);
- when the program releases each value: from then on the engine holds it only for a
  moment, while recomputing something made from it (it evicts a released value at once).

A value that is not resident somewhere strictly between two consecutive times it is needed
must be recomputed before the second one, which runs the call that made it again.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from membudget.core.engine import Engine
from membudget.core.records import Storage, Tensor
from membudget.sim.replay import replay
from membudget.trace.format import CALL, Trace


@dataclass
class Value:
    """One evictable storage: made by call ``call`` (output ``slot``), ``nbytes`` big, needed
    at ``needs`` (increasing stage times; half-integers for pins). ``weight`` is its share of
    its call's cost (shares of one call sum to the call's cost), the least that recomputing
    it can be charged when one rerun may serve several outputs of the call."""

    call: int
    slot: int
    nbytes: int
    weight: float
    needs: list[float] = field(default_factory=list)
    released: float = math.inf  # between two stages (k - 0.5); inf: held to the end

    @property
    def last_need(self) -> float:
        return self.needs[-1] if self.needs else float(self.call)

    def gaps(self) -> list[tuple[float, float]]:
        """The open intervals between consecutive needs (from its making on)."""
        times = [float(self.call), *self.needs]
        return [(a, b) for a, b in itertools.pairwise(times) if b > a]


@dataclass
class RematProblem:
    """One step: ``n`` stages, per-stage ``cost``, ``fixed`` bytes and ``required`` bytes (what
    stage ``k`` itself needs resident: its inputs and outputs), and the evictable values."""

    name: str
    cost: np.ndarray  # float64[n]: each call's cost
    fixed: np.ndarray  # int64[n]
    values: list[Value]
    base_cost: float  # the simulator's baseline: every op once
    base_peak: int  # the simulator's baseline peak

    @property
    def n(self) -> int:
        return len(self.cost)

    def live_bytes(self) -> np.ndarray:
        """Bytes each stage holds if nothing is evicted before its last need: fixed memory
        plus every value from its making to the last time it is needed (int64[n])."""
        diff = np.zeros(self.n + 1, dtype=np.int64)
        for v in self.values:
            end = min(self.n - 1, math.floor(v.last_need))
            diff[v.call] += v.nbytes
            diff[end + 1] -= v.nbytes
        return self.fixed + np.cumsum(diff[:-1])

    def reads(self) -> list[list[int]]:
        """The values (indices into ``values``) each call reads, from their needs."""
        reads: list[list[int]] = [[] for _ in range(self.n)]
        for k, v in enumerate(self.values):
            for t in v.needs:
                if t == int(t) and t < self.n and t != v.call:
                    reads[int(t)].append(k)
        return reads

    def required_bytes(self) -> np.ndarray:
        """Bytes stage ``k`` cannot do without: fixed memory, its outputs and every value it
        reads (int64[n]). No budget below the largest of them lets the step run."""
        req = self.fixed.copy()
        for v in self.values:
            req[v.call] += v.nbytes
            for t in v.needs:
                if t == int(t) and t < self.n and t != v.call:
                    req[int(t)] += v.nbytes
        return req


class _Extractor:
    """Replay hooks that collect the values, their needs and the fixed bytes of each stage."""

    def __init__(self, engine: Engine, n: int) -> None:
        self.engine = engine
        self.values: list[Value] = []
        self.of: dict[Storage, Value] = {}
        self.live: list[tuple[Storage, Value]] = []  # resident, evictable, maybe not any more
        self.fixed = np.zeros(n, dtype=np.int64)
        self.pinned_new = np.zeros(n, dtype=np.int64)
        self.cost = np.zeros(n, dtype=np.float64)

    def before_call(self, k: int) -> None:
        still: list[tuple[Storage, Value]] = []
        evictable = 0
        for s, v in self.live:
            if s.pinned:  # pinned since: needed where the pin took it, fixed from then on
                v.needs.append(k - 0.5)
                del self.of[s]  # (its later reads need nothing: it is fixed memory)
            elif s.resident and s.ext_refs:
                still.append((s, v))
                evictable += s.nbytes
            else:  # released (and evicted or freed by the engine)
                v.released = k - 0.5
        self.live = still
        self.fixed[k] = self.engine.used_bytes - evictable

    def after_call(self, k: int, inputs: list[Tensor], results: list[Tensor]) -> None:
        of = self.of
        for t in inputs:
            v = of.get(t.storage)
            if v is not None and (not v.needs or v.needs[-1] != k):
                v.needs.append(float(k))
        fresh: list[tuple[int, Storage]] = []
        for j, t in enumerate(results):
            s = t.storage
            if t.alias or s in of:
                continue
            if s.pinned:
                self.pinned_new[k] += s.nbytes
            elif s.nbytes > 0:
                fresh.append((j, s))
        path = results[0].producer if results else None
        cost = path.cost if path is not None else 0.0
        self.cost[k] = cost
        total = sum(s.nbytes for _, s in fresh)
        for j, s in fresh:
            v = Value(k, j, s.nbytes, cost * s.nbytes / total)
            self.values.append(v)
            of[s] = v
            self.live.append((s, v))


def remat_problem(trace: Trace) -> RematProblem:
    """Replay ``trace`` once without a budget and return its rematerialization problem."""
    n = sum(1 for ev in trace.events if ev[0] == CALL)
    engine = Engine(math.inf, "lru", keep_released_leaves=False)
    ex = _Extractor(engine, n)
    held = replay(engine, trace.events, trace.path, ex)
    for t in held.values():
        v = ex.of.get(t.storage)
        if v is not None and not t.storage.pinned:
            v.needs.append(float(n))
    for v in ex.values:
        v.needs.sort()
    return RematProblem(trace.name, ex.cost, ex.fixed + ex.pinned_new, ex.values,
                        engine.stats.base_cost, engine.peak_bytes)
