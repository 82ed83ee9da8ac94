"""FSDP2 (``fully_shard``) inside a session: its communication runs outside, its memory is counted.

FSDP2 keeps each parameter sharded across the ranks. Before a module's forward and again
before its backward it all-gathers the full ("unsharded") parameters into buffers of its own;
after them it frees those buffers by resizing their storages to 0 bytes
(``FSDPParam.free_unsharded_param``) and reallocates the same storages for the next
all-gather. The parameter-group methods that communicate or manage these buffers run with the
session suspended, so that FSDP's state stays plain tensors of its own (a resize is no aten
op: the session would not see it), and after each the session counts what FSDP holds:

- the all-gathered parameters, as pinned leaves (they cannot be recomputed without
  communicating), their bytes counted while allocated and not while freed
  (``Leaves.resized``);
- the flat all-gather and reduce-scatter buffers, while FSDP keeps them (one it drops
  elsewhere, as the root's post-forward does, is counted up to the next of these methods);
- the sharded gradients, from their reduce-scatter on (state the optimizer reads).

A value computed from an all-gathered parameter can be recomputed only while that parameter is
allocated. FSDP all-gathers a module's parameters again, with the same contents, before its
backward, so the values its backward reads recompute there; a module's outputs, read beyond
it, are pinned before FSDP frees its parameters after forward, and when it frees them for good
(after backward), every value the program still holds that was computed from them is
materialized and pinned first, as for an overwrite. A recomputation that would still read a
freed parameter fails loudly rather than read freed memory.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

from membudget.runtime.tensor import RematTensor

if TYPE_CHECKING:
    from membudget.runtime.leaves import Leaves
    from membudget.runtime.session import Session

# FSDPParamGroup's methods that communicate or manage FSDP's buffers (post_forward frees them
# by calling reshard, after pinning the module's outputs)
SUSPENDED = ("lazy_init", "unshard", "wait_for_unshard", "reshard", "post_forward",
             "post_backward", "finalize_backward", "_reset_iter_state")

_installed = False
_suspended = threading.local()  # .session: the session a method of this thread suspended
# per session entry: the FSDP buffers counted while FSDP keeps them, with that test
_buffers: weakref.WeakKeyDictionary[Leaves, list[tuple[torch.Tensor, Callable[[], bool]]]] = (
    weakref.WeakKeyDictionary())


def install(mode_type: type) -> None:
    """Run FSDP2's buffer work outside any active ``mode_type`` and count its memory there
    (once per process; nothing if this torch has no FSDP2)."""
    global _installed
    if _installed or not torch.distributed.is_available():
        return
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        return
    for name in SUSPENDED:
        setattr(FSDPParamGroup, name, _suspending(getattr(FSDPParamGroup, name), mode_type))
    _installed = True


def _suspending(method: Callable[..., Any], mode_type: type) -> Callable[..., Any]:
    """``method`` run with the session suspended, then FSDP's memory counted."""
    name = method.__name__

    @functools.wraps(method)
    def run(group: Any, *args: Any, **kwargs: Any) -> Any:
        session = getattr(_suspended, "session", None) or next(
            (m for m in _get_current_dispatch_mode_stack() if isinstance(m, mode_type)), None)
        if session is None or session.engine is None:
            return method(group, *args, **kwargs)
        with _suspend(session):  # (the engine's work too: it may run ops)
            if name == "post_forward":
                _pin_outputs(session, args[2], group)
            elif name == "reshard":
                _before_reshard(session, group)
            out = method(group, *args, **kwargs)
            session.guarded(lambda: _count(session, group, name))
        return out

    return run


@contextmanager
def _suspend(session: Session) -> Iterator[None]:
    """The session's dispatch mode (and the modes above it) popped, and the session known to
    the FSDP methods called meanwhile."""
    from membudget.runtime.session import _below

    outer = getattr(_suspended, "session", None)
    _suspended.session = session
    try:
        with _below(session):
            yield
    finally:
        _suspended.session = outer


def _pin_outputs(session: Session, output: Any, group: Any) -> None:
    """Pin the outputs of a module whose parameters FSDP frees after its forward: they are
    read beyond it, where those parameters are gone."""
    if not group._reshard_after_forward:
        return
    held = [x._ref.handle for x in tree_leaves(output)
            if type(x) is RematTensor and x._ref.session is session]
    session.guarded(lambda: [session.pin(h) for h in held if h is not None])


def _before_reshard(session: Session, group: Any) -> None:
    """FSDP is about to free the group's parameters: for good (not after forward), so what
    the program holds that was computed from them is materialized and pinned now."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    if group._training_state == TrainingState.FORWARD:
        return
    leaves = session.leaves
    handles = [h for t in _gathered(group)
               if (h := leaves.bases.get(t.untyped_storage()._cdata)) is not None
               and h.storage.nbytes]
    session.guarded(lambda: [session.pin(h, overwrite=True) for h in handles])


def _count(session: Session, group: Any, name: str) -> None:
    """After ``group.name`` ran: count FSDP's buffers as they now are (see the module)."""
    leaves = session.leaves
    for t in _gathered(group):
        leaves.resized(t)
    held = _buffers.setdefault(leaves, [])
    comm = getattr(group, "comm_ctx", None)
    if name == "unshard" and group._all_gather_result is not None:
        result = group._all_gather_result
        held.append((result.all_gather_output, lambda: _gathering(group, result)))
    if name == "post_backward" and comm is not None:
        for state in comm.reduce_scatter_states:
            if all(buf is not state.reduce_scatter_input for buf, _ in held):
                buf = state.reduce_scatter_input
                held.append((buf, lambda buf=buf: any(
                    s.reduce_scatter_input is buf for s in comm.reduce_scatter_states)))
        for p in group.fsdp_params:
            grad = p.sharded_param.grad
            if grad is not None:
                leaves.adopt((getattr(grad, "_local_tensor", grad),))
    for buf, _ in held:
        if buf.untyped_storage()._cdata not in leaves.bases:
            leaves.adopt((buf,))
    still = []
    for buf, kept in held:
        if kept():
            still.append((buf, kept))
        else:
            leaves.drop(buf)
    _buffers[leaves] = still


def _gathering(group: Any, result: Any) -> bool:
    """Does FSDP still hold this all-gather result (pending, or kept for the next copy-out)?"""
    state = group.comm_ctx.all_gather_state
    return group._all_gather_result is result or (
        state is not None and state.all_gather_result is result)


def _gathered(group: Any) -> list[torch.Tensor]:
    """The tensors that hold the group's all-gathered parameters (those FSDP frees)."""
    return [t for p in group.fsdp_params
            for t in (*p.all_gather_outputs, *getattr(p, "_unsharded_inner_tensors", ()))]
