"""Eviction policies, each one small module behind :class:`Policy`. Pick one by name."""

from __future__ import annotations

from membudget.core.policies.base import Policy
from membudget.core.policies.dtr import DTR
from membudget.core.policies.dtr_eq import DTREq
from membudget.core.policies.dtr_local import DTRLocal
from membudget.core.policies.msps import MSPS
from membudget.core.policies.simple import LRU, Random, Size
from membudget.errors import UnknownNameError

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (DTR, DTREq, DTRLocal, MSPS, LRU, Size, Random)
}


def make_policy(name: str, *, seed: int = 0) -> Policy:
    """Build the policy called ``name``; ``seed`` feeds the randomized ones."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise UnknownNameError("policy", name, POLICIES) from None
    return cls(seed) if cls is Random else cls()


__all__ = ["POLICIES", "Policy", "make_policy"]
