"""Eviction plans: which values to evict before which call, decided ahead of a run.

A plan names a value by where the step made it: ``(call, slot)``, the call's index among
the step's calls and the output's position (a written input's new version comes after the
outputs, as the engine returns them). The index is the same in a trace and in the live step
it was recorded from, so one plan drives the simulator and the live runtime alike. Whatever
a plan leaves unsaid (an allocation that still does not fit) the engine's policy decides.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from membudget.core.allocators import Block
from membudget.core.engine import Engine
from membudget.core.policies import Policy, make_policy
from membudget.core.pool import CandidatePool
from membudget.core.records import Storage, Tensor
from membudget.errors import MembudgetError
from membudget.outputs import write_text

ValueKey = tuple[int, int]  # (call index in the step, output slot)


@dataclass
class EvictionPlan:
    """``before[k]``: the values to evict just before call ``k`` runs, in that order."""

    before: dict[int, list[ValueKey]] = field(default_factory=dict)
    source: str = ""  # what made it: a policy's name, "optimum", a baseline's name

    @property
    def evictions(self) -> int:
        return sum(len(v) for v in self.before.values())

    def values(self) -> set[ValueKey]:
        """Every value the plan evicts at least once."""
        return {key for keys in self.before.values() for key in keys}

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source,
                "before": {str(k): [list(v) for v in vs] for k, vs in sorted(self.before.items())}}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> EvictionPlan:
        try:
            before = {int(k): [(int(c), int(s)) for c, s in vs]
                      for k, vs in obj["before"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise MembudgetError(
                f"not an eviction plan ({e}); expected "
                '{"source": ..., "before": {"CALL": [[CALL, SLOT], ...]}}') from None
        return cls(before, str(obj.get("source", "")))

    def save(self, path: str | Path) -> None:
        write_text(path, json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> EvictionPlan:
        return cls.from_json(json.loads(Path(path).read_text()))


class PlanFollower:
    """Replay hooks that carry out a plan. The values ``before[k]`` lists are the victims of
    the allocations that need room from just before call ``k`` to just before call
    ``k + 1`` (call ``k``'s outputs and the recomputations it needs), in the plan's order,
    and whichever of them is still in memory when call ``k + 1`` comes is evicted then: a
    dynamic run and its recorded plan evict the same values at the same points. ``policy`` is
    the engine's policy wrapped with :func:`plan_first` (under a recording, if any), which
    answers searches so; the live runtime's planned mode follows plans the same way
    (``runtime/planned.py``). ``noted`` is told each value it evicts itself (a recording of
    the run, which follows a plan and adds the policy's own decisions to it)."""

    def __init__(self, engine: Engine, plan: EvictionPlan, policy: PlanFirst,
                 noted: Callable[[ValueKey], None] | None = None) -> None:
        self.engine = engine
        self.plan = plan
        self.wanted = plan.values()
        self.made: dict[ValueKey, Tensor] = {}  # only the values the plan names
        self.k = -1  # the call running
        self.evicted = 0  # victims still in memory at the next call, evicted then
        self.noted = noted
        self.policy = policy
        policy.follower = self

    def before_call(self, k: int) -> None:
        made, before = self.made, self.plan.before
        keys = before.get(k - 1)
        if keys:  # call k - 1's victims that no allocation took (made by it, too)
            evict = self.engine.evict
            for key in keys:
                t = made.get(key)
                if t is not None and t.storage.slot >= 0 and evict(t):
                    self.evicted += 1
                    if self.noted is not None:
                        self.noted(key)
        self.k = k
        deferred = self.policy.deferred
        deferred.clear()
        deferred.extend(made[key] for key in before.get(k, ()) if key in made)

    def after_call(self, k: int, inputs: list[Tensor], results: list[Tensor]) -> None:
        if not self.wanted:
            return
        for j, t in enumerate(results):
            if (k, j) in self.wanted:
                self.made[(k, j)] = t

    def upcoming(self) -> list[Tensor]:
        """The values the plan evicts around the next call, made so far."""
        made = self.made
        return [made[key] for key in self.plan.before.get(self.k + 1, ()) if key in made]


class _Wrapper(Policy):
    """A policy around another, which it forwards everything to."""

    name = "wrapper"

    def __init__(self, inner: Policy) -> None:
        self.inner = inner

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self.inner.attach(engine)

    def choose(self, pool: CandidatePool, clock: float) -> Storage:
        return self.inner.choose(pool, clock)

    def victims(self, pool: CandidatePool, clock: float, request: Storage) -> list[Storage]:
        return self.inner.victims(pool, clock, request)

    def relocations(self, pool: CandidatePool, clock: float,
                    request: Storage) -> list[tuple[Storage, Block | None]]:
        return self.inner.relocations(pool, clock, request)

    def on_evict(self, s: Storage) -> None:
        self.inner.on_evict(s)

    def on_remat(self, s: Storage) -> None:
        self.inner.on_remat(s)

    def on_forget(self, s: Storage) -> None:
        self.inner.on_forget(s)


def _subclass(cls: type[_Wrapper], inner: Policy) -> type:
    """``cls`` for wrapping ``inner``: it keeps the wrapped policy's defaults."""
    return type(f"{cls.__name__}_{type(inner).__name__}", (cls,), {
        "needs_layout": inner.needs_layout, "reads_free_adj": inner.reads_free_adj,
        "relocates": inner.relocates,
        "default_allocator": inner.default_allocator,
        "default_inplace": inner.default_inplace})


class _Recording(_Wrapper):
    """Notes each victim the policy picks, as the value it is and the call the replay was
    about to run (or running) when it was picked."""

    name = "recording"

    def __init__(self, inner: Policy) -> None:
        super().__init__(inner)
        self.call = 0
        self.keys: dict[Storage, ValueKey] = {}
        self.before: dict[int, list[ValueKey]] = defaultdict(list)

    def victims(self, pool: CandidatePool, clock: float, request: Storage) -> list[Storage]:
        chosen = self.inner.victims(pool, clock, request)
        for s in chosen:
            key = self.keys.get(s)
            if key is not None:
                self.before[self.call].append(key)
        return chosen

    def note(self, key: ValueKey) -> None:
        """A value evicted outside a search (by a plan followed): an eviction of this call."""
        self.before[self.call].append(key)


def recording_policy(policy: str | Policy, seed: int = 0) -> _Recording:
    """``policy`` wrapped so that its victims are noted; it keeps the policy's defaults."""
    inner = make_policy(policy, seed=seed) if isinstance(policy, str) else policy
    return _subclass(_Recording, inner)(inner)


class PlanFirst(_Wrapper):
    """Answers a search for room with the plan's victims for the running call, in the plan's
    order, then with those of the next call (a plan that evicts ahead of each call, such as
    an optimum's, may have counted on them), and asks the wrapped policy only when none of
    them can go. ``follower`` gives the next call's values (``upcoming()``)."""

    name = "plan-first"

    def __init__(self, inner: Policy) -> None:
        super().__init__(inner)
        self.deferred: list[Tensor] = []  # the running call's victims, not yet evicted
        self.follower: Any = None
        self.answered = 0  # victims the plan gave at a search
        self.searches = 0  # allocations for which the wrapped policy searched
        self._request: Storage | None = None  # what the last search was for

    def victims(self, pool: CandidatePool, clock: float, request: Storage) -> list[Storage]:
        deferred = self.deferred
        while deferred:
            s = deferred.pop(0).storage
            if s.slot >= 0:  # a candidate now (resident, neither pinned nor locked)
                self.answered += 1
                return [s]
        if self.follower is not None:
            for t in self.follower.upcoming():
                s = t.storage
                if s.slot >= 0:
                    self.answered += 1
                    return [s]
        if request is not self._request:  # (one allocation may need several victims)
            self._request = request
            self.searches += 1
        return self.inner.victims(pool, clock, request)


_PLAN_FIRST: dict[type, type] = {}


def plan_first(policy: str | Policy) -> PlanFirst:
    """The policy ``policy`` behind :class:`PlanFirst`, with its defaults (allocator,
    in-place mode, what it reads of the pool)."""
    inner = make_policy(policy) if isinstance(policy, str) else policy
    kind = type(inner)
    cls = _PLAN_FIRST.get(kind)
    if cls is None:  # (one class per policy class)
        cls = _PLAN_FIRST[kind] = _subclass(PlanFirst, inner)
    return cls(inner)


class DecisionRecorder:
    """Replay hooks that turn a policy's run into a plan (see :func:`membudget.sim.simulate`
    with ``record_plan=True``): every victim becomes an eviction before the call it was
    picked for. Eager evictions of released values are the engine's, not the plan's. Given a
    ``follower``, the run follows a plan too, and the recording holds the plan's evictions
    and the policy's (a plan that replays the whole run with no search)."""

    def __init__(self, policy: _Recording) -> None:
        self.policy = policy
        self.follower: PlanFollower | None = None

    def before_call(self, k: int) -> None:
        if self.follower is not None:  # (its evictions of call k - 1's leftovers noted first)
            self.follower.before_call(k)
        self.policy.call = k

    def after_call(self, k: int, inputs: list[Tensor], results: list[Tensor]) -> None:
        if self.follower is not None:
            self.follower.after_call(k, inputs, results)
        keys = self.policy.keys
        for j, t in enumerate(results):
            s = t.storage
            if not t.alias and s not in keys:
                keys[s] = (k, j)

    def plan(self, source: str) -> EvictionPlan:
        return EvictionPlan({k: list(v) for k, v in self.policy.before.items() if v}, source)
