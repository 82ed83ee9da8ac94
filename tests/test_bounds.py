"""The bounds on data-dependent ops' outputs hold for any data: each output of the real op is
no larger than the bound, including the extreme data (everything selected, all distinct)."""

from __future__ import annotations

import pytest
import torch

from membudget.runtime.bounds import data_dependent, largest_outputs

aten = torch.ops.aten


def _bytes(out):
    outs = out if isinstance(out, tuple | list) else (out,)
    return [o.untyped_storage().nbytes() for o in outs]


def _meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _meta_list(x):
    return [_meta(i) for i in x] if isinstance(x, list) else _meta(x)


def _calls(dense: torch.Tensor, mask: torch.Tensor):
    ints = dense.long()
    return [
        (aten.index.Tensor, (dense, [mask])),
        (aten.index.Tensor, (dense, [None, mask[0]])),
        (aten.index.Tensor, (dense, [mask[:, 0], None])),
        (aten.nonzero.default, (mask,)),
        (aten.nonzero.default, (dense,)),
        (aten.masked_select.default, (dense, mask)),
        (aten.masked_select.default, (dense, mask[0])),
        (aten._unique.default, (ints, True, True)),
        (aten._unique2.default, (ints, True, True, True)),
        (aten._unique2.default, (ints, False, False, False)),
        (aten.unique_consecutive.default, (ints, True, True)),
        (aten.unique_consecutive.default, (ints, True, True, 1)),
        (aten.unique_dim.default, (ints, 0, True, True, True)),
    ]


@pytest.mark.parametrize("seed", range(6))
def test_every_output_fits_its_bound(seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randint(-2, 3, (6, 5), generator=g).float()
    masks = [torch.rand(6, 5, generator=g) > 0.5, torch.ones(6, 5, dtype=torch.bool),
             torch.zeros(6, 5, dtype=torch.bool)]
    for mask in masks:
        for data in (dense, torch.arange(30.0).view(6, 5)):  # and all values distinct
            for func, args in _calls(data, mask):
                assert data_dependent(func, args, {})
                real = _bytes(func(*args))
                bound = _bytes(largest_outputs(func, tuple(map(_meta_list, args)), {}))
                assert len(bound) == len(real)
                assert all(r <= b for r, b in zip(real, bound, strict=True)), (func, real, bound)


def test_calls_whose_shapes_do_not_depend_on_data_are_told_apart():
    x = torch.randn(4, 3)
    assert not data_dependent(aten.index.Tensor, (x, [torch.tensor([0, 2])]), {})
    assert data_dependent(aten.index.Tensor, (x, [torch.tensor([True, False, True, True])]), {})
    assert not data_dependent(aten.one_hot.default, (torch.tensor([1, 2]), 5), {})
    assert data_dependent(aten.one_hot.default, (torch.tensor([1, 2]),), {})
    assert not data_dependent(aten.repeat_interleave.Tensor, (torch.tensor([1, 2]),),
                              {"output_size": 3})
    assert data_dependent(aten.repeat_interleave.Tensor, (torch.tensor([1, 2]),), {})
    assert largest_outputs(aten.bincount.default, (torch.tensor([1, 2]),), {}) is None
    assert not data_dependent(aten.add.Tensor, (x, x), {})
