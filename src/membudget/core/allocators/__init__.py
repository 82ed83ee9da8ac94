"""Allocators: how storages are laid out in the budget's pool. Pick one by name."""

from __future__ import annotations

from membudget.core.allocators.base import Allocator
from membudget.core.allocators.fungible import FungibleAllocator
from membudget.errors import UnknownNameError

ALLOCATORS: dict[str, type[Allocator]] = {
    FungibleAllocator.name: FungibleAllocator,
}


def make_allocator(name: str, capacity: float) -> Allocator:
    """Build the allocator called ``name`` over a pool of ``capacity`` bytes."""
    try:
        cls = ALLOCATORS[name]
    except KeyError:
        raise UnknownNameError("allocator", name, sorted(ALLOCATORS)) from None
    return cls(capacity)


__all__ = ["ALLOCATORS", "Allocator", "FungibleAllocator", "make_allocator"]
