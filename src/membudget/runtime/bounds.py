"""The most an op whose output shapes depend on its data can make, known before it runs.

Torch tags such ops ``dynamic_output_shape`` (nonzero, unique, masked_select, indexing, ...).
Most of them cannot make more than their inputs' shapes allow: indexing by a boolean mask
selects at most every element, unique returns at most every value. The engine makes room for
that much before such an op runs, so the budget holds while it runs, and the outputs are
resized to what the op really made afterwards. Some tagged ops are not data-dependent for
every call (indexing by integer tensors, ``one_hot`` with a class count): those are sized
exactly, like any op. Only ops whose sizes come from values (``bincount``, ``one_hot``
without a class count, ``repeat_interleave`` without an output size) have no bound.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from math import prod
from typing import Any

import torch

aten = torch.ops.aten
_MASKS = (torch.bool, torch.uint8)


def bound_arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call by name, defaults filled in from the op's schema."""
    bound: dict[str, Any] = {}
    for k, a in enumerate(func._schema.arguments):
        if k < len(args):
            bound[a.name] = args[k]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    return bound


@cache
def dynamic_shape(func: Any) -> bool:
    """May the op's output shapes depend on its data?"""
    return torch.Tag.dynamic_output_shape in func.tags


def data_dependent(func: Any, args: tuple, kwargs: dict) -> bool:
    """Do the output shapes of this call depend on its inputs' values? (An op tagged
    ``dynamic_output_shape`` may not, for given argument types.)"""
    if not dynamic_shape(func):
        return False
    a = bound_arguments(func, args, kwargs)
    if func is aten.index.Tensor:
        return any(i is not None and i.dtype in _MASKS for i in a["indices"])
    if func is aten.one_hot.default:
        return a["num_classes"] < 0
    if func is aten.repeat_interleave.Tensor:
        return a["output_size"] is None
    return True


def _empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _index(a: dict[str, Any]) -> torch.Tensor:
    # a mask of k dims selects at most all its elements: as k integer indices that long
    indices = []
    for i in a["indices"]:
        if i is not None and i.dtype in _MASKS:
            indices.extend([_empty((i.numel(),), torch.long)] * i.dim())
        else:
            indices.append(i)
    return aten.index.Tensor(a["self"], indices)


def _unique(a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    x = a["self"]
    dim = a.get("dim")
    along = x.numel() if dim is None else x.shape[dim]
    values = _empty((x.numel(),) if dim is None else x.shape, x.dtype)
    inverse = (x.shape if dim is None else (along,)) if a.get("return_inverse") else (0,)
    counts = (along,) if a.get("return_counts") else (0,)
    return values, _empty(inverse, torch.long), _empty(counts, torch.long)


_BOUNDS: dict[Any, Callable[[dict[str, Any]], Any]] = {
    aten.index.Tensor: _index,
    aten.nonzero.default: lambda a: _empty((a["self"].numel(), a["self"].dim()), torch.long),
    aten.masked_select.default: lambda a: _empty(
        (prod(torch.broadcast_shapes(a["self"].shape, a["mask"].shape)),), a["self"].dtype),
    aten._unique.default: lambda a: _unique(a)[:2],
    aten._unique2.default: _unique,
    aten.unique_consecutive.default: _unique,
    aten.unique_dim.default: _unique,
}


def largest_outputs(func: Any, args: tuple, kwargs: dict) -> Any:
    """Meta tensors as large as the outputs of a data-dependent call can be (in the op's
    result structure), from its meta arguments; None where nothing bounds them."""
    bound = _BOUNDS.get(func)
    return None if bound is None else bound(bound_arguments(func, args, kwargs))
