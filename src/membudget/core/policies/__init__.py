"""Eviction policies, each one small module behind :class:`Policy`. Pick one by name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from membudget.core.policies.base import Policy
from membudget.core.policies.compact import DTRCompact
from membudget.core.policies.coop import Coop
from membudget.core.policies.dte import DTE
from membudget.core.policies.dtr import DTR
from membudget.core.policies.dtr_eq import DTREq
from membudget.core.policies.dtr_local import DTRLocal
from membudget.core.policies.future import DTRFuture
from membudget.core.policies.megengine import MegEngine
from membudget.core.policies.msps import MSPS
from membudget.core.policies.simple import LRU, Random, Size
from membudget.errors import MembudgetError, UnknownNameError

POLICIES: dict[str, Callable[..., Policy]] = {
    cls.name: cls for cls in (DTR, DTREq, DTRLocal, MSPS, LRU, Size, DTE, Coop, DTRCompact,
                              DTRFuture)
}
POLICIES["dtr-future-stale"] = partial(DTRFuture, staleness=True)
POLICIES["dtr-future-time"] = partial(DTRFuture, by_time=True)
POLICIES["random"] = Random
POLICIES["megengine"] = MegEngine
POLICIES["megengine-sqrt"] = partial(MegEngine, sqrt_sampling=True)
# dtr-compact's ablations (docs/results/address-aware.md): Coop's window as the fallback,
# only the cheapest run checked for room, no sliding, sliding only when nothing is left to
# evict, moves never weighed against evicting, or weighed against the window's whole
# recomputation cost
POLICIES["dtr-compact-window"] = partial(DTRCompact, fallback="window")
POLICIES["dtr-compact-1run"] = partial(DTRCompact, tries=1)
POLICIES["dtr-compact-noslide"] = partial(DTRCompact, slide="never")
POLICIES["dtr-compact-lastslide"] = partial(DTRCompact, slide="last")
POLICIES["dtr-compact-moves"] = partial(DTRCompact, remat_share=None)
POLICIES["dtr-compact-share1"] = partial(DTRCompact, remat_share=1.0)
SEEDED = {"random", "megengine", "megengine-sqrt"}
#: What ``policy="default"`` means, here and only here: DTR's choices with fragmentation
#: undone by moving live tensors (``dtr-compact``, on a best-fit pool). On an address-ordered
#: pool it comes closest to what DTR reaches on the ideal fungible one (see
#: docs/results/address-aware.md), and without addresses it is DTR.
DEFAULT_POLICY = "dtr-compact"
#: The heuristics whose schedules of a recorded step are compared by the planners (planned
#: mode's default planner and ``membudget optimum``): the cheapest is followed.
SCHEDULE_CANDIDATES = ("dtr-eq", "dtr", "dtr-local", "msps", "dtr-future", "dtr-future-stale",
                       "dtr-future-time")


def resolve_policy(name: str) -> str:
    """``name``, or the policy that "default" stands for."""
    return DEFAULT_POLICY if name == "default" else name


def make_policy(name: str, *, seed: int = 0, **options: Any) -> Policy:
    """Build the policy called ``name``; ``seed`` feeds the randomized ones; ``options`` are
    keyword arguments of its class (e.g. ``alpha=2.0`` for megengine)."""
    name = resolve_policy(name)
    try:
        factory = POLICIES[name]
    except KeyError:
        raise UnknownNameError("policy", name, [*POLICIES, "default"]) from None
    try:
        return factory(seed, **options) if name in SEEDED else factory(**options)
    except TypeError as e:
        raise MembudgetError(f"bad options {options} for policy {name!r}: {e}") from None


__all__ = ["DEFAULT_POLICY", "POLICIES", "SCHEDULE_CANDIDATES", "Policy", "make_policy",
           "resolve_policy"]
