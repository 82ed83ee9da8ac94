"""The allocator interface: where (and whether) a storage's bytes fit in the budget's pool."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

from membudget.core.allocators.block import unlink
from membudget.core.records import Storage

if TYPE_CHECKING:
    from membudget.core.allocators.block import Block
    from membudget.core.pool import CandidatePool


class AllocationObserver(Protocol):
    """Receives every placement and release (timelines, memory snapshots)."""

    def on_alloc(self, s: Storage, block: Block) -> None: ...

    def on_free(self, s: Storage, block: Block) -> None: ...

    def on_segment(self, action: str, addr: int, size: int) -> None:
        """``action`` is "segment_alloc" or "segment_free" (pools that reserve segments)."""


class Allocator(ABC):
    """Places storages in a pool of ``capacity`` bytes and tracks bytes held and their peak.

    ``allocate`` either places the storage and returns True or changes nothing and returns
    False; the engine then evicts and retries. Layout-aware allocators (``has_layout``) give
    each placed storage a :class:`Block`, keep ``storage.free_adj`` (free bytes directly
    around it) current, and mark the storage stale in the candidate pool the engine attaches.
    """

    name: str = ""
    has_layout: bool = False

    def __init__(self, capacity: float) -> None:
        if capacity < 0:
            raise ValueError(f"allocator capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self.pool: CandidatePool | None = None
        self.observer: AllocationObserver | None = None

    @abstractmethod
    def allocate(self, s: Storage) -> bool:
        """Place ``s`` (``s.nbytes`` bytes); False, with nothing changed, if it does not fit."""

    @abstractmethod
    def free(self, s: Storage) -> None:
        """Return the bytes of a placed storage to the pool."""

    @abstractmethod
    def transfer(self, old: Storage, new: Storage) -> None:
        """``new`` takes over the bytes and place of ``old`` (an in-place update)."""

    @property
    def free_bytes(self) -> float:
        """Bytes of the pool not held by any storage (usable or not)."""
        return self.capacity - self.used

    def largest_free_block(self) -> float:
        """The largest request that could be placed right now without evicting."""
        return self.free_bytes

    def block_bytes(self, nbytes: int) -> int:
        """Size of the contiguous block a storage of ``nbytes`` needs (after rounding)."""
        return nbytes

    def layout(self, request: Storage | None = None) -> list[Block]:
        """Every block in address order; with ``request``, only those that could hold it."""
        raise NotImplementedError(
            f"the {self.name!r} allocator has no address layout; use a layout-aware one "
            "(best-fit, two-sided or torch-caching)")


class LayoutAllocator(Allocator):
    """An allocator that gives every placed storage a :class:`Block` of an address-ordered
    layout; shared here: handing a block to a new version, and the free-neighbour bytes."""

    has_layout = True

    def transfer(self, old: Storage, new: Storage) -> None:
        """``new`` takes over ``old``'s block as it is (no re-rounding, no move)."""
        b = old.block
        if b is None:
            return
        if self.observer is not None:
            self.observer.on_free(old, b)
        old.block = None
        b.storage = new
        new.block = b
        new.free_adj = old.free_adj
        if self.observer is not None:
            self.observer.on_alloc(new, b)

    def _unindex(self, b: Block) -> None:
        """Take a free block out of the allocator's index of free blocks."""
        raise NotImplementedError

    def _release(self, s: Storage) -> Block | None:
        """Free the block of ``s`` and merge it with free neighbours (same segment only:
        ``prev``/``next`` never cross one); return the merged free block, to be indexed."""
        b = s.block
        if b is None:
            return None
        if self.observer is not None:
            self.observer.on_free(s, b)
        s.block = None
        b.storage = None
        self.used -= b.size
        prev, nxt = b.prev, b.next
        if prev is not None and prev.storage is None:
            self._unindex(prev)
            prev.size += b.size
            unlink(b)
            b = prev
        if nxt is not None and nxt.storage is None:
            self._unindex(nxt)
            b.size += nxt.size
            unlink(nxt)
        return b

    def _refresh_around(self, b: Block) -> None:
        """Recompute ``free_adj`` of the storages in ``b`` and in the blocks beside it."""
        for x in (b.prev, b, b.next):
            if x is not None and x.storage is not None:
                self._refresh(x)

    def _refresh(self, b: Block) -> None:
        """Recompute ``free_adj`` of the storage in ``b`` (marking its pool row stale)."""
        s = b.storage
        assert s is not None
        p, n = b.prev, b.next
        adj = (p.size if p is not None and p.storage is None else 0) + (
            n.size if n is not None and n.storage is None else 0)
        if adj != s.free_adj:
            s.free_adj = adj
            if s.slot >= 0 and self.pool is not None:
                self.pool.stale.append(s)
