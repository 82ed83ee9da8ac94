"""Ops that write their arguments (in-place and ``out=`` ops): new versions, or pinned writes.

A write to tensors the session owns, by an op that returns only what it wrote, becomes a
*new version* of each written storage, recomputable like any value: the written wrapper moves
to the version, and so does every other view of that storage the program holds (in memory
they all see the write), each as a view of the version. That holds for a view written while
its siblings live, as in PyTorch's LSTM cell without oneDNN (``unsafe_chunk`` into four
gates, each written by ``sigmoid_`` or ``tanh_``).

Any other write (to memory the engine does not own, such as parameters in an optimizer step
or BatchNorm's running statistics) runs as it is and its outputs are pinned, never
recomputed: what it overwrites no longer matches its history, nor could what was computed
from the old contents be recomputed after it, so both are materialized and pinned first.
Training-mode batch norm is the exception for its outputs: its statistics update is a side
effect no output depends on, so it is recomputed with the statistics left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from membudget.core.records import Tensor
from membudget.runtime.call import OpCall, Slot
from membudget.runtime.classify import OpInfo
from membudget.runtime.flat import flatten
from membudget.runtime.tensor import RematTensor

if TYPE_CHECKING:
    from membudget.runtime.session import Session



def write(session: Session, call: OpCall, info: OpInfo, inputs: list[Tensor], args: tuple,
          kwargs: dict) -> Any:
    """``__torch_dispatch__`` for an op that writes some of its arguments."""
    eng = session.engine
    assert eng is not None
    func, rec, refs = call.func, session.recording, session.refs
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
    views = _other_views(session, objects, inputs, mutated)
    if views is not None and _returns_only_written(func):
        # the other views of the written storages let go of the old versions first, so that
        # nothing but the write itself needs them (it may then write where they are)
        for o in views:
            rec.release(o)
            eng.release(o)
        try:
            versions = session.apply(call, inputs, [], [], 0.0, mutated)
        except BaseException:
            for o in views:
                eng.retain(o)
            raise
        rec.mutation(call, inputs, mutated, versions, call.cost)
        version_of = {}
        for i, h in zip(mutated, versions, strict=True):
            version_of[inputs[i].storage] = h
            refs.move(inputs[i], h)
        for o in views:  # each other view is taken again, of the new version
            _rebind(session, o, version_of[o.storage])
        if info.restrides:
            _restride(func, args, kwargs)
        return _written_result(func, [objects[i] for i in mutated])
    for i in mutated:
        session.pin(inputs[i], overwrite=True)
    side_effects = info.side_effects_only(args, kwargs)
    if side_effects:
        call.rerun_leaves = [None if type(x) is Slot and x.index in mutated else x
                             for x in call.leaves]
    handles = session.apply(call, inputs)
    if session.executor.misfits:
        session.resize()
    rec.call(call, inputs, handles, call.cost)
    if not side_effects:
        for h in handles:
            session.pin(h)
    return session.returned(call, handles)


def _other_views(session: Session, objects: list[Any], inputs: list[Tensor],
                 mutated: list[int]) -> list[Tensor] | None:
    """The other tensors of the written storages that the program holds, if the write can
    make new versions (None if not: it writes a tensor of no session of ours, or one
    storage twice, or a storage that something outside the session also holds)."""
    held = session.refs.held
    storages = set()
    views = []
    for i in mutated:
        o = objects[i]
        if type(o) is not RematTensor or o._ref.session is not session:
            return None
        t = inputs[i]
        if t.storage in storages:
            return None
        storages.add(t.storage)
    written = {inputs[i] for i in mutated}
    for s in storages:
        for t in s.tensors:
            if t.ext_refs and t not in written:
                wrapper_of = held.get(t)
                if wrapper_of is None or wrapper_of() is None:
                    return None
                views.append(t)
    return views


def _rebind(session: Session, old: Tensor, version: Tensor) -> None:
    """The wrapper of ``old``, a view of a storage just written (its reference released
    before the write), becomes the same view of its new ``version``."""
    shape, stride, offset, _, _ = old.meta  # type: ignore[misc]
    session.refs.rebind(old, session.strided_view(version, shape, stride, offset))


def _restride(func: Any, args: tuple, kwargs: dict) -> None:
    """Give the program's wrapper the new shape, strides and offset the op gave its value:
    the op runs again on the wrapper alone, as on a meta tensor (as PyTorch's
    ``return_and_correct_aliasing`` does for wrapper subclasses), which changes nothing
    but its metadata."""
    with torch.utils._mode_utils.no_dispatch():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)


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
