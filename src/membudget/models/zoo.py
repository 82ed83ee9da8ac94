"""The benchmark zoo's registry: each model is a function of the batch size that returns
(model, example batch, loss function), so that one training step is ``loss(model, batch)``
then backward then an optimizer step.

Builders create every tensor on the current default device (no ``device=`` arguments), so
the same builder makes a real model, a meta one (``with torch.device("meta")``) or a fake one
(under ``FakeTensorMode``), from random init and configs only: nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple

import torch

from membudget.errors import UnknownNameError


class Workload(NamedTuple):
    """One training step's ingredients: ``loss(model, batch)`` is a scalar to differentiate."""

    model: torch.nn.Module
    batch: Any
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class ZooModel:
    """A zoo entry. ``batch`` is the paper's batch size (the default); ``small_batch`` a
    batch at which one live step takes seconds on a 2-core CPU; ``paper`` names the papers
    that report it; ``build(batch)`` makes the workload."""

    name: str
    build: Callable[[int], Workload]
    batch: int
    small_batch: int
    paper: str
    description: str


ZOO: dict[str, ZooModel] = {}


def register(entry: ZooModel) -> ZooModel:
    if entry.name in ZOO:
        raise ValueError(f"zoo model {entry.name!r} registered twice")
    ZOO[entry.name] = entry
    return entry


def get(name: str) -> ZooModel:
    """The zoo entry called ``name``; an unknown name lists the known ones."""
    _load()
    try:
        return ZOO[name]
    except KeyError:
        raise UnknownNameError("zoo model", name, ZOO) from None


def names() -> list[str]:
    _load()
    return list(ZOO)


def build(name: str, batch: int | None = None) -> Workload:
    """The workload of zoo model ``name`` at ``batch`` (its paper batch size by default)."""
    entry = get(name)
    return entry.build(entry.batch if batch is None else batch)


@cache
def param_count(name: str) -> int:
    """Parameters of zoo model ``name``, counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in get(name).build(1).model.parameters())


def _load() -> None:
    """Import the modules that register zoo entries (on first use: they import transformers)."""
    from membudget.models import custom, hf, reversible  # noqa: F401
