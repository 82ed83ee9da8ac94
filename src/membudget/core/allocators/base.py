"""The allocator interface: where (and whether) a storage's bytes fit in the budget's pool."""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Protocol

from mypy_extensions import mypyc_attr

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


@mypyc_attr(allow_interpreted_subclasses=True)  # (compiled: see setup.py)
class Allocator(ABC):
    """Places storages in a pool of ``capacity`` bytes and tracks bytes held and their peak.

    ``allocate`` either places the storage and returns True or changes nothing and returns
    False; the engine then evicts and retries. Layout-aware allocators (``has_layout``) give
    each placed storage a :class:`Block` and, when the free bytes directly around a candidate
    change (``Storage.free_adj``, read from the layout), mark its row stale in ``pool``, the
    candidate pool the engine attaches when its policy reads those bytes (None otherwise).
    """

    name: ClassVar[str] = ""
    has_layout: ClassVar[bool] = False
    keeps_pinned_apart: ClassVar[bool] = False  # pinned blocks kept together, away from the rest
    compacts: ClassVar[bool] = False  # ``compact`` can gather the free bytes

    def __init__(self, capacity: float) -> None:
        if capacity < 0:
            raise ValueError(f"allocator capacity must be >= 0 bytes, got {capacity}")
        self.capacity: int | float = capacity  # (an int where a pool is laid out in bytes)
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

    def segment_deficit(self, nbytes: int) -> int | None:
        """For a pool that reserves segments: the bytes of whole segments that must be
        emptied (and released) before a new segment for a request of ``nbytes`` fits;
        None for a pool without segments."""
        return None

    def left_after(self, hole: Block, left: int, size: int) -> int:
        """Free bytes a hole with ``left`` free bytes keeps after a moved block of ``size``
        bytes is carved from it (the rest of the hole, unless the pool would not split it)."""
        return left - size

    def make_way(self, nbytes: int, copy: Callable[[Storage], None]) -> None:
        """Before a leaf of ``nbytes`` is placed: move storages out of the place where it
        belongs, and ``copy`` each; nothing here (a pool with no such place)."""

    def relocate(self, moves: list[tuple[Storage, Block]],
                 copy: Callable[[Storage], None]) -> None:
        """Move each resident storage to a new block carved from the high end of its free
        ``hole`` (several may share one), ``copy`` its data there, then free the old
        blocks: both are held while the data moves, and the holes are all carved before any
        old block merges with a free neighbour, so none of them changes under the moves.
        The caller checked that each hole holds what it is given."""
        raise NotImplementedError(f"the {self.name!r} allocator cannot move storages")

    def slide(self, storages: list[Storage], copy: Callable[[Storage], None]) -> None:
        """Move each resident storage (in address order) down to the low end of the free
        block just before it, if there is one, and ``copy`` its data there: the free bytes
        of a run of blocks gather after its storages. The new block overlaps the old one,
        so the copy goes through other memory: the caller leaves room for it."""
        raise NotImplementedError(f"the {self.name!r} allocator cannot move storages")

    def compact(self, need: int, copy: Callable[[Storage], None]) -> None:
        """Move the movable storages (``Storage.movable``), in address order, each down to
        the lowest free block before it that holds it, else into the free block just before
        it (as ``slide`` does, when the free bytes leave room for the copy), and ``copy``
        their data, until a free block of ``need`` bytes exists or every one has been tried:
        the free bytes gather at the tops of the runs between storages that cannot move."""
        raise NotImplementedError(f"the {self.name!r} allocator cannot compact its pool")

    def layout(self, request: Storage | None = None) -> list[Block]:
        """Every block in address order; with ``request``, only those that could hold it."""
        from membudget.core.allocators import layout_names  # (the registry imports this)

        raise NotImplementedError(f"the {self.name!r} allocator has no address layout; use a "
                                  f"layout-aware one ({layout_names()})")


@mypyc_attr(allow_interpreted_subclasses=True)
class LayoutAllocator(Allocator):
    """An allocator that gives every placed storage a :class:`Block` of an address-ordered
    layout; shared here: handing a block to a new version, and marking the candidates whose
    free-neighbour bytes a placement or a free changed."""

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
        if self.observer is not None:
            self.observer.on_alloc(new, b)

    def _mark_beside(self, b: Block) -> None:
        """The free bytes beside the blocks around ``b`` changed: mark the pool rows of the
        storages in them stale (a storage being placed is never a candidate yet)."""
        pool = self.pool
        if pool is None:
            return
        for x in (b.prev, b.next):
            if x is not None:
                s = x.storage
                if s is not None and s.slot >= 0:
                    pool.stale.append(s)

    def _check_rows(self) -> None:
        """Assert that every candidate whose pool row is not marked stale has its current
        ``free_adj`` in that row (the allocator marked every row it changed)."""
        pool = self.pool
        if pool is None:
            return
        stale = set(pool.stale)
        for s in pool.items:
            if s not in stale:
                assert pool.free_adj[s.slot] == s.free_adj, f"unmarked free_adj of {s}"


def fit_into(alloc: Allocator, blocks: list[Block], holes: list[int],
             movers: list[Storage]) -> list[tuple[Storage, Block]] | None:
    """Best fit, largest first, of ``movers`` into the free blocks ``blocks[k]`` for ``k``
    in ``holes``; None if one fits nowhere."""
    left = sorted((blocks[k].size, k) for k in holes)
    plan = []
    for s in sorted(movers, key=lambda s: -s.nbytes):
        size = alloc.block_bytes(s.nbytes)
        at = bisect_left(left, (size, -1))
        if at == len(left):
            return None
        room, k = left.pop(at)
        plan.append((s, blocks[k]))
        room = alloc.left_after(blocks[k], room, size)
        if room:
            insort(left, (room, k))
    return plan
