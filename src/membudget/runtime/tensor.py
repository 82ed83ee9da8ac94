"""The wrapper tensor: what autograd and the user hold while the engine owns the data.

A :class:`RematTensor` has the metadata of its value (size, strides, dtype, device) but no
storage of its own; its :class:`Ref` names the engine tensor whose real value the executor
keeps, may drop and may recompute. Autograd saves wrappers, so dropping a value frees memory
that a saved activation would otherwise pin. When a session closes, every live wrapper takes
its value with it, and ops on it then run on that value as on a plain tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
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
            self.session.release(self.handle)


class RematTensor(torch.Tensor):
    """A tensor whose data the memory-budget engine may drop and regenerate."""

    __slots__ = ("_ref",)
    _ref: Ref

    @staticmethod
    def __new__(cls, value: torch.Tensor, ref: Ref) -> RematTensor:
        return wrap(value, ref)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        """Reached only when no session's mode is active: run on the values directly."""
        return func(*tree_map(value_of, args), **tree_map(value_of, kwargs or {}))

    def value(self) -> torch.Tensor:
        """The real data (recomputed if the engine had dropped it)."""
        return value_of(self)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"RematTensor({value_of(self)!r})"

    def tolist(self) -> Any:
        return value_of(self).tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return value_of(self).numpy(force=force)


_make_wrapper = torch.Tensor._make_wrapper_subclass


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
        raise MembudgetError("this tensor belonged to a membudget session that ended with an "
                             "error; its value is gone")
    return ref.session.read(ref.handle)
