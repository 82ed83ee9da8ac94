"""What a session hands back when it ends: the tensors the program holds, as plain tensors.

Every wrapper the program still holds when the session ends (the loss, outputs, optimizer
state, anything) is materialized and becomes an ordinary ``torch.Tensor`` (an
``nn.Parameter`` if one made it) in place: the same Python object, with its attributes, now
with a storage of its own, so it prints, pickles, saves, takes in-place writes and enters a
later session like any tensor. One with autograd history stays joined to it (its ``grad_fn``
is a ``HandOffBackward`` that passes gradients to the wrapper's history).
The gradients of plain leaves (``param.grad``) become their values too.

A wrapper that torch itself also holds (saved for the backward of a graph still alive)
cannot be swapped safely: it keeps its value instead, and ops on it run on that value.

The values are materialized within the budget, those already resident first, and each is
pinned as it is handed out (the program holds it: the engine must count it, not evict it).
Only if the budget cannot hold all of them at once is it raised, to what the next one needs
(``SessionStats.beyond_budget_bytes``). After an error, the values still in memory are
handed back, and so is the state of every optimizer that stepped in the session, recomputed
if it was evicted (state made by ``zeros_like`` and not yet written is cheap to evict): the
program keeps it across steps. Nothing else is recomputed, since the failed step cannot go
on and the memory its recomputation would take may not exist, so any other evicted value is
dropped and reading it raises a clear error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from membudget.core.records import Tensor
from membudget.errors import BudgetTooSmallError, MembudgetError
from membudget.runtime.tensor import RematTensor, value_of

if TYPE_CHECKING:
    from membudget.runtime.session import Session


class HandOff(torch.autograd.Function):
    """A handed-out tensor's link to the history of the wrapper it replaces."""

    @staticmethod
    def forward(ctx: Any, wrapper: RematTensor) -> torch.Tensor:
        return value_of(wrapper).detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def hand_out(session: Session, failed: bool) -> tuple[int, int]:
    """Give the program's tensors their values and make them plain (see the module); how
    many evicted values it recomputed to hand them out, and their bytes."""
    refs = session.refs
    alive = refs.wrappers()
    # after an error, what is still in memory, and the optimizers' state
    state = {id(t) for opt in session.optimizers for t in tree_leaves(list(opt.state.values()))
             if type(t) is RematTensor} if failed else set()
    wanted = [(h, w) for h, w in alive if h.defined or not failed or id(w) in state]
    wanted.sort(key=lambda hw: not hw[0].defined)  # the resident ones cost no recomputation
    recomputed = {h.storage for h, _ in wanted if not h.defined}
    pinned = []
    for h, w in wanted:
        try:
            hold(session, h)
        except MembudgetError:
            if not failed:
                raise
        else:
            pinned.append((h, w))
    # read only once all are in place: making room for one may move another (to a new
    # block, the old one freed), and a value read before that would hold the old block
    for h, w in pinned:
        w._ref.value = session.read(h)
    for tensor in session.leaves.plain():
        g = tensor.grad if tensor.is_leaf else None  # only leaves accumulate gradients
        if type(g) is RematTensor and g._ref.value is not None:
            tensor.grad = g._ref.value
    held, refs.held = refs.held, {}
    for h in held:  # the program's references end with the session
        session.recording.release(h)
        session.engine.release(h)  # type: ignore[union-attr]
    for _, w in alive:
        ref = w._ref
        ref.session = ref.handle = None  # (a wrapper that dies now releases nothing)
        if ref.value is not None and w._use_count() == 1:
            _become_plain(w)
    return len(recomputed), sum(s.nbytes for s in recomputed)


def hold(session: Session, h: Tensor) -> None:
    """Materialize and pin ``h``; the budget is raised to what that needs if it cannot hold
    it beside the values pinned before (handed out, or saved)."""
    eng = session.engine
    assert eng is not None
    while True:
        try:
            session.guarded(lambda: session.pin(h))
            return
        except BudgetTooSmallError as e:
            capacity = eng.budget
            if e.needed_bytes <= capacity and eng.allocator.name == "lifted":
                raise  # (cannot happen: a fungible pool fails only when over capacity)
            eng.lift_budget(e.needed_bytes)


def _become_plain(w: RematTensor) -> None:
    """Turn ``w`` into a plain tensor holding its value, in place (the same object)."""
    value = w._ref.value
    assert value is not None
    extra = {k: v for k, v in w.__dict__.items() if k != "_ref"}
    if extra.pop("_is_param", False):  # made by nn.Parameter(...) inside the session
        plain = torch.nn.Parameter(value.detach(), requires_grad=w.requires_grad)
    elif not w.requires_grad:
        plain = value.detach()
    elif not w.is_leaf:
        plain = HandOff.apply(w)
    else:  # a leaf made inside the session: a leaf again
        plain = value.detach().requires_grad_(True)
    if plain.is_leaf and plain.requires_grad:  # with its gradient
        g = w.grad
        if type(g) is RematTensor and g._ref.value is not None:
            plain.grad = g._ref.value
        elif type(g) is torch.Tensor:
            plain.grad = g
    plain.__dict__.update(extra)  # the program's own attributes stay with the object
    _swap(w, plain)


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two tensor objects (``torch.utils.swap_tensors`` without
    its refusal of Python weak references: the session's own weak reference to ``a`` is
    done), unless torch refuses, leaving both unchanged: autograd holds a weak reference to
    the tensor itself (``retain_grad()``), which must keep seeing the same tensor. Then ``a``
    stays a wrapper holding its value, as one saved for a backward still to come does."""
    try:
        torch._C._swap_tensor_impl(a, b)
    except RuntimeError as e:
        if "weakref" not in str(e):
            raise
        return
    a.__class__, b.__class__ = b.__class__, a.__class__
    a.__dict__, b.__dict__ = b.__dict__, a.__dict__


__all__ = ["HandOff", "hand_out"]
