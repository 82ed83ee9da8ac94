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
  never recomputed; if evicted values were computed from what it overwrites, that is
  refused, since they could no longer be recomputed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import ContextDecorator
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from membudget.core.engine import Engine
from membudget.core.records import Tensor
from membudget.errors import BudgetTooSmallError, MembudgetError, OutOfBudget
from membudget.runtime.classify import op_info
from membudget.runtime.executor import OpCall, Slot, TorchExecutor, capture_rng
from membudget.runtime.tensor import Ref, RematTensor, value_of
from membudget.units import parse_bytes


@dataclass
class SessionStats:
    """What a session did; ``remat_seconds`` is the time spent recomputing, estimated from
    the recomputed ops' first-run times."""

    budget_bytes: int
    peak_bytes: int = 0
    evictions: int = 0
    eager_evictions: int = 0
    remat_ops: int = 0
    ops: int = 0
    remat_seconds: float = 0.0
    search_us: dict[str, float] = field(default_factory=dict)
    fragmentation: dict[str, float] = field(default_factory=dict)


class _Mode(TorchDispatchMode):
    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        return self.session.dispatch(func, args, kwargs or {})


class Session(ContextDecorator):
    """A memory budget for the code inside ``with``; see :func:`membudget.budget`."""

    def __init__(self, budget: int | str, policy: str = "dtr-eq", allocator: str | None = None,
                 inplace: str | None = None) -> None:
        self.budget_bytes = parse_bytes(budget) if isinstance(budget, str) else int(budget)
        if self.budget_bytes <= 0:
            raise MembudgetError(f"a budget must be > 0 bytes, got {budget!r}")
        self.policy, self.allocator, self.inplace = policy, allocator, inplace
        self.engine: Engine | None = None
        self.stats = SessionStats(self.budget_bytes)
        self._mode: _Mode | None = None

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> Session:
        if self.engine is not None:
            raise MembudgetError("this budget session is already active; make a new one")
        self.executor = TorchExecutor()
        self.engine = Engine(self.budget_bytes, self.policy, self.allocator, self.executor,
                             inplace=self.inplace)
        self._leaves: dict[tuple, tuple[torch.Tensor, Tensor]] = {}
        self._refs: weakref.WeakSet[Ref] = weakref.WeakSet()
        self._pending: list[Tensor] = []
        self._busy = False
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        mode, self._mode = self._mode, None
        try:
            if exc_type is None:
                self._hand_out()
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
            self._close()

    def _hand_out(self) -> None:
        """Give every live wrapper its value and every leaf a plain gradient, so that what
        escapes the context (the loss, outputs, ``param.grad``) stays valid after it."""
        for ref in list(self._refs):
            if ref.handle is not None:
                ref.value = self.read(ref.handle)
        for tensor, _ in self._leaves.values():
            g = tensor.grad
            if type(g) is RematTensor:
                tensor.grad = value_of(g)

    def _close(self) -> None:
        eng = self.engine
        if eng is not None:
            st = eng.stats
            self.stats = SessionStats(
                self.budget_bytes, eng.peak_bytes, st.evictions, st.eager_evictions,
                st.remat_ops, st.ops, st.remat_cost / 1e9, st.search_us(),
                st.fragmentation_summary())
        for ref in list(self._refs):
            ref.session = None
            ref.handle = None
        self._leaves = {}
        self.engine = None
        self.executor = TorchExecutor()

    # ------------------------------------------------------------------ references
    def release(self, handle: Tensor) -> None:
        """A wrapper died or was rebound: drop its reference (after the current op)."""
        if self.engine is None:
            return
        self._pending.append(handle)
        if not self._busy:
            self._drain()

    def _drain(self) -> None:
        pending, eng = self._pending, self.engine
        while pending and eng is not None:
            eng.release(pending.pop())

    def read(self, handle: Tensor) -> torch.Tensor:
        """The value of ``handle``, recomputed if it was evicted."""
        if self.engine is None:
            raise MembudgetError("this tensor belonged to a membudget session that ended with "
                                 "an error; its value is gone")
        with _disable_current_modes():  # recomputations run the real ops, not this mode
            return self._guarded(lambda: self.engine.get_value(handle))

    def evict(self, t: RematTensor) -> bool:
        """Drop the data of ``t`` now, as the policy would (False if it cannot be evicted)."""
        if self.engine is None or type(t) is not RematTensor or t._ref.session is not self:
            return False
        return self.engine.evict(t._ref.handle)

    def _wrap(self, value: torch.Tensor, handle: Tensor) -> RematTensor:
        ref = Ref(self, handle)
        self._refs.add(ref)
        return RematTensor(value, ref)

    def _leaf(self, x: torch.Tensor) -> Tensor:
        """The engine handle of a plain tensor (a pinned leaf, one per storage and view)."""
        st = x.untyped_storage()
        key = (st.data_ptr(), x.device, x.dtype, tuple(x.size()), tuple(x.stride()),
               x.storage_offset())
        hit = self._leaves.get(key)
        if hit is not None:
            return hit[1]
        eng = self.engine
        assert eng is not None
        kind = "parameter" if isinstance(x, torch.nn.Parameter) else "leaf"
        h = eng.put(st.nbytes(), kind)
        self.executor.values[h.id] = x
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

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        return self._guarded(lambda: self._dispatch(func, args, kwargs))

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        eng = self.engine
        assert eng is not None
        flat, spec = tree_flatten((args, kwargs))
        inputs: list[Tensor] = []
        leaves: list[Any] = []
        objects: list[Any] = []  # the tensor object behind each input
        for x in flat:
            if isinstance(x, torch.Tensor):
                ref = getattr(x, "_ref", None) if type(x) is RematTensor else None
                if ref is not None and ref.session is self:
                    h = ref.handle
                elif type(x) is RematTensor:
                    raise MembudgetError(f"{func} got a tensor of another membudget session")
                else:
                    h = self._leaf(x)
                leaves.append(Slot(len(inputs)))
                inputs.append(h)
                objects.append(x)
            else:
                leaves.append(x)
        info = op_info(func)
        if info.writes:
            return self._mutating(func, info, args, kwargs, inputs, leaves, spec, objects)
        eng.acquire(inputs)
        try:
            values = self.executor.values
            real = [values[t.id] for t in inputs]
            call_args, call_kwargs = tree_unflatten(
                [real[x.index] if type(x) is Slot else x for x in leaves], spec)
            rng = capture_rng(_devices(real), _generators(flat)) if info.random else None
            t0 = perf_counter_ns()
            out = func(*call_args, **call_kwargs)
            cost = float(perf_counter_ns() - t0)
        finally:
            eng.unacquire(inputs)
        out_flat, out_spec = tree_flatten(out)
        positions = [k for k, o in enumerate(out_flat) if isinstance(o, torch.Tensor)]
        if not positions:
            return out  # a read (item, is_nonzero, ...): nothing to record
        tensors = [out_flat[k] for k in positions]
        out_bytes, out_alias = _layout(tensors, real)
        call = OpCall(func, leaves, spec, positions, rng, tensors)
        handles = eng.apply(call, inputs, out_bytes, out_alias, cost)
        for k, v, h in zip(positions, tensors, handles, strict=True):
            out_flat[k] = self._wrap(v, h)
        return tree_unflatten(out_flat, out_spec)

    def _mutating(self, func: Any, info: Any, args: tuple, kwargs: dict,
                  inputs: list[Tensor], leaves: list[Any], spec: Any,
                  objects: list[Any]) -> Any:
        """Ops that write memory: versions when the engine owns everything written and the
        op returns only what it wrote; otherwise run as they are, with pinned outputs."""
        eng = self.engine
        assert eng is not None
        written = {id(o) for w in info.written(args, kwargs)
                   for o in (w if isinstance(w, (list, tuple)) else (w,))
                   if isinstance(o, torch.Tensor)}
        mutated = [i for i, o in enumerate(objects) if id(o) in written]
        versionable = (all(type(objects[i]) is RematTensor and _sole_reference(inputs[i])
                           for i in mutated)
                       and len({inputs[i].storage for i in mutated}) == len(mutated))
        if versionable:
            flat_objs = {id(objects[i]) for i in mutated}
            rng = None
            if info.random:
                eng.acquire(inputs)
                try:
                    real = [self.executor.values[t.id] for t in inputs]
                    rng = capture_rng(_devices(real), _generators(leaves))
                finally:
                    eng.unacquire(inputs)
            call = OpCall(func, leaves, spec, [], rng, None)
            versions = eng.apply(call, inputs, [], [], 0.0, mutated)
            for i, h in zip(mutated, versions, strict=True):
                objects[i]._ref.rebind(h)
            return _returned(func, args, kwargs, flat_objs)
        return self._opaque(func, args, kwargs, inputs, leaves, spec, mutated)

    def _opaque(self, func: Any, args: tuple, kwargs: dict, inputs: list[Tensor],
                leaves: list[Any], spec: Any, mutated: list[int]) -> Any:
        """Run a write the engine cannot version: in place, with its outputs pinned."""
        eng = self.engine
        assert eng is not None
        for i in mutated:
            s = inputs[i].storage
            if any(not c.dead for c in s.children):
                raise NotImplementedError(
                    f"{func} writes a tensor that earlier recorded ops read, outside what the "
                    "engine can version (memory it does not own, or a storage other live views "
                    "share); their results could not be recomputed after it. Run this op "
                    "outside the membudget session.")
        eng.acquire(inputs)
        try:
            real = [self.executor.values[t.id] for t in inputs]
            call_args, call_kwargs = tree_unflatten(
                [real[x.index] if type(x) is Slot else x for x in leaves], spec)
            t0 = perf_counter_ns()
            out = func(*call_args, **call_kwargs)
            cost = float(perf_counter_ns() - t0)
        finally:
            eng.unacquire(inputs)
        for i in mutated:
            eng.pin(inputs[i])
        out_flat, out_spec = tree_flatten(out)
        by_ptr = {id(v): i for i, v in enumerate(real)}
        fresh = []
        for k, o in enumerate(out_flat):
            if not isinstance(o, torch.Tensor):
                continue
            i = by_ptr.get(id(o))
            if i is not None:  # returns an input as it is (add_ returns self)
                out_flat[k] = tree_flatten((args, kwargs))[0][_flat_index(leaves, i)]
            else:
                fresh.append(k)
        if fresh:
            tensors = [out_flat[k] for k in fresh]
            out_bytes, out_alias = _layout(tensors, real)
            call = OpCall(func, leaves, spec, fresh, None, tensors)
            handles = eng.apply(call, inputs, out_bytes, out_alias, cost, pinned=True)
            for k, v, h in zip(fresh, tensors, handles, strict=True):
                out_flat[k] = self._wrap(v, h)
        return tree_unflatten(out_flat, out_spec)


def _sole_reference(t: Tensor) -> bool:
    """Is ``t`` the only tensor of its storage the program still holds? (A write through it
    then changes no other live view, so the write can become a new version.)"""
    return all(o is t or o.ext_refs == 0 for o in t.storage.tensors)


def _flat_index(leaves: list[Any], i: int) -> int:
    return next(k for k, x in enumerate(leaves) if type(x) is Slot and x.index == i)


def _returned(func: Any, args: tuple, kwargs: dict, written: set[int]) -> Any:
    """What an in-place or out= op returns: the arguments it wrote, as the caller passed them."""
    flat = [x for x in tree_flatten((args, kwargs))[0] if id(x) in written]
    returns = func._schema.returns
    if not returns:
        return None
    if len(returns) == 1 and len(flat) == 1:
        return flat[0]
    return tuple(flat) if len(returns) > 1 else flat


def _layout(tensors: list[torch.Tensor], inputs: list[torch.Tensor]
            ) -> tuple[list[int], list[int]]:
    """Bytes and aliased input of each output: a view shares its input's storage."""
    owners = {}
    for i, v in enumerate(inputs):
        st = v.untyped_storage()
        if st.nbytes():
            owners.setdefault((st.data_ptr(), v.device), i)
    out_bytes, out_alias = [], []
    for o in tensors:
        st = o.untyped_storage()
        i = owners.get((st.data_ptr(), o.device), -1) if st.nbytes() else -1
        out_alias.append(i)
        out_bytes.append(0 if i >= 0 else st.nbytes())
    return out_bytes, out_alias


def _devices(values: list[torch.Tensor]) -> list[torch.device]:
    return list({v.device for v in values if v.device.type != "cpu"})


def _generators(flat: list[Any]) -> list[torch.Generator]:
    return [x for x in flat if isinstance(x, torch.Generator)]


def budget(nbytes: int | str, policy: str = "dtr-eq", *, allocator: str | None = None,
           inplace: str | None = None) -> Session:
    """A memory budget for PyTorch code: ``with membudget.budget("1.5 GiB"):`` (or as a
    decorator). Tensors made inside are evicted and recomputed as needed to stay within it."""
    return Session(nbytes, policy, allocator, inplace)


__all__ = ["Session", "SessionStats", "budget"]
