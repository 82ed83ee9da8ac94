"""``membudget.budget``: run unmodified PyTorch code with its tensors under a memory budget.

Inside the context a dispatch mode sees every aten op, forward and backward, of its thread.
Plain tensors that reach an op enter the engine as pinned leaves (``runtime.leaves``); every
op output becomes a :class:`RematTensor` whose data the engine may evict and recompute, except
what the backward pass makes, which it pins (``runtime.gradients``). The
engine learns what a new op will make before it runs (``runtime.sizing``), makes room for it
within the budget, then runs it; ops that write their arguments are versions or pinned writes
(``runtime.writes``). When the session ends, what the program still holds is handed back as
plain tensors (``runtime.handout``), after an error too.

A session is one thread's, and sessions do not nest: entering one while another is active in
the same thread is refused, since every op would otherwise be handled twice.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Callable
from contextlib import ContextDecorator
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
    is_traceable_wrapper_subclass,
)

from membudget.core.engine import Engine
from membudget.core.policies import make_policy, resolve_policy
from membudget.core.records import Tensor
from membudget.errors import BudgetRaisedWarning, BudgetTooSmallError, MembudgetError, OutOfBudget
from membudget.outputs import check_output
from membudget.runtime import copies, ddp
from membudget.runtime.call import SLOTS, OpCall, OpTimer, slot
from membudget.runtime.classify import INFO, op_info
from membudget.runtime.device_memory import DeviceMeter
from membudget.runtime.executor import TorchExecutor, check_name
from membudget.runtime.flat import NO_KWARGS, SCALARS, flatten
from membudget.runtime.gradients import in_backward, pin_made
from membudget.runtime.handout import hand_out, hold
from membudget.runtime.leaves import Leaves
from membudget.runtime.planned import (
    MAX_PLANS,
    Planner,
    Planning,
    PlanRun,
    check_mode,
)
from membudget.runtime.recording import NotRecording, Recording
from membudget.runtime.references import References
from membudget.runtime.replay import Replay, StepRecorder
from membudget.runtime.sizing import link_prices, model_seconds, move_prices
from membudget.runtime.stats import SessionStats
from membudget.runtime.tensor import Ref, RematTensor, value_of, wrap
from membudget.runtime.writes import write
from membudget.sim.evictions import plan_first
from membudget.sim.simulate import check_config
from membudget.units import parse_bytes


class Session(TorchDispatchMode, ContextDecorator):
    """A memory budget for the code inside ``with``; see :func:`membudget.budget`.

    The session is itself the dispatch mode that routes every aten op to it, so no frame
    stands between the dispatcher and ``__torch_dispatch__``. Its frames are entered only
    from the dispatcher, never traced by Dynamo, so it opts out of the Dynamo-disabling
    wrapper that torch puts around ``__torch_dispatch__`` by default (two frames per op)."""

    def __init__(self, budget: int | str, policy: str = "default", allocator: str | None = None,
                 inplace: str | None = None, record: bool | str | Path | None = None,
                 cost: OpTimer | str = "model", determinism_check: str = "default",
                 mode: str = "dynamic", planner: Planner | None = None,
                 max_plans: int = MAX_PLANS, swap: str = "off", replay: bool = True) -> None:
        super().__init__()
        try:
            self.budget_bytes = parse_bytes(budget)
        except ValueError as e:
            raise MembudgetError(f"budget: {e}") from None
        if self.budget_bytes <= 0:
            raise MembudgetError(f"a budget must be > 0 bytes, got {budget!r}")
        if isinstance(record, (str, Path)):  # refused now, not after the step has run
            check_output(record)
        check_name(determinism_check)  # refused here, before the session is entered
        self.mode = check_mode(mode)
        # policy, allocator, in-place and swap modes refused here, before it is entered
        check_config(policy, allocator, inplace, swap=swap)
        if make_policy(policy).needs_future:
            raise MembudgetError(f"policy {policy!r} needs to know when each value will be "
                                 "read next, which only a replay of a recorded step knows: "
                                 "use it in `membudget simulate`; mode='planned' already "
                                 "compares its schedule with the others'")
        if swap != "off" and mode == "planned":
            raise NotImplementedError("planned sessions follow plans of drops only: use "
                                      "mode='dynamic' with swap, or swap='off'")
        self.swap = swap
        self.link = link_prices() if swap != "off" else (0.0, 0.0)
        self.move = move_prices()
        # planned mode: the plans across steps (runtime.planned), and this step's run
        # (no replay where the session records, swaps, or trains across processes: their
        # traces, transfers and collectives are the engine's)
        self.planning = (Planning(planner, max_plans,
                                  replay=replay and not record and swap == "off")
                         if mode == "planned" else None)
        self.plan_run: PlanRun | None = None
        self.replay: Replay | None = None  # this step's replay, until it hands over
        self._replayed: Replay | None = None
        self._no_replay = ""  # why this planned step is not replayed (stats.replay_reason)
        self._recorder: StepRecorder | None = None
        self._saved_hooks: Any = None
        self.policy, self.allocator, self.inplace = resolve_policy(policy), allocator, inplace
        self.record = record
        self.cost = cost_timer(cost)
        self.determinism_check = determinism_check
        self.recording = _new_recording(record)
        self.engine: Engine | None = None
        self.stats = SessionStats(self.budget_bytes)
        self.thread: int | None = None  # the thread it is active in
        self.warned_thread = False
        # the optimizers that stepped in it: their state outlives a failed step
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._optimizer_hook: Any = None

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> Session:
        if torch.compiler.is_compiling():
            raise MembudgetError("a membudget session cannot be entered inside code that "
                                 "torch.compile traces; enter it around the compiled call")
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, Session):
                raise MembudgetError(
                    "membudget sessions do not nest: this thread is already inside one "
                    f"(budget {mode.budget_bytes:,} B); end it before entering another, or "
                    "run the inner code in the outer session")
        # Meta kernels written in Python import torch._dynamo when one first runs; done
        # inside a session, that import leaves reference cycles through the frames of the
        # op being sized, which would keep its tensors alive until the session ends (the
        # cyclic collector is paused then), so it is done here, once per process.
        from torch import _dynamo  # noqa: F401
        fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
        self.executor = TorchExecutor(self.cost, check=self.determinism_check, fake=fake,
                                      link=self.link, move=self.move)
        self.executor.mode = self
        policy = self.policy if self.planning is None else plan_first(self.policy)
        self.engine = Engine(self.budget_bytes, policy, self.allocator, self.executor,
                             inplace=self.inplace, swap=self.swap)
        self.allocator_name = self.engine.allocator.name
        self.inplace_name = self.engine.inplace
        planning = self.planning
        replayed = None if planning is None else planning.replay_for_step()
        self._no_replay = "" if planning is None or replayed else planning.why_not_replayed()
        run = self.plan_run = (None if planning is None or replayed is not None
                               else planning.begin(self.engine))
        self.recording = _new_recording(self.record or (run is not None and run.recorded))
        self.refs = References(self.engine, self.recording)
        self.leaves = Leaves(self)
        self._device = DeviceMeter()
        self.thread, self.warned_thread = threading.get_ident(), False
        self.optimizers = weakref.WeakSet()
        self._optimizer_hook = register_optimizer_step_pre_hook(self._stepping)
        ddp.install(Session)
        copies.install(Session)
        # The engine's records live as long as a value may need them and are freed by
        # reference counting (the engine cuts their cycles as it frees them), so the cyclic
        # collector would only walk the live ones again and again, about 2 µs per op: it is
        # paused while the session runs. Cycles the program makes meanwhile are collected
        # after it (or by an explicit gc.collect()).
        # Compiled code runs its kernels where the session cannot see them, outside the
        # budget: while the session is active, torch.compile'd functions run eagerly.
        self._stance = torch.compiler.set_stance("force_eager")
        TorchDispatchMode.__enter__(self)
        if replayed is not None:  # a settled step, run without the engine (runtime.replay)
            self.replay = self._replayed = Replay(self, *replayed)
            self._saved_hooks = self.replay.hooks()
        elif run is not None and run.recorded and planning is not None and planning.replay:
            self._recorder = StepRecorder()  # (on top: it sees the program's own ops)
            self._recorder.__enter__()
            self._saved_hooks = self._recorder.hooks()
        elif run is not None and planning is not None and planning.replay:
            # hooks of no effect but the recorder's: with saved-tensor hooks autograd adds
            # ops of its own (detaching the outputs it saves), so every planned step has
            # them, as a recorded or replayed one does, and runs the same ops
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(_same, _same)
        if self._saved_hooks is not None:
            self._saved_hooks.__enter__()
        self._gc_was_enabled = gc.isenabled()  # set last: nothing after it can fail
        gc.disable()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)
        self.replay = None
        TorchDispatchMode.__exit__(self, None, None, None)
        eng = self.engine
        assert eng is not None
        completed = False
        ran_out = exc_type is not None and issubclass(exc_type, OutOfBudget)
        handed = (0, 0)
        try:
            handed = hand_out(self, exc_type is not None)
            completed = exc_type is None
        finally:
            self._close()
            if self.plan_run is not None:
                self._end_planned_step(not completed, recorder, ran_out)
            elif self._replayed is not None:
                self._end_replayed_step(not completed, ran_out)
        if self.stats.beyond_budget_bytes and exc_type is None:  # (else the error says)
            _warn_raised(self.stats, *handed)
        if exc_type is None and isinstance(self.record, (str, Path)):
            self.trace(self.record)

    def _stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Note an optimizer stepping in this session's thread (a global pre-step hook), and
        adopt its state before it steps."""
        if threading.get_ident() == self.thread:
            self.optimizers.add(optimizer)
            self.leaves.adopt_optimizer(optimizer)

    def _end_planned_step(self, failed: bool, recorder: StepRecorder | None,
                          ran_out: bool) -> None:
        """Hand the step to the session's planning, and its plan figures to the stats."""
        run, self.plan_run = self.plan_run, None
        assert run is not None and self.planning is not None
        recording = self.recording if isinstance(self.recording, Recording) else None
        self.planning.end(run, recording, self._header(), failed, recorder, ran_out)
        st = self.stats
        st.plan_recorded = run.recorded
        st.plan_followed_calls = run.followed_calls
        st.plan_evictions = run.plan_evictions
        st.searches = run.policy.searches
        st.plan_switches = run.switches
        st.plan_divergences = int(run.diverged_at is not None)
        st.plan_diverged_at = run.diverged_at
        st.plan_source = run.source
        st.replay_reason = self._no_replay

    def _end_replayed_step(self, failed: bool, ran_out: bool) -> None:
        """Hand a replayed step to the session's planning, and its figures to the stats."""
        replay, self._replayed = self._replayed, None
        assert replay is not None and self.planning is not None
        self.planning.end_replay(replay, failed, ran_out)
        st = self.stats
        st.replayed_ops = replay.k
        st.replay_dropped = len(replay.closures)
        st.replay_recomputed_ops = replay.recomputed
        st.replay_handed_over_at = replay.handed_over_at
        st.replay_reason = replay.reason
        st.replay_forecast_bytes = replay.forecast
        st.peak_bytes = max(st.peak_bytes, replay.peak_bytes)
        replay.close()

    def wait_for_plan(self, timeout: float | None = None) -> bool:
        """In planned mode, wait for the plan being made in the background, and for a
        replay's drops being chosen again (at most ``timeout`` seconds), so that the next
        step follows or replays it; whether none is being made any more. Steps do not need
        to wait: until a plan is ready they run dynamically."""
        if self.planning is None:
            raise MembudgetError('wait_for_plan() is for a session made with mode="planned"')
        return self.planning.wait(timeout)

    @property
    def plans(self) -> int:
        """How many plans a planned session holds (kinds of step it follows)."""
        return 0 if self.planning is None else len(self.planning.plans)

    def _close(self) -> None:
        eng = self.engine
        assert eng is not None
        ex = self.executor
        self.stats = SessionStats.of(self.budget_bytes, eng, ex.run_ns, ex.remat_ns, ex.unsized,
                                     self._device.peak(), ex.swap_ns)
        self.leaves.close()
        self._optimizer_hook.remove()
        self.engine = None
        self.executor.values.clear()  # the data goes now, not when a GC pass finds the engine
        self.executor = TorchExecutor()
        self.thread = None
        self._stance.__exit__(None, None, None)  # the compiler's stance as it was
        if self._gc_was_enabled:
            gc.enable()

    def trace(self, path: str | Path, **header: Any) -> Path:
        """Write this session's run as a trace the simulator can replay (the session must
        record: ``record=True`` or a path); ``header`` adds to or overrides the trace header's
        fields (model, batch, ...)."""
        if not isinstance(self.recording, Recording):
            raise MembudgetError("this session did not record its run; pass record=True (or "
                                 "record=PATH, written when it ends) to membudget.budget")
        return self.recording.write(path, {**self._header(), **header})

    def _header(self) -> dict[str, Any]:
        """The header of this session's trace."""
        return {"model": "live", "source": "membudget.budget", "cost_unit": "ns",
                "cost_source": "measured" if self.cost is None else "predicted",
                "policy": self.policy,
                "allocator": getattr(self, "allocator_name", self.allocator),
                "inplace": getattr(self, "inplace_name", self.inplace),
                "budget_bytes": self.budget_bytes, "swap": self.swap,
                # what its moves were weighed at against evictions
                "move_price": {"ns_per_byte": self.move[0], "launch_ns": self.move[1]},
                # what its host copies were priced at: copied in turn, not overlapped, and
                # never of pinned storages (the program owns its parameters)
                **({"host_link": {"ns_per_byte": self.link[0], "launch_ns": self.link[1],
                                  "overlap": False, "pinned": False}}
                   if self.swap != "off" else {})}

    # ------------------------------------------------------------------ the program's side
    def adopt(self, tensors: Any) -> None:
        """Count these plain tensors toward the budget from now on, as pinned leaves: state
        the program holds for the whole step (parameters, buffers, optimizer state) that no
        op has touched yet."""
        if self.engine is None:
            raise MembudgetError("adopt() needs an active session (inside `with`)")
        self.guarded(lambda: self.leaves.adopt(tensors))

    def phase(self, name: str) -> None:
        """Mark what the program computes from here on ("forward", "backward", "optimizer"):
        a trace event, and the kind the engine gives new storages (as the replay does)."""
        eng = self.engine
        if eng is None:
            raise MembudgetError("phase() needs an active session (inside `with`)")
        self.recording.phase(name)
        eng.output_kind = "gradient" if name == "backward" else "activation"

    def read(self, handle: Tensor) -> torch.Tensor:
        """The value of ``handle``, recomputed if it was evicted."""
        eng = self.engine
        if eng is None:
            raise MembudgetError("this tensor belonged to a membudget session that ended; "
                                 "its value is gone")

        def get() -> torch.Tensor:
            self.recording.get(handle)  # recorded where nothing else can slip in before it
            return eng.get_value(handle)  # type: ignore[return-value]

        with _below(self):  # recomputations run the real ops, not this mode
            return self.guarded(get)

    def keep(self, handle: Tensor) -> None:
        """Make ``handle`` ready for a reader outside the engine that holds on to its value
        (pickling: ``torch.save`` holds every storage it saves until it writes the file):
        materialized and pinned, so the engine counts what the reader holds, with the budget
        raised only if it cannot (``stats.beyond_budget_bytes``), so that a save never fails
        half-written."""
        with _below(self):
            hold(self, handle)

    def evict(self, t: RematTensor) -> bool:
        """Drop the data of ``t`` now, as the policy would (False if it cannot be evicted)."""
        if self.engine is None or type(t) is not RematTensor or t._ref.session is not self:
            return False
        return self.engine.evict(t._ref.handle)

    def release(self, handle: Tensor) -> None:
        """A wrapper died: drop its reference (after the current op)."""
        self.refs.release(handle)

    def pin(self, handle: Tensor, overwrite: bool = False) -> None:
        """Pin ``handle`` (``Engine.pin``), in the recording too (engine work: run it
        guarded, or from within an op)."""
        self.recording.pin(handle, overwrite)
        self.engine.pin(handle, overwrite)  # type: ignore[union-attr]

    def strided_view(self, base: Tensor, shape: Any, stride: Any, offset: int) -> Tensor:
        """A view of the engine tensor ``base`` by ``as_strided``, applied and recorded like
        any op (another view of a leaf's storage; a view taken again of a new version)."""
        leaves, spec = flatten((slot(0), list(shape), list(stride), offset), {})
        call = OpCall(torch.ops.aten.as_strided.default, leaves, spec)
        (h,) = self.apply(call, [base])
        call.returned = None
        self.recording.call(call, [base], [h], call.cost)
        return h

    def apply(self, call: OpCall, inputs: list[Tensor], out_bytes: Any = None,
              out_alias: Any = None, cost: float = 0.0, mutated: Any = ()) -> list[Tensor]:
        """``Engine.apply``, as every call of the step goes to it: in planned mode the plan
        sees each call just before it runs and its results just after (``__torch_dispatch__``
        does the same, inlined)."""
        run = self.plan_run
        if run is not None:
            run.before(call.func, inputs)
        handles = self.engine.apply(  # type: ignore[union-attr]
            call, inputs, out_bytes, out_alias, cost, mutated)
        if run is not None:
            run.made.append(handles)
        return handles

    def guarded(self, fn: Callable[[], Any]) -> Any:
        """Run engine work; an allocation that cannot fit becomes BudgetTooSmallError."""
        refs = self.refs
        busy, refs.busy = refs.busy, True
        try:
            return fn()
        except OutOfBudget as e:
            raise BudgetTooSmallError.from_oob(e) from None
        finally:
            refs.busy = busy
            if not busy:
                refs.drain()

    # ------------------------------------------------------------------ ops
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        """Run one aten op through the engine (every op comes here, so it is written flat)."""
        replay = self.replay
        if replay is not None:
            return replay.dispatch(func, types, args, kwargs)
        info = INFO.get(id(func))
        if info is None:
            info = op_info(func)
        if info.passthrough:
            return func(*args, **(kwargs or {}))
        refs = self.refs
        busy, refs.busy = refs.busy, True
        try:
            leaves, spec = flatten(args, kwargs or NO_KWARGS)
            inputs: list[Tensor] = []
            for k, x in enumerate(leaves):
                if type(x) is RematTensor:  # tested first: most inputs are (and it is cheaper)
                    ref = x._ref
                    h = (ref.handle if ref.session is self
                         else self.leaves.handle(self._outside(func, x)))
                elif type(x) in SCALARS or not isinstance(x, torch.Tensor):
                    continue  # (isinstance goes through torch's metaclass: tested last)
                elif is_traceable_wrapper_subclass(x):  # a DTensor: it runs its own ops here
                    return NotImplemented
                else:
                    h = self.leaves.handle(x)
                try:
                    leaves[k] = SLOTS[len(inputs)]
                except IndexError:  # more tensor arguments than placeholders made so far
                    leaves[k] = slot(len(inputs))
                inputs.append(h)
            call = OpCall(func, leaves, spec, info.random)
            if info.writes:
                return write(self, call, info, inputs, args, kwargs or NO_KWARGS)
            run = self.plan_run  # planned mode (as in apply())
            if run is not None:
                run.before(func, inputs)
            handles = self.engine.apply(call, inputs, None)  # type: ignore[union-attr]
            if run is not None:
                run.made.append(handles)
            if self.executor.misfits:
                self.resize()
            rec = self.recording
            if rec.active:  # (the hot path skips the calls a NotRecording would drop)
                rec.call(call, inputs, handles, call.cost)
            if in_backward():
                pin_made(self, handles)
            if call.returned_kind is not None or not handles:
                return self.returned(call, handles)
            # returned() for the commonest result, one tensor
            value = call.returned[0]  # type: ignore[index]
            call.returned = None  # the op's record must not keep the first result alive
            h = handles[0]
            w = wrap(value, Ref(self, h))
            refs.held[h] = weakref.ref(w)
            return w
        except OutOfBudget as e:
            raise BudgetTooSmallError.from_oob(e) from None
        finally:
            refs.busy = busy
            if not busy and refs.pending:
                refs.drain()

    def returned(self, call: OpCall, handles: list[Tensor]) -> Any:
        """The op's result with each recorded tensor replaced by its wrapper."""
        flat = call.returned
        call.returned = None  # the op's record must not keep the first result alive
        assert flat is not None
        held = self.refs.held
        for k, h in zip(call.outputs, handles, strict=True):
            w = flat[k] = wrap(flat[k], Ref(self, h))
            held[h] = weakref.ref(w)
        kind = call.returned_kind
        return flat[0] if kind is None else kind(flat)

    def resize(self) -> None:
        """Account for the real size of outputs that a meta kernel sized wrongly."""
        misfits = self.executor.misfits
        while misfits:
            t, nbytes = misfits.pop()
            self.engine.resize(t, nbytes)  # type: ignore[union-attr]

    def _outside(self, func: Any, x: RematTensor) -> torch.Tensor:
        """The value of a wrapper from a session that ended (a plain tensor here); a wrapper
        of another active session cannot be shared."""
        ref = x._ref
        if ref.session is not None and ref.session.engine is not None:
            raise MembudgetError(f"{func} got a tensor of a membudget session active in "
                                 "another thread; sessions cannot share tensors")
        return value_of(x)


def _warn_raised(stats: SessionStats, recomputed: int, recomputed_bytes: int) -> None:
    """Say that the budget was raised to hold what the program held at once, and why."""
    why = (f"; {recomputed:,} values ({recomputed_bytes:,} B) evicted in the run were still "
           "referenced when it ended and were recomputed to hand them back. If the program "
           "does not hold them, an autograd graph may: one kept by retain_graph=True under "
           "saved-tensor hooks that return the tensor they save is a reference cycle PyTorch "
           "never frees (eager PyTorch keeps it too)" if recomputed else "")
    warnings.warn(f"membudget: the budget of {stats.budget_bytes:,} B was raised by "
                  f"{stats.beyond_budget_bytes:,} B to hold the values the program held at "
                  f"once (stats.beyond_budget_bytes){why}. Let go of what is not needed "
                  "before the session ends, or give it a larger budget.",
                  BudgetRaisedWarning, stacklevel=3)


def _same(x: Any) -> Any:
    """What a planned step's autograd saves: as the recorder does, another wrapper of a
    session's value (the same program reference), else ``x``. Under saved-tensor hooks,
    saving the wrapper itself makes a reference cycle through autograd's C++ nodes for an
    output its own node saves (tanh, softmax), which nothing frees while a graph is kept: a
    Reformer's planned steps (each layer's backward retains its graph) held 2.3x the budget."""
    return wrap(x, x._ref) if type(x) is RematTensor else x


class _below:
    """Run with the modes from ``session`` up popped (recomputations run the real ops on the
    modes below it, such as a meter or a FakeTensorMode), then push them back."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.popped: list[TorchDispatchMode] = []

    def __enter__(self) -> None:
        stack = _get_current_dispatch_mode_stack()
        if self.session not in stack:
            return
        while True:
            mode = _pop_mode()
            self.popped.append(mode)
            if mode is self.session:
                return

    def __exit__(self, *exc: object) -> None:
        while self.popped:
            _push_mode(self.popped.pop())


COSTS = ("model", "measured")


def cost_timer(cost: OpTimer | str) -> OpTimer | None:
    """The executor's op timer for a session's ``cost`` (None: measured runs)."""
    if callable(cost):
        return cost
    if cost not in COSTS:
        raise MembudgetError(f"unknown cost {cost!r}: give one of {', '.join(COSTS)} or a "
                             "function (func, args, kwargs, out) -> seconds")
    return model_seconds if cost == "model" else None


def _new_recording(record: bool | str | Path | None) -> Recording | NotRecording:
    """A session records its run only when asked to: the records of every op would
    otherwise pile up for as long as the session object lives."""
    return Recording() if record else NotRecording()


def budget(nbytes: int | str, policy: str = "default", *, allocator: str | None = None,
           inplace: str | None = None, record: bool | str | Path | None = None,
           cost: OpTimer | str = "model", determinism_check: str = "default",
           mode: str = "dynamic", planner: Planner | None = None,
           max_plans: int = MAX_PLANS, swap: str = "off", replay: bool = True) -> Session:
    """A memory budget for PyTorch code: ``with membudget.budget("1.5 GiB"):`` (or as a
    decorator). Tensors made inside are evicted and recomputed as needed to stay within it.
    ``policy``, ``allocator`` and ``inplace`` take the simulator's names; "default" is
    :data:`membudget.core.policies.DEFAULT_POLICY`. ``cost`` prices the ops the policy
    weighs: "model" (the default) the cost model on this device kind's spec, the same on
    every run, so that the same program and budget make the same evictions every time;
    "measured" each op signature's first measured run in this process (closer to the
    truth, but it varies from run to run); or a function ``(func, args, kwargs, out) ->
    seconds``. ``record=True``
    keeps the run so that ``session.trace(path)`` can write it as a trace; ``record=path``
    also writes it there when the session ends. ``determinism_check`` says what a
    recomputation is checked against, as in ``torch.utils.checkpoint``: "default" (each
    output's shape, strides, offset, dtype and device), "checksum" (their bytes too: slow, for
    debugging) or "none".

    ``swap`` says where evicted values go: "off" (dropped, recomputed when needed), "only"
    (copied to host memory and back, never recomputed) or "both" (to host memory where the
    copies cost less than recomputing the value, else dropped). Copies are priced on this
    device kind's host link (an A100's PCIe 4.0 x16 for an accelerator; on a CPU, a copy
    within memory) and made synchronously; the values come back bitwise equal.

    ``mode="planned"``: enter the same session once per step (``with session:`` in the
    loop, or as a decorator of the step function). The first step runs dynamically and is
    recorded; a plan of its evictions is made from it in a background thread
    (``planner(trace, budget_bytes, policy) -> EvictionPlan``, by default the cheapest
    schedule the simulator makes of the step with ``policy`` or another heuristic, which
    ``stats.plan_source`` names), and the steps after it follow the plan, with no search,
    while their ops are the plan's; a step whose ops differ falls back to the policy from
    there and is planned in turn (up to ``max_plans`` kinds of step). See
    ``runtime.planned``. With ``replay`` (the default; off when the session records or
    swaps, and across processes), once a step follows a plan to its end the steps after it
    are replayed: their ops run as in eager PyTorch, saved activations are dropped and
    recomputed as in checkpointing (which ones, by a forecast of the step's memory), memory
    is metered, and the engine takes over a step before any op that differs from the record
    or would not fit (``runtime.replay``)."""
    return Session(nbytes, policy, allocator, inplace, record, cost,
                   determinism_check=determinism_check, mode=mode, planner=planner,
                   max_plans=max_plans, swap=swap, replay=replay)


__all__ = ["Session", "SessionStats", "budget"]
