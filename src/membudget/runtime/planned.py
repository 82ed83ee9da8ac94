"""Planned mode: record a training step once, plan its evictions in the background, replay.

A training loop runs the same step again and again, so the decisions a dynamic session
takes at every op can be taken once. In ``membudget.budget(..., mode="planned")`` the first
step runs dynamically and is recorded (a trace in memory); when it ends, a *planner* (by
default the cheapest schedule the simulator makes of that trace with the session's policy
or another heuristic, see :func:`simulated_plan`) turns it into an
:class:`~membudget.sim.evictions.EvictionPlan` in a background thread, and the steps after
it follow that plan: the values it lists for their
``k``-th engine call are evicted around that call, with no search (:class:`PlanRun` says
exactly when). The engine's policy still decides whatever the plan leaves open, so the
budget holds whatever happens, and the values are the same whatever is evicted (gradients
stay bitwise those of eager PyTorch).

Call ``k`` is the ``k``-th ``Engine.apply`` of the step, and the ``k``-th CALL event of its
recorded trace: the session calls :meth:`PlanRun.before` just before each ``apply`` and
records the call just after it, with no other ``apply`` in between. Each call is *signed*
with its op and the metadata of its inputs (shape, strides, offset, dtype, device), and a
plan keeps the signatures of the step it was made from. A step follows a plan only while
its calls carry the plan's signatures (one tuple comparison per call); at the first call
that differs (another sequence length, a data-dependent branch) it moves to another plan
that shares all the calls so far and this one, if there is one, else it *diverges*: no plan
is followed for the rest of the step, and the policy decides. Plans are kept per kind of
step (up to ``max_plans``, the least recently used dropped first), so steps that alternate
between a few shapes each find theirs.

What a step records: a step is recorded unless the step before it followed a plan to its
end (a settled loop records nothing), or a plan is being made. A recorded step that
diverged from every plan (or had none) gives a new plan, made from its trace; a recorded
step that followed a plan to its end gives none. So a loop whose first step differs from
the next ones (a stateful optimizer makes its state in the first step) records the second
step too and plans it; from the third step on it follows that plan, and from the fourth
nothing is recorded.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import torch

from membudget.core.records import Tensor
from membudget.errors import MembudgetError, UnknownNameError
from membudget.runtime.replay import (
    HANDED_OVER_OPS,
    HANDED_OVER_PARAMS,
    Closure,
    Key,
    Replay,
    ReplayPlan,
    StepRecorder,
    Tuning,
    held_state,
)
from membudget.sim.evictions import PlanFirst
from membudget.trace.format import CALL, Trace

if TYPE_CHECKING:
    from membudget.core.engine import Engine
    from membudget.runtime.recording import Recording
    from membudget.sim.evictions import EvictionPlan

MODES = ("dynamic", "planned")
#: Seconds the default planner compares schedules for, beyond the policy's own (which it
#: always has): it runs in a thread beside the training loop and shares its interpreter.
PLAN_TIME_LIMIT = 10.0
MAX_PLANS = 8  # plans kept per session (kinds of step), the least recently used dropped

#: ``planner(trace, budget_bytes, policy) -> EvictionPlan``: the evictions for a recorded
#: step (its trace's header also names the session's ``allocator`` and ``inplace`` mode).
Planner = Callable[[Trace, int, str], "EvictionPlan"]

_meta = attrgetter("meta")


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`, else a clear error naming them."""
    if mode not in MODES:
        raise UnknownNameError("budget mode", mode, MODES)
    return mode


def _hold(tuning: Tuning, held: dict[int, int]) -> None:
    """The replanner thread: :meth:`Tuning.hold`; a failure leaves the plan unreplayed."""
    try:
        tuning.hold(held)
    except Exception as e:  # (said as the reason its steps are not replayed)
        tuning.failed, tuning.failure = True, f"choosing its drops again raised {e!r}"


def simulated_plan(trace: Trace, budget_bytes: int, policy: str) -> EvictionPlan:
    """The default planner: the cheapest of the schedules :mod:`membudget.sim.schedules`
    compares (``policy``'s own decisions, the other candidate heuristics', and static
    checkpointing with ``policy`` beyond it), each simulated with the session's allocator
    and in-place mode on the step's own op costs, for :data:`PLAN_TIME_LIMIT` seconds at
    most; the plan's ``source`` names it."""
    from membudget.sim.schedules import cheapest

    head = trace.header
    best = cheapest(trace, budget_bytes, policy, allocator=head.get("allocator"),
                    inplace=head.get("inplace"), time_limit=PLAN_TIME_LIMIT)
    assert best.eviction_plan is not None
    return best.eviction_plan


def own_plan(trace: Trace, budget_bytes: int, policy: str) -> EvictionPlan:
    """The planner once a plan has failed live: the policy's own decisions on the step, as
    the simulator replays them (the step they come from completed under the budget)."""
    from membudget.sim.schedules import run_schedule

    head = trace.header
    r = run_schedule(trace, budget_bytes, policy, policy, allocator=head.get("allocator"),
                     inplace=head.get("inplace"), overhead_limit=None)
    assert r.eviction_plan is not None
    return r.eviction_plan


def distributed() -> bool:
    """Is this process one of several training together (DDP, FSDP)?"""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class StepPlan:
    """A plan for one kind of step: ``table[k]`` is call ``k``'s signature and the values to
    evict before it (``(call, slot)`` keys, or None); ``common[other]`` how many leading
    calls it shares with another plan of the session."""

    __slots__ = ("common", "no_replay", "plan", "table", "tuning")

    def __init__(self, plan: EvictionPlan, signatures: Sequence[tuple],
                 tuning: Tuning | None = None) -> None:
        before = plan.before
        self.plan = plan
        self.table: list[tuple[tuple, tuple | None]] = [
            (sig, tuple(before[k]) if before.get(k) else None)
            for k, sig in enumerate(signatures)]
        self.common: dict[StepPlan, int] = {}
        # how a replay of this kind of step drops (None: it is not replayed, for no_replay)
        self.tuning = None if tuning is None or tuning.failed else tuning
        self.no_replay = ("no set of drops keeps the forecast peak under the budget"
                          if tuning is not None and tuning.failed else "")

    def __len__(self) -> int:
        return len(self.table)

    def shared_calls(self, other: StepPlan) -> int:
        """How many leading calls this plan and ``other`` have in common."""
        n = 0
        for (a, _), (b, _) in zip(self.table, other.table, strict=False):
            if a != b:
                break
            n += 1
        return n


class PlanRun:
    """One step's side of planned mode. The session calls :meth:`before` just before each
    engine call and appends the call's results to ``made`` just after it; :meth:`finish`
    when the step ends. ``sigs`` collects the step's signatures when it is recorded.

    The plan's values for call ``k`` are the victims of the allocations that need room from
    just before call ``k`` to just before call ``k + 1`` (call ``k``'s outputs, the
    recomputations it needs, leaves entering and values read after it), in the plan's order
    (:class:`PlanFirst`), and whichever of them is still in memory when call ``k + 1`` comes
    is evicted then. A dynamic run and its plan thus evict the same values at the same
    points, where evicting them all before call ``k`` could evict a value that call ``k``
    recomputes something from (the dynamic run evicted it after that) and recompute it
    again."""

    __slots__ = ("deferred", "diverged_at", "engine", "evicted", "followed", "k", "made",
                 "plan", "plans", "policy", "sigs", "source", "switches", "table")

    def __init__(self, engine: Engine, plan: StepPlan | None, plans: Sequence[StepPlan],
                 record: bool) -> None:
        self.engine = engine
        self.plans = plans  # the session's, the most recently used last
        policy = engine.policy
        assert isinstance(policy, PlanFirst)
        self.policy = policy
        policy.follower = self
        self.deferred = policy.deferred  # (the same list)
        self.plan = plan
        self.table = None if plan is None else plan.table  # None: nothing to follow (now)
        self.source = None if plan is None else plan.plan.source  # the last plan's maker
        self.followed = plan  # the last plan followed (kept past a divergence)
        self.sigs: list[tuple] | None = [] if record else None
        self.made: list[list[Tensor]] = []  # each call's results, by call index
        self.k = 0  # the index of the next call
        self.evicted = 0  # values the plan evicted between calls
        self.switches = 0  # moves to another plan at a call that differed
        self.diverged_at: int | None = None  # the call at which no plan matched

    @property
    def recorded(self) -> bool:
        return self.sigs is not None

    def before(self, func: object, inputs: Sequence[Tensor]) -> None:
        """Call ``k`` is about to run ``func`` on ``inputs``: evict what the plan evicts by
        now and no allocation took, check the call against the plan, and make its values
        for this call the next victims."""
        k = self.k
        self.k = k + 1
        table, sigs = self.table, self.sigs
        if table is None:
            if sigs is not None:
                sigs.append((func, *map(_meta, inputs)))
            return
        sig = (func, *map(_meta, inputs))
        if sigs is not None:
            sigs.append(sig)
        deferred = self.deferred
        made = self.made
        if k and (last := table[k - 1][1]):  # (table is this call's plan or one sharing k
            evict = self.engine.evict  # calls): call k - 1's victims that no allocation took,
            n = 0  # those it made too, evicted now
            for c, j in last:
                try:
                    t = made[c][j]
                except IndexError:
                    continue
                if t.storage.slot >= 0 and evict(t):
                    n += 1
            self.evicted += n
        deferred.clear()
        try:
            entry = table[k]
        except IndexError:  # (the step is longer than the plan)
            entry = None
        if entry is None or entry[0] != sig:
            entry = self._switch(k, sig)
            if entry is None:
                return
        keys = entry[1]
        if keys is not None:
            for c, j in keys:
                try:
                    deferred.append(made[c][j])
                except IndexError:  # (a planner's key for no value of this step)
                    continue

    def _switch(self, k: int, sig: tuple | None) -> tuple[tuple, tuple | None] | None:
        """Call ``k`` (``sig`` None: the end of the step) differs from the plan: the entry
        of another plan that shares every call so far and this one, which the step
        follows from here (the most recently used, if several); else None, and the step
        follows no plan from here."""
        plan = self.plan
        assert plan is not None
        common = plan.common
        for other in reversed(self.plans):
            if common.get(other, -1) < k:
                continue
            table = other.table
            if sig is None and len(table) == k:
                entry: tuple[tuple, tuple | None] = ((), None)
            elif sig is not None and k < len(table) and table[k][0] == sig:
                entry = table[k]
            else:
                continue
            self.plan, self.table, self.source = other, table, other.plan.source
            self.followed = other
            self.switches += 1
            return entry
        self.diverged_at = k
        self.plan = self.table = None
        self.deferred.clear()
        return None

    def upcoming(self) -> list[Tensor]:
        """The values the plan evicts around the next call, made so far (PlanFirst's
        second choice)."""
        table = self.table
        if table is None or self.k >= len(table):
            return []
        keys = table[self.k][1]  # (self.k: the call after the one running)
        if keys is None:
            return []
        made, out = self.made, []
        for c, j in keys:
            try:
                out.append(made[c][j])
            except IndexError:  # (made by the running call or later)
                continue
        return out

    def finish(self) -> None:
        """The step ended: one that stopped short of its plan diverged from it too."""
        if self.table is not None and self.k != len(self.table):
            self._switch(self.k, None)
        self.made = []
        self.deferred.clear()
        self.policy.follower = None  # (no cycle through the engine)

    @property
    def plan_evictions(self) -> int:
        """The values the plan evicted: before their calls, and at searches for room."""
        return self.evicted + self.policy.answered

    @property
    def followed_calls(self) -> int:
        """The calls that ran under a plan."""
        if self.diverged_at is not None:
            return self.diverged_at
        return self.k if self.plan is not None else 0


class Planning:
    """A planned session's plans across its steps, and the thread that makes a new one."""

    def __init__(self, planner: Planner | None = None, max_plans: int = MAX_PLANS,
                 replay: bool = True) -> None:
        if max_plans < 1:
            raise MembudgetError(f"max_plans must be >= 1, got {max_plans}")
        self.replay = replay  # replay settled steps (runtime.replay)
        self.planner: Planner = planner or simulated_plan
        self.max_plans = max_plans
        self.plans: list[StepPlan] = []  # the least recently used first
        self.start: StepPlan | None = None  # the plan a step starts with
        self.pending: threading.Thread | None = None
        self._made: StepPlan | BaseException | None = None  # the thread's result
        self.settled = False  # the last step followed a plan to its end
        self.plans_made = 0
        self.error: BaseException | None = None  # a planner's failure: planning stops
        # a step that followed a plan ran out of the budget: the plan is dropped, and the
        # default planner makes the next ones of the policy's own decisions only
        self.plans_failed = 0
        self.holding: threading.Thread | None = None  # choosing a replay's drops again

    def begin(self, engine: Engine) -> PlanRun:
        """A step starts: follow the latest plan, and record the step unless the last step
        followed a plan to its end or a plan is being made."""
        self.collect()
        record = self.pending is None and not self.settled and self.error is None
        return PlanRun(engine, self.start, self.plans, record)

    def replay_for_step(self) -> tuple[ReplayPlan, dict[Key, Closure], int] | None:
        """A step starts: the replay plan, the values it drops and its forecast peak, if
        the last step followed a plan to its end and that plan can be replayed, beside the
        optimizers' state alive now. If that is not what its drops were chosen with (Adam
        makes its state after the first step, the one recorded), they are chosen again in
        the background (:meth:`Tuning.hold`), and this step follows the plan with the
        engine."""
        self.collect()
        if self.holding is not None and not self.holding.is_alive():
            self.holding = None
        start = self.start
        if not (self.replay and self.settled and start is not None
                and start.tuning is not None) or distributed():
            return None
        tuning = start.tuning
        if self.holding is not None:  # (still choosing)
            return None
        held = held_state(tuning.plan.params)
        if held != tuning.plan.held:  # (the drops are chosen again, off this thread)
            self.holding = threading.Thread(target=_hold, args=(tuning, held),
                                            name="membudget-replanner", daemon=True)
            self.holding.start()
            return None
        if tuning.failed:
            start.tuning = None
            start.no_replay = (tuning.failure
                               or "no drops fit the budget beside the optimizer's state")
            return None
        return tuning.plan, tuning.closures, tuning.forecast

    def why_not_replayed(self) -> str:
        """Why a step that starts after one that followed its plan to the end is not
        replayed ("" if it is, or if the step before did not)."""
        start = self.start
        if not self.settled or start is None:
            return ""
        if not self.replay:
            return "replay is off (replay=False, or the session records or swaps)"
        if distributed():
            return "the session trains across processes"
        if self.holding is not None:
            return "its drops are being chosen again, beside the optimizer's state"
        return "" if start.tuning is not None else start.no_replay

    def end_replay(self, replay: Replay, failed: bool, ran_out: bool) -> None:
        """A replayed step ended. One that failed, or whose ops differed from the record,
        leaves the session unsettled: the next step runs with the engine (and is recorded
        if no plan covers it), and replays resume after one that follows this plan to its
        end. A step whose parameters are other tensors (a model built again, as when a run
        resumes from a checkpoint) drops every plan, which would keep the old parameters
        alive, so the next one is planned afresh. A plan whose replay had to hand over to
        fit, or ran out of the budget
        (``ran_out``), is not replayed again; the metered peak of one that fitted corrects
        its forecast."""
        start = self.start
        assert start is not None and start.tuning is not None
        if replay.reason == HANDED_OVER_PARAMS:  # (a new model: the plans hold the old one's
            # parameters; the next step is recorded and planned afresh)
            self.plans.clear()
            self.start, self.settled = None, False
            return
        if ran_out:
            start.tuning, start.no_replay = None, "a replay of it ran out of the budget"
        if failed or replay.reason == HANDED_OVER_OPS:
            self.settled = False
            return
        start.tuning.report(replay.handed_over_at is None, replay.peak_bytes)
        if start.tuning.failed:  # (its steps follow the plan with the engine)
            start.tuning, start.no_replay = None, f"a replay of it handed over: {replay.reason}"

    def end(self, run: PlanRun, recording: Recording | None, header: dict[str, Any],
            failed: bool, recorder: StepRecorder | None, ran_out: bool) -> None:
        """A step ended: remember the plan it ended on; plan a recorded step that no plan
        covered, in the background. A step that ran out of the budget (``ran_out``) after
        following a plan drops that plan, so the next step runs dynamically and is recorded
        (else every step would follow it into the same failure)."""
        run.finish()
        if failed:  # (its trace is cut short: not a step to plan)
            self.settled = False
            if ran_out and run.followed is not None:
                self._drop(run.followed)
        else:
            self.settled = run.plan is not None
            if run.plan is not None:
                self._use(run.plan)
            elif recording is not None and run.sigs is not None and self.pending is None:
                self._made = None
                self.pending = threading.Thread(
                    target=self._make, args=(recording, run.sigs, header, recorder),
                    name="membudget-planner", daemon=True)
                self.pending.start()
                return  # (the planner closes the recorder)
        if recorder is not None:
            recorder.close()

    def _make(self, recording: Recording, sigs: list[tuple], header: dict[str, Any],
              recorder: StepRecorder | None) -> None:
        """The planner thread: the plan of one recorded step (or the error making it)."""
        try:
            trace = recording.trace(header)
            calls = sum(1 for ev in trace.events if ev[0] == CALL)
            if calls != len(sigs):  # (the session signs every call it records)
                raise MembudgetError(f"the step made {len(sigs)} engine calls but its "
                                     f"trace has {calls}")
            planner = (own_plan if self.plans_failed and self.planner is simulated_plan
                       else self.planner)
            plan = planner(trace, header["budget_bytes"], header["policy"])
            tuning = (Tuning(ReplayPlan(recorder), header["budget_bytes"], recorder.held)
                      if recorder is not None else None)
            self._made = StepPlan(plan, sigs, tuning)
        except BaseException as e:  # handed to the session's thread, which warns
            self._made = e
        finally:
            if recorder is not None:
                recorder.close()

    def collect(self) -> None:
        """Take the plan made in the background, if it is ready."""
        thread = self.pending
        if thread is None or thread.is_alive():
            return
        self.pending = None
        made, self._made = self._made, None
        if isinstance(made, BaseException):
            self.error = made
            warnings.warn(f"planned mode: making a plan failed ({made!r}); the session's "
                          "steps run dynamically from now on", RuntimeWarning, stacklevel=3)
            return
        if made is not None:
            self._add(made)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the plan being made, and for a replay's drops being chosen again (at
        most ``timeout`` seconds in all); whether neither is any more."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in (self.pending, self.holding):
            if thread is not None:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.collect()
        return self.pending is None and (self.holding is None or not self.holding.is_alive())

    def _add(self, plan: StepPlan) -> None:
        for other in self.plans:
            n = plan.shared_calls(other)
            plan.common[other] = other.common[plan] = n
        self.plans.append(plan)
        self.plans_made += 1
        while len(self.plans) > self.max_plans:
            old = self.plans.pop(0)
            for other in self.plans:
                other.common.pop(old, None)
        self.start = plan

    def _drop(self, plan: StepPlan) -> None:
        """``plan`` led a step out of the budget: it is followed no more."""
        self.plans_failed += 1
        if plan in self.plans:
            self.plans.remove(plan)
        for other in self.plans:
            other.common.pop(plan, None)
        if self.start is plan:
            self.start = self.plans[-1] if self.plans else None

    def _use(self, plan: StepPlan) -> None:
        """``plan`` was followed to the end of a step: the next step starts with it."""
        self.start = plan
        if plan in self.plans and self.plans[-1] is not plan:
            self.plans.remove(plan)
            self.plans.append(plan)


__all__ = ["MODES", "PlanRun", "Planner", "Planning", "StepPlan", "check_mode",
           "simulated_plan"]
