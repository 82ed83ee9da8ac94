"""``copy.deepcopy`` inside a session (an EMA of the model, a snapshot): the copies are values
the session owns, counted against the budget and handed back as plain tensors at its end.

torch deep-copies a plain tensor by copying its storage and pointing a ``new_empty`` tensor
at the copy; under a session's mode ``new_empty`` makes a wrapper, which torch refuses, and a
copy made outside the mode would escape the budget. So while a session is active in the
thread, the copy of a tensor (plain, or a wrapper: ``RematTensor.__deepcopy__``) is a view of
the session's clone of its whole storage, shared by the tensors of one deep copy that share
that storage, as torch's copies share theirs, and it gets what torch gives a copy:
``requires_grad``, a copy of the gradient and of the tensor's attributes. A parameter's copy
is a new parameter holding a clone of its data, as ``nn.Parameter.__deepcopy__`` makes it.
After the session a wrapper that kept its value is copied as that value is.
"""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from membudget.runtime.tensor import RematTensor, value_of

_installed = False


def install(mode_type: type) -> None:
    """Deep-copy plain tensors by ``deep_copy`` while a ``mode_type`` is active in the thread;
    elsewhere ``copy.deepcopy`` calls torch's own, as before (once per process)."""
    global _installed
    if _installed:
        return

    def deepcopy_plain(x: torch.Tensor, memo: dict) -> torch.Tensor:
        if not (x.layout is torch.strided and not x.is_quantized and not x.is_conj()
                and not x.is_neg()
                and any(isinstance(m, mode_type) for m in _get_current_dispatch_mode_stack())):
            return x.__deepcopy__(memo)
        return deep_copy(x, memo)

    copy._deepcopy_dispatch[torch.Tensor] = deepcopy_plain  # (exactly torch.Tensor)
    _installed = True


def deep_copy(x: torch.Tensor, memo: dict) -> torch.Tensor:
    """``copy.deepcopy(x)`` as the module says."""
    if not x.is_leaf:
        return torch.Tensor.__deepcopy__(x, memo)  # torch's own refusal, with its reason
    if id(x) in memo:
        return memo[id(x)]
    with torch.no_grad():
        if x.__dict__.get("_is_param", False):  # a wrapper made by nn.Parameter
            memo[id(x)] = torch.nn.Parameter(x.clone(), x.requires_grad)
            return memo[id(x)]
        new = _copy_data(x, memo)
    if x.requires_grad:
        new.requires_grad_()
    memo[id(x)] = new
    if x.grad is not None:
        new.grad = copy.deepcopy(x.grad, memo)
    new.__dict__.update(copy.deepcopy(
        {k: v for k, v in x.__dict__.items() if k != "_ref"}, memo))
    return new


def _copy_data(x: torch.Tensor, memo: dict) -> torch.Tensor:
    """A copy of ``x``'s data: a view of the copy of its whole storage, made once per deep
    copy. In a session that is the engine's storage (a plain tensor is taken in first, so
    that its copy and a wrapper's that views it are one); after it, a wrapper's value's."""
    if type(x) is not RematTensor:  # (in a session: a wrapper now, or a plain tensor in a
        x = x.as_strided(x.size(), x.stride(), x.storage_offset())  # replay, which has none)
    handle = x._ref.handle if type(x) is RematTensor else None
    if handle is None:
        x = value_of(x)
        st = x.untyped_storage()
        where, nbytes = st._cdata, st.nbytes()
    else:
        where, nbytes = id(handle.storage), handle.storage.nbytes
    key = ("membudget: the copy of a storage", where, x.dtype)
    whole = memo.get(key)
    if whole is None:
        n = nbytes // x.element_size()
        source = x if x.storage_offset() == 0 and x.is_contiguous() and x.numel() == n \
            else x.as_strided((n,), (1,), 0)
        whole = memo[key] = source.clone()
        if source is x:
            return whole
    return whole.as_strided(x.size(), x.stride(), x.storage_offset())
