"""``membudget.budget``: run unmodified PyTorch code with its tensors under a memory budget.

Inside the context a dispatch mode sees every aten op, forward and backward. Plain tensors
that reach an op (parameters, buffers, inputs) enter the engine as pinned leaves; every op
output becomes a :class:`RematTensor` whose data the engine may evict and recompute. An op
runs once, on materialized inputs, to learn its outputs; then the engine records it (making
room first) and keeps its result. What an op does to memory decides how it is recorded:

- a view shares its input's storage and is recomputed by re-running the view op;
- an op writing only tensors the engine owns, and returning only those, makes new versions
  (recomputable in-place or copy-on-write, by the engine's ``inplace`` mode);
- a random op runs again with the RNG state it first drew from;
- anything else that writes (memory the engine does not own, such as BatchNorm running
  statistics, or a storage other live views share) runs as it is and its outputs are pinned,
  never recomputed; what it overwrites, and every value computed from the old contents, is
  materialized and pinned before it runs, since none of them could be recomputed after it.
  Training-mode batch norm is the exception for its outputs: its statistics update is a side
  effect no output depends on, so it is recomputed with the statistics left out.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from contextlib import ContextDecorator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode,
)

from membudget.core.engine import Engine
from membudget.core.records import Tensor
from membudget.errors import BudgetTooSmallError, MembudgetError, OutOfBudget
from membudget.runtime import ddp
from membudget.runtime.classify import INFO, OpInfo, op_info
from membudget.runtime.device_memory import DeviceMeter
from membudget.runtime.executor import SLOTS, OpCall, OpTimer, Slot, TorchExecutor, slot
from membudget.runtime.flat import NO_KWARGS, SCALARS, flatten
from membudget.runtime.recording import NotRecording, Recording
from membudget.runtime.tensor import Ref, RematTensor, value_of, wrap
from membudget.units import parse_bytes

aten = torch.ops.aten


@dataclass
class SessionStats:
    """What a session did. ``op_seconds`` is the time the program's ops took to run (each
    measured on its first run, or predicted by the session's ``cost`` function), and
    ``remat_seconds`` the time spent recomputing, estimated from those first-run times."""

    budget_bytes: int
    peak_bytes: int = 0
    evictions: int = 0
    eager_evictions: int = 0
    remat_ops: int = 0
    ops: int = 0
    remat_seconds: float = 0.0
    op_seconds: float = 0.0
    search_us: dict[str, float] = field(default_factory=dict)
    fragmentation: dict[str, float] = field(default_factory=dict)
    # on a CUDA (or other accelerator) device: the most bytes its caching allocator held
    # beyond what it held when the session began, to cross-check peak_bytes (DeviceMeter)
    device_peak_bytes: int | None = None


class Session(TorchDispatchMode, ContextDecorator):
    """A memory budget for the code inside ``with``; see :func:`membudget.budget`.

    The session is itself the dispatch mode that routes every aten op to it, so no frame
    stands between the dispatcher and ``__torch_dispatch__``. Its frames are entered only
    from the dispatcher, never traced by Dynamo, so it opts out of the Dynamo-disabling
    wrapper that torch puts around ``__torch_dispatch__`` by default (two frames per op)."""

    def __init__(self, budget: int | str, policy: str = "dtr-eq", allocator: str | None = None,
                 inplace: str | None = None, record: bool | str | Path | None = None,
                 cost: OpTimer | None = None) -> None:
        super().__init__()
        self.budget_bytes = parse_bytes(budget) if isinstance(budget, str) else int(budget)
        if self.budget_bytes <= 0:
            raise MembudgetError(f"a budget must be > 0 bytes, got {budget!r}")
        self.policy, self.allocator, self.inplace = policy, allocator, inplace
        self.record = record
        self.cost = cost
        self.recording = _new_recording(record)
        self.engine: Engine | None = None
        self.stats = SessionStats(self.budget_bytes)
        self._active = False  # the mode is pushed
        # the engine tensors behind the program's live wrappers, each with its wrapper's Ref
        self._held: dict[Tensor, weakref.ref[Ref]] = {}

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> Session:
        if self.engine is not None:
            raise MembudgetError("this budget session is already active; make a new one")
        self.executor = TorchExecutor(self.cost)
        self.engine = Engine(self.budget_bytes, self.policy, self.allocator, self.executor,
                             inplace=self.inplace)
        self.allocator_name = self.engine.allocator.name
        self._leaves: dict[tuple, tuple[torch.Tensor, Tensor]] = {}
        self._bases: dict[int, Tensor] = {}  # real storage -> its leaf
        self._held = {}
        self._pending: list[Tensor] = []
        self._busy = False
        self.recording = _new_recording(self.record)
        self._device = DeviceMeter()
        ddp.install(Session)
        self._adopted: set[int] = set()  # ids of the modules whose state was adopted
        self._module_hook = register_module_forward_pre_hook(self._adopt_module)
        # The engine's records live as long as a value may need them and are freed by
        # reference counting (the engine cuts their cycles as it frees them), so the cyclic
        # collector would only walk the live ones again and again, about 2 µs per op: it is
        # paused while the session runs. Cycles the program makes meanwhile are collected
        # after it (or by an explicit gc.collect()).
        TorchDispatchMode.__enter__(self)
        self._active = True
        self._gc_was_enabled = gc.isenabled()  # set last: nothing after it can fail
        gc.disable()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        active, self._active = self._active, False
        try:
            if exc_type is None:
                self._hand_out()
        finally:
            if active:
                TorchDispatchMode.__exit__(self, None, None, None)
            self._close()
        if exc_type is None and isinstance(self.record, (str, Path)):
            self.trace(self.record)

    def trace(self, path: str | Path, **header: Any) -> Path:
        """Write this session's run as a trace the simulator can replay (the session must
        record: ``record=True`` or a path); ``header`` adds to or overrides the trace header's
        fields (model, batch, ...)."""
        if not isinstance(self.recording, Recording):
            raise MembudgetError("this session did not record its run; pass record=True (or "
                                 "record=PATH, written when it ends) to membudget.budget")
        head = {"model": "live", "source": "membudget.budget", "cost_unit": "ns",
                "cost_source": "measured" if self.cost is None else "predicted",
                "policy": self.policy,
                "allocator": getattr(self, "allocator_name", self.allocator),
                "budget_bytes": self.budget_bytes, **header}
        return self.recording.write(path, head)

    def leaves(self) -> dict[int, torch.Tensor]:
        """The plain tensors that entered as leaves, by their engine (and trace) id."""
        return {h.id: x for x, h in self._leaves.values() if h.producer is None}

    def adopt(self, tensors: Any) -> None:
        """Count these plain tensors toward the budget from now on, as pinned leaves: state
        the program holds for the whole step (parameters, buffers, optimizer state) that no
        op has touched yet."""
        eng = self.engine
        if eng is None:
            raise MembudgetError("adopt() needs an active session (inside `with`)")
        for x in tensors:
            if type(x) is not RematTensor:
                self._leaf(x)

    def _adopt_module(self, module: torch.nn.Module, args: Any) -> None:
        """Before a module first runs in the session, adopt all its parameters and buffers
        (its submodules' included), so they enter together, before the activations they
        would otherwise be interleaved with: a layout-aware pool then keeps them in one
        run of blocks instead of scattering barriers that fragment it."""
        if id(module) in self._adopted or _get_current_dispatch_mode() is not self:
            return  # (the hook is global: not this thread's session, or one nested in it)
        self._adopted.update(id(m) for m in module.modules())
        state = [*module.parameters(), *module.buffers()]

        def adopt_all() -> None:
            for k, x in enumerate(state):
                try:
                    self.adopt((x,))
                except OutOfBudget as e:  # say what was adopted, and all that it needs
                    rest = {y.untyped_storage()._cdata: y.untyped_storage().nbytes()
                            for y in state[k + 1:]}
                    rest.pop(x.untyped_storage()._cdata, None)  # counted in the request
                    e.op = f"adopting the parameters and buffers of {type(module).__name__}"
                    e.request_bytes += sum(n for w, n in rest.items() if w not in self._bases)
                    raise

        self._guarded(adopt_all)

    def phase(self, name: str) -> None:
        """Mark what the program computes from here on ("forward", "backward", "optimizer"):
        a trace event, and the kind the engine gives new storages (as the replay does)."""
        eng = self.engine
        if eng is None:
            raise MembudgetError("phase() needs an active session (inside `with`)")
        self.recording.phase(name)
        eng.output_kind = "gradient" if name == "backward" else "activation"

    def _hand_out(self) -> None:
        """Give every live wrapper its value and every leaf a plain gradient, so that what
        escapes the context (the loss, outputs, ``param.grad``) stays valid after it."""
        for h, ref_of in list(self._held.items()):
            ref = ref_of()
            if ref is not None:
                ref.value = self.read(h)
        for tensor, _ in list(self._leaves.values()):
            g = tensor.grad if tensor.is_leaf else None  # only leaves accumulate gradients
            if type(g) is RematTensor:
                tensor.grad = value_of(g)
        held, self._held = self._held, {}  # wrappers that died meanwhile are gone from it
        for h, ref_of in held.items():  # the program's references end with the session
            self.recording.release(h)
            self.engine.release(h)  # type: ignore[union-attr]
            _detach(ref_of)

    def _close(self) -> None:
        self._module_hook.remove()
        eng = self.engine
        if eng is not None:
            st = eng.stats
            self.stats = SessionStats(
                self.budget_bytes, eng.peak_bytes, st.evictions, st.eager_evictions,
                st.remat_ops, st.ops, st.remat_cost / 1e9, st.base_cost / 1e9,
                st.search_us(), st.fragmentation_summary(), self._device.peak())
        for ref_of in self._held.values():  # ended with an error: their values are gone
            _detach(ref_of)
        self._held = {}
        self._leaves = {}
        self._bases = {}
        self.engine = None
        self.executor.values.clear()  # the data goes now, not when a GC pass finds the engine
        self.executor = TorchExecutor()
        if self._gc_was_enabled:
            gc.enable()

    # ------------------------------------------------------------------ references
    def release(self, handle: Tensor) -> None:
        """A wrapper died: drop its reference (after the current op)."""
        try:
            del self._held[handle]
        except KeyError:  # already released: handed out as the session ended (or failed)
            return
        if self._busy:  # engine work is never re-entered: it is released after it
            self._pending.append(handle)
            return
        self._busy = True
        try:
            rec = self.recording
            if rec.active:
                rec.release(handle)
            self.engine.release(handle)  # type: ignore[union-attr]
        finally:
            self._busy = False
        if self._pending:
            self._drain()

    def _drain(self) -> None:
        """Release what is pending. Engine work is never re-entered: a wrapper that the
        garbage collector frees meanwhile only joins the queue."""
        if self._busy:
            return
        pending, eng = self._pending, self.engine
        self._busy = True
        try:
            while pending and eng is not None:
                h = pending.pop()
                self.recording.release(h)
                eng.release(h)
        finally:
            self._busy = False

    def read(self, handle: Tensor) -> torch.Tensor:
        """The value of ``handle``, recomputed if it was evicted."""
        if self.engine is None:
            raise MembudgetError("this tensor belonged to a membudget session that ended with "
                                 "an error; its value is gone")
        eng = self.engine

        def get() -> torch.Tensor:
            self.recording.get(handle)  # recorded where nothing else can slip in before it
            return eng.get_value(handle)

        with _disable_current_modes():  # recomputations run the real ops, not this mode
            return self._guarded(get)

    def evict(self, t: RematTensor) -> bool:
        """Drop the data of ``t`` now, as the policy would (False if it cannot be evicted)."""
        if self.engine is None or type(t) is not RematTensor or t._ref.session is not self:
            return False
        return self.engine.evict(t._ref.handle)

    def _leaf(self, x: torch.Tensor) -> Tensor:
        """The engine handle of a plain tensor: one pinned leaf per real storage, counted
        once, and other views of that storage (DDP's bucket views, say) as views of it."""
        st = x.untyped_storage()
        where = st._cdata  # the storage's identity (fake tensors have no data pointer)
        key = (where, x.dtype, tuple(x.size()), tuple(x.stride()), x.storage_offset())
        hit = self._leaves.get(key)
        if hit is not None:
            return hit[1]
        eng = self.engine
        assert eng is not None
        base = self._bases.get(where)
        if base is None or self.executor.values[base.id].dtype != x.dtype:
            kind = "parameter" if isinstance(x, torch.nn.Parameter) else "leaf"
            h = eng.put(st.nbytes(), kind)
            self.recording.put(h, kind)
            self.executor.values[h.id] = x
            self._bases.setdefault(where, h)
        else:
            view = aten.as_strided.default
            leaves, spec = flatten((slot(0), list(x.size()), list(x.stride()),
                                    x.storage_offset()), {})
            call = OpCall(view, leaves, spec)
            (h,) = eng.apply(call, [base], None)
            call.returned = None
            self.recording.call(call, [base], [h], call.cost)
        self._leaves[key] = (x, h)
        return h

    # ------------------------------------------------------------------ ops
    def _guarded(self, fn: Callable[[], Any]) -> Any:
        """Run engine work; an allocation that cannot fit becomes BudgetTooSmallError."""
        busy, self._busy = self._busy, True
        try:
            return fn()
        except OutOfBudget as e:
            raise BudgetTooSmallError.from_oob(e) from None
        finally:
            self._busy = busy
            if not busy:
                self._drain()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        """Run one aten op through the engine (every op comes here, so it is written flat)."""
        info = INFO.get(id(func))
        if info is None:
            info = op_info(func)
        if info.passthrough:
            return func(*args, **(kwargs or {}))
        busy, self._busy = self._busy, True
        try:
            leaves, spec = flatten(args, kwargs or NO_KWARGS)
            inputs: list[Tensor] = []
            for k, x in enumerate(leaves):
                if type(x) is RematTensor:  # tested first: most inputs are (and it is cheaper)
                    ref = x._ref
                    h = (ref.handle if ref.session is self
                         else self._leaf(self._outside(func, x)))
                elif type(x) in SCALARS or not isinstance(x, torch.Tensor):
                    continue  # (isinstance goes through torch's metaclass: tested last)
                else:
                    h = self._leaf(x)
                try:
                    leaves[k] = SLOTS[len(inputs)]
                except IndexError:  # more tensor arguments than placeholders made so far
                    leaves[k] = slot(len(inputs))
                inputs.append(h)
            call = OpCall(func, leaves, spec, info.random)
            if info.writes:
                return self._write(call, info, inputs, args, kwargs or NO_KWARGS)
            handles = self.engine.apply(call, inputs, None)  # type: ignore[union-attr]
            rec = self.recording
            if rec.active:  # (the hot path skips the calls a NotRecording would drop)
                rec.call(call, inputs, handles, call.cost)
            if call.returned_kind is not None or not handles:
                return self._returned(call, handles)
            # _returned for the commonest result, one tensor
            value = call.returned[0]  # type: ignore[index]
            call.returned = None  # the op's record must not keep the first result alive
            h = handles[0]
            ref = Ref(self, h)
            self._held[h] = weakref.ref(ref)
            return wrap(value, ref)
        except OutOfBudget as e:
            raise BudgetTooSmallError.from_oob(e) from None
        finally:
            self._busy = busy
            if not busy and self._pending:
                self._drain()

    def _write(self, call: OpCall, info: OpInfo, inputs: list[Tensor], args: tuple,
               kwargs: dict) -> Any:
        """``__torch_dispatch__`` for an op that writes some of its arguments."""
        eng = self.engine
        assert eng is not None
        func, rec = call.func, self.recording
        # the tensor object behind each input, in the order of the inputs
        objects = [x for x in flatten(args, kwargs)[0] if isinstance(x, torch.Tensor)]
        written = {id(o) for w in info.written(args, kwargs)
                   for o in (w if isinstance(w, (list, tuple)) else (w,))
                   if isinstance(o, torch.Tensor)}
        mutated = []  # each written tensor once, even if it is also read (x.add_(x))
        for i, o in enumerate(objects):
            if id(o) in written:
                written.discard(id(o))
                mutated.append(i)
        if (all(type(objects[i]) is RematTensor and _sole_reference(inputs[i])
                for i in mutated)
                and len({inputs[i].storage for i in mutated}) == len(mutated)
                and _returns_only_written(func)):
            # a write the engine can version: the written wrappers move to the new versions
            versions = eng.apply(call, inputs, [], [], 0.0, mutated)
            rec.mutation(call, inputs, mutated, versions, call.cost)
            for i, h in zip(mutated, versions, strict=True):
                # the wrapper moves to the new version and the old one is released at once,
                # before anything queued meanwhile (as the trace format's rebinding does)
                ref = objects[i]._ref
                old, ref.handle = ref.handle, h
                self._held[h] = self._held.pop(old)
                rec.release(old)
                eng.release(old)
            return _written_result(func, [objects[i] for i in mutated])
        # a write the engine cannot version: what it overwrites no longer matches its history,
        # nor could what was computed from the old value be recomputed after it (both are
        # pinned first), and the op itself is never recomputed (it would write again), unless
        # its writes are side effects that a recomputation can leave out
        for i in mutated:
            rec.pin(inputs[i], overwrite=True)
            eng.pin(inputs[i], overwrite=True)
        side_effects = info.side_effects_only(args, kwargs)
        if side_effects:
            call.rerun_leaves = [None if type(x) is Slot and x.index in mutated else x
                                 for x in call.leaves]
        handles = eng.apply(call, inputs, None)
        rec.call(call, inputs, handles, call.cost)
        if not side_effects:
            for h in handles:
                rec.pin(h)
                eng.pin(h)
        return self._returned(call, handles)

    def _returned(self, call: OpCall, handles: list[Tensor]) -> Any:
        """The op's result with each recorded tensor replaced by its wrapper."""
        flat = call.returned
        call.returned = None  # the op's record must not keep the first result alive
        assert flat is not None
        held = self._held
        for k, h in zip(call.outputs, handles, strict=True):
            ref = Ref(self, h)
            held[h] = weakref.ref(ref)
            flat[k] = wrap(flat[k], ref)
        kind = call.returned_kind
        return flat[0] if kind is None else kind(flat)

    def _outside(self, func: Any, x: RematTensor) -> torch.Tensor:
        """The value of a wrapper from a session that ended (a plain tensor here); a wrapper
        of another active session cannot be shared."""
        ref = x._ref
        if ref.session is not None and ref.session.engine is not None:
            raise MembudgetError(f"{func} got a tensor of another active membudget session; "
                                 "sessions cannot share tensors (nest no sessions)")
        return value_of(x)


def _detach(ref_of: weakref.ref[Ref]) -> None:
    """The session is over for this wrapper: it keeps its value (if handed out), not the
    session."""
    ref = ref_of()
    if ref is not None:
        ref.session = None
        ref.handle = None


def _sole_reference(t: Tensor) -> bool:
    """Is ``t`` the only tensor of its storage the program still holds? (A write through it
    then changes no other live view, so the write can become a new version.)"""
    return all(o is t or o.ext_refs == 0 for o in t.storage.tensors)


def _returns_only_written(func: Any) -> bool:
    """Does the op return nothing but (aliases of) the arguments it writes?"""
    return all(r.alias_info is not None and r.alias_info.is_write
               for r in func._schema.returns)


def _written_result(func: Any, written: list[Any]) -> Any:
    """What an in-place or out= op returns: the tensors it wrote, as the caller passed them."""
    returns = func._schema.returns
    if not returns:
        return None
    if len(returns) == 1 and not str(returns[0].type).endswith("[]"):
        return written[0]
    return tuple(written) if len(returns) > 1 else written


def _new_recording(record: bool | str | Path | None) -> Recording | NotRecording:
    """A session records its run only when asked to: the records of every op would
    otherwise pile up for as long as the session object lives."""
    return Recording() if record else NotRecording()


def budget(nbytes: int | str, policy: str = "dtr-eq", *, allocator: str | None = None,
           inplace: str | None = None, record: bool | str | Path | None = None) -> Session:
    """A memory budget for PyTorch code: ``with membudget.budget("1.5 GiB"):`` (or as a
    decorator). Tensors made inside are evicted and recomputed as needed to stay within it.
    ``policy``, ``allocator`` and ``inplace`` take the simulator's names. ``record=True``
    keeps the run so that ``session.trace(path)`` can write it as a trace; ``record=path``
    also writes it there when the session ends."""
    return Session(nbytes, policy, allocator, inplace, record)


__all__ = ["Session", "SessionStats", "budget"]
