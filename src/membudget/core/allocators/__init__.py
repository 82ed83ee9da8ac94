"""Allocators: how storages are laid out in the budget's pool. Pick one by name."""

from __future__ import annotations

from membudget.core.allocators.base import AllocationObserver, Allocator
from membudget.core.allocators.best_fit import BestFitAllocator
from membudget.core.allocators.block import Block
from membudget.core.allocators.fungible import FungibleAllocator
from membudget.core.allocators.phase_sided import PhaseSidedAllocator
from membudget.core.allocators.segregated import SegregatedAllocator
from membudget.core.allocators.size_sided import SizeSidedAllocator
from membudget.core.allocators.torch_caching import TorchCachingAllocator
from membudget.core.allocators.two_sided import TwoSidedAllocator
from membudget.errors import UnknownNameError

ALLOCATORS: dict[str, type[Allocator]] = {
    cls.name: cls for cls in (FungibleAllocator, BestFitAllocator, SegregatedAllocator,
                              TwoSidedAllocator, SizeSidedAllocator, PhaseSidedAllocator,
                              TorchCachingAllocator)
}


def layout_names() -> str:
    """The allocators with an address layout, as error messages offer them."""
    names = [name for name, cls in ALLOCATORS.items() if cls.has_layout]
    return ", ".join(names[:-1]) + " or " + names[-1]


def make_allocator(name: str, capacity: float) -> Allocator:
    """Build the allocator called ``name`` over a pool of ``capacity`` bytes."""
    try:
        cls = ALLOCATORS[name]
    except KeyError:
        raise UnknownNameError("allocator", name, sorted(ALLOCATORS)) from None
    return cls(capacity)


__all__ = ["ALLOCATORS", "AllocationObserver", "Allocator", "BestFitAllocator", "Block",
           "FungibleAllocator", "PhaseSidedAllocator", "SegregatedAllocator", "SizeSidedAllocator",
           "TorchCachingAllocator",
           "TwoSidedAllocator",
           "layout_names", "make_allocator"]
