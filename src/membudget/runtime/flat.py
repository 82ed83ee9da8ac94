"""Flattening aten arguments and results, one level deep (the runtime's hot path).

Aten ops take tensors directly or in lists (``cat``, ``_foreach_*``) and return a tensor, or
a tuple or list of them; one level is all there is, so this is much cheaper than a general
pytree walk. ``Spec`` records which positions were sequences so the structure comes back;
it is None for the commonest call, positional arguments with no sequence among them.
"""

from __future__ import annotations

from typing import Any

import torch

Spec = tuple | None  # (per-arg layout, kwarg names, per-kwarg layout), or None: args as is
NO_KWARGS: dict[str, Any] = {}  # the kwargs of a call without any: shared, never written
# What the dispatcher hands a mode for a list argument (Tensor[], int[], ...): exact types,
# so a set lookup replaces isinstance (which costs more, on every argument of every op).
SEQUENCES = frozenset((list, tuple))
# The commonest non-tensor arguments, recognised by exact type before an isinstance test
# against torch.Tensor (which goes through torch's metaclass).
SCALARS = frozenset((int, float, bool, type(None), torch.dtype, torch.device, torch.layout,
                     torch.memory_format))


def _expand(x: Any, leaves: list[Any]) -> Any:
    """Append the leaves of one argument; return its layout (None: itself a leaf). A list
    of ints (a shape, dims: the commonest list) is known by its first element."""
    if type(x) in SEQUENCES and x and type(x[0]) is not int:
        for e in x:
            if isinstance(e, torch.Tensor):
                leaves.extend(x)
                return (type(x), len(x))
    leaves.append(x)
    return None


def flatten(args: tuple, kwargs: dict) -> tuple[list[Any], Spec]:
    if not kwargs:
        for a in args:
            if type(a) in SEQUENCES:
                break
        else:
            return list(args), None
    leaves: list[Any] = []
    arg_layout = tuple([_expand(a, leaves) for a in args])
    if not kwargs:
        return leaves, (arg_layout, (), ())
    names = tuple(kwargs)
    return leaves, (arg_layout, names, tuple([_expand(kwargs[k], leaves) for k in names]))


def unflatten(leaves: list[Any], spec: Spec) -> tuple[tuple, dict]:
    if spec is None:
        return tuple(leaves), {}
    arg_layout, names, kw_layout = spec
    it = iter(leaves)
    args = tuple(next(it) if lay is None else lay[0](next(it) for _ in range(lay[1]))
                 for lay in arg_layout)
    if not names:
        return args, {}
    return args, {k: next(it) if lay is None else lay[0](next(it) for _ in range(lay[1]))
                  for k, lay in zip(names, kw_layout, strict=True)}


def flatten_result(out: Any) -> tuple[list[Any], type | None]:
    """The leaves of an op's result and its container type (None: a single value)."""
    if isinstance(out, (tuple, list)):
        return list(out), type(out)
    return [out], None

