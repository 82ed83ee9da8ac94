"""Eviction policies, each one small module behind :class:`Policy`. Pick one by name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from membudget.core.policies.base import Policy
from membudget.core.policies.coop import Coop
from membudget.core.policies.dte import DTE
from membudget.core.policies.dtr import DTR
from membudget.core.policies.dtr_eq import DTREq
from membudget.core.policies.dtr_local import DTRLocal
from membudget.core.policies.megengine import MegEngine
from membudget.core.policies.msps import MSPS
from membudget.core.policies.simple import LRU, Random, Size
from membudget.errors import MembudgetError, UnknownNameError

POLICIES: dict[str, Callable[..., Policy]] = {
    cls.name: cls for cls in (DTR, DTREq, DTRLocal, MSPS, LRU, Size, DTE, Coop)
}
POLICIES["random"] = Random
POLICIES["megengine"] = MegEngine
POLICIES["megengine-sqrt"] = partial(MegEngine, sqrt_sampling=True)
SEEDED = {"random", "megengine", "megengine-sqrt"}


def make_policy(name: str, *, seed: int = 0, **options: Any) -> Policy:
    """Build the policy called ``name``; ``seed`` feeds the randomized ones; ``options`` are
    keyword arguments of its class (e.g. ``alpha=2.0`` for megengine)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise UnknownNameError("policy", name, POLICIES) from None
    try:
        return factory(seed, **options) if name in SEEDED else factory(**options)
    except TypeError as e:
        raise MembudgetError(f"bad options {options} for policy {name!r}: {e}") from None


__all__ = ["POLICIES", "Policy", "make_policy"]
