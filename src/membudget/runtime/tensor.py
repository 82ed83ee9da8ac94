"""The wrapper tensor: what autograd and the user hold while the engine owns the data.

A :class:`RematTensor` has the metadata of its value (size, strides, dtype, device) but no
storage of its own; its :class:`Ref` names the engine tensor whose real value the executor
keeps, may drop and may recompute. Autograd saves wrappers, so dropping a value frees memory
that a saved activation would otherwise pin. When a session ends, each wrapper the program
still holds becomes an ordinary tensor in place (``runtime.handout``); one that torch itself
also holds (an autograd graph still alive) keeps its value instead, and ops on it then run on
that value as on a plain tensor. It prints and pickles as its value does, inside a session or
after it.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from membudget.core.records import Tensor
from membudget.errors import MembudgetError

if TYPE_CHECKING:
    from membudget.runtime.session import Session


class Ref:
    """One program reference to an engine tensor, released when the wrapper dies; after the
    session closed, ``value`` holds the data instead (and it refers to no session)."""

    __slots__ = ("__weakref__", "handle", "session", "value")

    def __init__(self, session: Session, handle: Tensor) -> None:
        self.session: Session | None = session
        self.handle: Tensor | None = handle
        self.value: torch.Tensor | None = None

    def __del__(self) -> None:
        if self.session is not None and self.handle is not None:
            self.session.refs.release(self.handle)


class RematTensor(torch.Tensor):
    """A tensor whose data the memory-budget engine may drop and regenerate.

    It keeps its :class:`Ref` in its ``__dict__`` (no ``__slots__``), so that it has the
    layout of a plain tensor and can become one in place when its session ends."""

    _ref: Ref

    @staticmethod
    def __new__(cls, value: torch.Tensor, ref: Ref) -> RematTensor:
        return wrap(value, ref)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        """Reached when no session's mode is active in this thread: run on the values."""
        for x in (*args, *(kwargs or {}).values()):
            if type(x) is RematTensor:
                _check_thread(x._ref.session)
        return func(*tree_map(value_of, args), **tree_map(value_of, kwargs or {}))

    def value(self) -> torch.Tensor:
        """The real data (recomputed if the engine had dropped it)."""
        return value_of(self)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        """As the value prints, with this tensor's autograd state (like any tensor)."""
        ref = self._ref
        if ref.value is None and (ref.session is None or ref.handle is None):
            return f"RematTensor(<value lost>, size={tuple(self.shape)}, dtype={self.dtype})"
        with _disable_current_modes():
            text = torch._tensor_str._str(value_of(self).detach(),
                                          tensor_contents=tensor_contents)
        if self.grad_fn is not None:
            return f"{text[:-1]}, grad_fn=<{type(self.grad_fn).__name__}>)"
        if self.requires_grad:
            return f"{text[:-1]}, requires_grad=True)"
        return text

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save`` too) as a plain tensor holding the value; inside its
        session, the value is kept pinned first (``Session.keep``)."""
        ref = self._ref
        if ref.session is not None and ref.session.engine is not None \
                and ref.handle is not None and ref.value is None:
            ref.session.keep(ref.handle)
        with _disable_current_modes():
            plain = value_of(self).detach()
            if self.requires_grad:
                plain.requires_grad_(True)
        return plain.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        """A copy as torch makes one (``runtime.copies``): inside its session a new value it
        owns; after it, a plain tensor."""
        from membudget.runtime.copies import deep_copy

        return deep_copy(self, memo)

    @property
    def data(self) -> torch.Tensor:
        return _base_data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """``x.data = new`` (``module.to(dtype)`` and ``.half()`` do it to the parameters of
        a model built in the session): ``x`` stands for a view of ``new``'s value from now
        on, as a plain tensor would share ``new``'s storage."""
        session = self._ref.session
        alias = None
        if session is not None and session.engine is not None and type(new) is RematTensor \
                and new._ref.session is session:
            with torch.no_grad():
                alias = new.detach()  # the session's own view of that value (this thread's)
        if type(alias) is not RematTensor:
            raise MembudgetError(
                "`.data = new` on a tensor of a membudget session takes only a tensor made "
                "in that session, while it runs in this thread; convert the model before or "
                "after the session, or write the values in (`with torch.no_grad(): "
                "x.copy_(new)`)")
        _base_data.__set__(self, alias)  # (its sizes, strides, dtype and device)
        session.refs.swap(self, alias)  # (alias, dying, lets go of what self stood for)

    def tolist(self) -> Any:
        return value_of(self).tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return value_of(self).numpy(force=force)


_make_wrapper = torch.Tensor._make_wrapper_subclass
_base_data = torch._C.TensorBase.data


def wrap(value: torch.Tensor, ref: Ref) -> RematTensor:
    """A wrapper with the metadata of ``value`` (made for every op output: kept lean)."""
    if value.layout is torch.strided and value.storage_offset() == 0:  # the defaults
        r = _make_wrapper(RematTensor, value.shape, strides=value.stride(), dtype=value.dtype,
                          device=value.device)
    else:
        r = _make_wrapper(RematTensor, value.size(), strides=value.stride(),
                          storage_offset=value.storage_offset(), dtype=value.dtype,
                          device=value.device, layout=value.layout, requires_grad=False)
    r._ref = ref
    return r


def value_of(x: Any) -> Any:
    """The real tensor behind a wrapper (materializing it); anything else unchanged."""
    if type(x) is not RematTensor:
        return x
    ref = x._ref
    if ref.value is not None:
        return ref.value
    if ref.session is None or ref.handle is None:
        raise MembudgetError("this tensor's value was lost when its membudget session failed "
                             "(it could not be recomputed); recompute it from its inputs")
    return ref.session.read(ref.handle)


def _check_thread(session: Session | None) -> None:
    """Warn, once per session, when another thread computes on its tensors: a session is
    per-thread, and that work runs outside the budget."""
    if session is None or session.engine is None or session.warned_thread:
        return
    if threading.get_ident() != session.thread:
        session.warned_thread = True
        warnings.warn(f"thread {threading.current_thread().name!r} computes on tensors of a "
                      "membudget session active in another thread: a session covers only its "
                      "own thread, so that work runs outside its budget (and must not race "
                      "with it); enter a session in that thread instead", RuntimeWarning,
                      stacklevel=3)
