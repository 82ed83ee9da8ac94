"""Plain tensors entering a session: each becomes a pinned leaf, counted once.

A plain tensor that reaches an op (a parameter, a buffer, an input, a tensor made before the
session) enters the engine as a pinned leaf: one leaf per real storage, and the other views
of that storage as views of it (DDP's bucket views, say). Just before a module first runs in
the session, all its parameters and buffers enter together, ahead of the activations they
would otherwise be interleaved with, and just before an optimizer first steps in the session,
all its state (made in an earlier step) does: room is made for all of them at once, so that
a layout-aware pool keeps them in one run of blocks instead of scattering barriers that
fragment it.

A leaf's storage may also be resized in place by no op (FSDP frees its all-gathered
parameters so, and reallocates them): ``resized`` counts its bytes as they are, and while it
holds none the values of its tensors are placeholders (:class:`Freed`) that refuse any op, so
that a recomputation that would read it fails instead of reading freed memory. ``drop``
forgets a leaf the program let go of (an FSDP buffer).

The gradient of a leaf that requires one (a parameter's ``.grad``) is pinned once autograd has
accumulated it: it is state the program holds to the end of the step, like the optimizer's,
and recomputing one would rerun the backward pass up to it.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)

from membudget.core.records import Tensor
from membudget.errors import MembudgetError, OutOfBudget
from membudget.runtime.sizing import budgetable, meta_of
from membudget.runtime.tensor import RematTensor

if TYPE_CHECKING:
    from membudget.runtime.session import Session


class Leaves:
    """The leaves of one session: by storage, dtype and view (``handle``), and the modules
    and optimizers whose state was adopted."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.by_view: dict[tuple, tuple[torch.Tensor, Tensor]] = {}
        self.bases: dict[int, Tensor] = {}  # real storage -> its leaf
        self.adopted: set[int] = set()  # ids of the modules and optimizers adopted
        self._hook = register_module_forward_pre_hook(self._adopt_module)
        _know_optimizers()
        self._grad_hooks: list[Any] = []
        self.freed: dict[int, torch.Tensor] = {}  # engine tensor id -> its value, while freed

    def close(self) -> None:
        self._hook.remove()
        for hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks = []
        self.by_view = {}
        self.bases = {}
        self.freed = {}

    def handle(self, x: torch.Tensor) -> Tensor:
        """The engine handle of a plain tensor: one pinned leaf per real storage, counted
        once, and other views of that storage as views of it."""
        try:
            st = x.untyped_storage()
        except NotImplementedError:  # (a tensor with no storage: say which, and the fix)
            budgetable(x, "an op of the session reads")
            raise
        where = st._cdata  # the storage's identity (fake tensors have no data pointer)
        key = (where, x.dtype, tuple(x.size()), tuple(x.stride()), x.storage_offset())
        hit = self.by_view.get(key)
        if hit is not None:
            return hit[1]
        if type(x) in (torch.Tensor, torch.nn.Parameter) and _holds_no_data(st):
            kind = "parameter" if isinstance(x, torch.nn.Parameter) else "tensor"
            raise MembudgetError(
                f"an op of the session reads a {kind} made before it whose data was set to "
                "a tensor the session made (`p.data = new` inside the session): a tensor from "
                "outside cannot hold data the session owns, and what it held is lost. Write "
                "the values in instead (`with torch.no_grad(): p.copy_(new)`), or assign a "
                "new parameter (`module.weight = nn.Parameter(new)`)")
        session = self.session
        eng, executor, rec = session.engine, session.executor, session.recording
        assert eng is not None
        base = self.bases.get(where)
        if base is None or executor.values[base.id].dtype != x.dtype:
            replayed = session._replayed  # (a value it made: the step's, not state)
            kind = ("parameter" if isinstance(x, torch.nn.Parameter) else
                    "value" if replayed is not None and replayed.made(x) else "leaf")
            h = eng.put(st.nbytes(), kind)
            h.meta = meta_of(x)
            rec.put(h, kind)
            executor.values[h.id] = x
            self.bases.setdefault(where, h)
            if x.requires_grad and x.is_leaf:
                self._grad_hooks.append(x.register_post_accumulate_grad_hook(self._pin_grad))
        else:
            h = session.strided_view(base, x.size(), x.stride(), x.storage_offset())
        self.by_view[key] = (x, h)
        return h

    def resized(self, x: torch.Tensor) -> None:
        """The storage of ``x`` may have been resized in place: count the bytes it holds now
        (a leaf from now on if it holds any; see the module)."""
        st = x.untyped_storage()
        nbytes = st.nbytes()
        h = self.bases.get(st._cdata)
        if h is None:
            if nbytes:
                self.handle(x)
            return
        s = h.storage
        if s.nbytes == nbytes:
            return
        values = self.session.executor.values
        for t in s.tensors:
            if nbytes:
                value = self.freed.pop(t.id, None)
                if value is not None:
                    values[t.id] = value
            elif t.id in values:
                value = self.freed[t.id] = values[t.id]
                values[t.id] = Freed.like(value)
        self.session.engine.resize(h, nbytes)  # type: ignore[union-attr]

    def drop(self, x: torch.Tensor) -> None:
        """The program let go of ``x``: release its leaf and its views (the engine frees them,
        unless something computed from them may still need them)."""
        h = self.bases.pop(x.untyped_storage()._cdata, None)
        if h is None:
            return
        session = self.session
        eng = session.engine
        assert eng is not None
        for key in [k for k, (_, t) in self.by_view.items() if t.storage is h.storage]:
            _, t = self.by_view.pop(key)
            session.recording.release(t)
            eng.release(t)

    def _pin_grad(self, x: torch.Tensor) -> None:
        """Autograd accumulated the gradient of ``x``: pin it (see the module)."""
        g = x.grad
        session = self.session
        eng = session.engine
        if type(g) is not RematTensor or g._ref.session is not session or eng is None:
            return
        h = g._ref.handle
        if h is not None and not h.storage.pinned:
            session.guarded(lambda: session.pin(h))

    def adopt(self, tensors: Iterable[Any]) -> None:
        """Count these plain tensors toward the budget from now on, as pinned leaves (a
        tensor subclass such as FSDP's sharded DTensor parameters by the tensors it wraps)."""
        for x in tensors:
            if type(x) is not RematTensor:
                for y in _inner(x):
                    self.handle(y)

    def plain(self) -> list[torch.Tensor]:
        """The plain tensors that entered (each view once)."""
        return [x for x, _ in self.by_view.values()]

    def by_id(self) -> dict[int, torch.Tensor]:
        """The plain tensors that entered as leaves, by their engine (and trace) id."""
        return {h.id: x for x, h in self.by_view.values() if h.producer is None}

    def _adopt_module(self, module: torch.nn.Module, args: Any) -> None:
        """Before a module first runs in the session, adopt all its parameters, their
        gradients (accumulated in an earlier session) and its buffers, its submodules'
        included, and the state of every optimizer known to update one of them: all of it
        is alive from the session's start, so it counts from the first op that needs room."""
        if self._adopts(module):
            self.adopted.update(id(m) for m in module.modules())
            params = list(module.parameters())
            _look_for_optimizers(module, params)
            ids = {id(p) for p in params}
            opts = [o for o in list(_optimizers) if self._adopts(o) and _updates(o, ids)]
            self.adopted.update(id(o) for o in opts)
            what = f"the parameters, gradients and buffers of {type(module).__name__}"
            if opts:
                what += f" and the state of {', '.join(type(o).__name__ for o in opts)}"
            self.adopt_together([*params, *(p.grad for p in params if p.grad is not None),
                                 *module.buffers(), *(v for o in opts for v in _state(o))],
                                what)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Before an optimizer first steps in the session (the session's step hook calls
        this), adopt all its state that its parameters' module did not: tensor by tensor,
        as the step reads it, each would land in a hole the step's temporaries left, and
        these leaves, which nothing can move, would split the pool."""
        if self._adopts(optimizer):
            self.adopted.add(id(optimizer))
            self.adopt_together(_state(optimizer), f"the state of {type(optimizer).__name__}")

    def _adopts(self, owner: object) -> bool:
        """Is ``owner`` (a module, an optimizer) about to run in this thread's session for
        the first time, outside a replay? (The hooks are global: not this thread's session,
        which may have modes on top, a recorder or a meter; a replay meters.)"""
        session = self.session
        return (id(owner) not in self.adopted and session.replay is None
                and session in _get_current_dispatch_mode_stack())

    def adopt_together(self, tensors: list[torch.Tensor], what: str) -> None:
        """Adopt ``tensors`` in one run of blocks: room is made for all of them at once (a
        block of their bytes, taken and given back), then each takes its place; if the
        budget runs out, the error names ``what`` and asks for the bytes still to adopt."""
        state = [y for x in tensors for y in _inner(x)]
        session = self.session
        eng, rec = session.engine, session.recording
        assert eng is not None
        todo: dict[int, int] = {}  # real storage -> bytes, of those not adopted yet
        for y in state:
            try:
                st = y.untyped_storage()
            except NotImplementedError:  # (no storage: ``handle`` says which, and the fix)
                todo = {}
                break
            if st._cdata not in self.bases:
                todo[st._cdata] = st.nbytes()

        def adopt_all() -> None:
            try:
                total = sum(todo.values())
                if total:  # (a block for them, so that they land together)
                    room = eng.put(total, "room")
                    rec.put(room, "room")
                    rec.release(room)
                    eng.release(room)
                for x in state:
                    self.adopt((x,))
                    todo.pop(x.untyped_storage()._cdata, None)
            except OutOfBudget as e:  # say what it was adopting, and all that it needs
                e.op = f"adopting {what}"
                e.request_bytes = sum(todo.values())
                raise

        from membudget.runtime.session import _below

        with _below(session):  # (a view of a leaf is an op: it must not come back here)
            session.guarded(adopt_all)


def _holds_no_data(st: torch.UntypedStorage) -> bool:
    """Is ``st`` a wrapper's storage, which has no data (a plain tensor gets one when its
    ``.data`` is set to a wrapper)?"""
    try:
        st.data_ptr()
    except RuntimeError:
        return True
    return False


def _state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """An optimizer's state on its parameters' devices (moments, step counts)."""
    return [v for p, per in optimizer.state.items() for v in per.values()
            if isinstance(v, torch.Tensor) and v.device == p.device]


def _updates(optimizer: torch.optim.Optimizer, ids: set[int]) -> bool:
    """Does ``optimizer`` update one of the parameters whose ids are ``ids``?"""
    return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])


def optimizer_state(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The state of every optimizer known to update one of ``params``: a session counts it
    with them from its start (see ``Leaves._adopt_module``), whether the step reads it or
    not, and so does a replayed step."""
    ids = {id(p) for p in params}
    return [v for o in list(_optimizers) if _updates(o, ids) for v in _state(o)]


def _note(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _optimizers.add(optimizer)


# The optimizers a session knows of, to adopt the state of those that update its modules'
# parameters with them. Torch keeps no list of them: a global hook keeps every one that steps,
# and one that has not stepped yet (its state loaded from a checkpoint, say) is looked for
# among all live objects when a module first runs some of whose trainable parameters no known
# optimizer updates; ``_unowned`` keeps, by module, those that none updated at its last look,
# so that a model trained by no optimizer is not looked for at every session.
_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_unowned: weakref.WeakKeyDictionary[torch.nn.Module, set[int]] = weakref.WeakKeyDictionary()
_noting: list[Any] = []  # the global pre-step hook that keeps them


def _know_optimizers() -> None:
    """At the process's first session: keep the optimizers that step from now on."""
    if not _noting:
        _noting.append(register_optimizer_step_pre_hook(_note))


def _look_for_optimizers(module: torch.nn.Module, params: list[torch.Tensor]) -> None:
    """Find the live optimizers if a trainable parameter of ``module`` is updated by none
    known and was not at the last look (a search of all objects: about 0.1 s in a process
    that has imported transformers)."""
    trainable = {id(p) for p in params if p.requires_grad}
    if not trainable - _owned() - _unowned.get(module, set()):
        return
    optimizer = torch.optim.Optimizer  # (by type: isinstance asks proxies, which warn)
    _optimizers.update(o for o in gc.get_objects() if issubclass(type(o), optimizer))
    _unowned[module] = trainable - _owned()


def _owned() -> set[int]:
    """The ids of the parameters some known optimizer updates."""
    return {id(p) for o in list(_optimizers) for g in o.param_groups for p in g["params"]}


def _inner(x: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold the data of ``x``: itself, or those a tensor subclass
    wraps (a DTensor's local shard)."""
    if not is_traceable_wrapper_subclass(x):
        return [x]
    inner = (getattr(x, name) for name in x.__tensor_flatten__()[0])
    return [y for t in inner if isinstance(t, torch.Tensor) for y in _inner(t)]


class Freed(torch.Tensor):
    """What the engine holds for a tensor of a leaf whose storage was freed under it: any op
    on it raises (a recomputation that needs that leaf cannot run until it is reallocated)."""

    @staticmethod
    def like(value: torch.Tensor) -> Freed:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[return-value]
            Freed, value.size(), strides=value.stride(), storage_offset=value.storage_offset(),
            dtype=value.dtype, device=value.device)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        raise MembudgetError(
            f"{func} needs a tensor whose memory its owner freed (FSDP frees the parameters "
            "it all-gathered after each module's forward and backward): a value computed from "
            "it was evicted and is read where that memory is gone; read it inside the module "
            "that computes it, or return it from that module (its outputs are kept)")
