"""``dtr-compact``: DTR's choices on an address-ordered pool, with fragmentation undone by moves.

Victims are chosen as DTR chooses them on a fungible pool: one at a time, by h_DTR, until the
pool's free bytes cover the request. When they do and no single free block is big enough, the
free bytes are made contiguous by moving live tensors instead of evicting more: among the runs
of blocks that would cover the request once emptied, the one with the fewest bytes to move
whose tensors all fit in the free blocks outside it (best fit, largest first) is emptied,
unless evicting the cheapest covering run instead (Coop's window, scored with DTR's exact
e*) costs less: its recomputation cost, counted at ``remat_share`` of its full amount
(0.1, a weight tuned on the benchmark, not the chance of a recomputation: nearly every
victim the policy evicts is recomputed), against the copies' price. On a pool of segments,
whole segments are emptied so that a new one fits. A copy costs one read and one write of
the bytes, far less than recomputing them, and the copies that empty one run are
independent, so they share one launch (``Executor.batch_price``); the run pays DTR's
recomputations plus the copies: what DTR pays on the ideal fungible pool, plus the price of
the addresses. Leaves never move (their memory is the program's).

Where no run can be emptied into the holes outside it, the storages of the run whose free
bytes alone cover the request can be slid together, so that its free bytes merge at its end;
that copies much more. The policy then rents before it buys, as in the ski-rental problem:
it evicts DTR's victims (whose eviction may open a block where moves could not) while their
recomputation cost (own cost plus e*), summed over this allocation, stays below the slide's
price, and slides once it does not, or when nothing is left to evict. Evicting alone can go
on long after the free bytes cover the request, and each victim deepens later recomputation
chains; sliding at once pays for copies that one eviction would have saved. (``slide="last"``
slides only when nothing is left to evict, ``"never"`` never; ``fallback="window"`` evicts
Coop's cheapest covering run instead of DTR's victim.) Its pool keeps pinned storages at the
top (``segregated``), so that parameters adopted in the middle of a step do not split the
activations' space. When nothing is left to evict and no run gathers the request, the
engine compacts the pool as a last resort (``Allocator.compact``), moving storages across the
leaves that split it.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from membudget.core.allocators.base import Allocator, fit_into
from membudget.core.allocators.block import Block
from membudget.core.policies.coop import cheapest_eviction_window, covering_runs
from membudget.core.policies.dtr import DTR
from membudget.core.pool import CandidatePool
from membudget.core.records import Storage
from membudget.errors import MembudgetError

_size = attrgetter("size")
_segment = attrgetter("segment")
_storage = attrgetter("storage")
FALLBACKS = ("dtr", "window")
SLIDES = ("rent", "last", "never")
#: Share of a covering window's recomputation cost weighed against moving instead, tuned on
#: the address-aware benchmark's traces (cells within 1.10x of DTR on the fungible pool, of
#: 119, with one launch per batch of moves: 69 at 0.2, 76 at 0.15, 80 at 0.1, 76 at 0.07).
#: It is not the chance that an evicted value is recomputed: of the policy's victims on five
#: traces at 0.9, 0.6 and 0.3 of their peaks, 81-100 % of the cost was recomputed. Weighing
#: the window whole where the free bytes exceed the request by more than 2, 5 or 10 % of the
#: pool (no eviction is due yet) did worse: 72, 71 and 78 cells.
REMAT_SHARE = 0.1


class DTRCompact(DTR):
    name = "dtr-compact"
    relocates = True
    default_allocator = "segregated"

    def __init__(self, fallback: str = "dtr", tries: int = 8, slide: str = "rent",
                 remat_share: float | None = REMAT_SHARE) -> None:
        """``fallback``: what to evict when free bytes cover the request but no run can be
        emptied by moves; ``tries``: cheapest runs checked for room per search; ``slide``:
        when a run's storages are slid together (:data:`SLIDES`; "last" and "never" are
        ablations); ``remat_share``: the
        share of a covering window's recomputation cost weighed against the price of the
        moves that would make room instead (None: always move, an ablation)."""
        if fallback not in FALLBACKS:
            raise MembudgetError(f"unknown fallback {fallback!r}; known: {', '.join(FALLBACKS)}")
        if slide not in SLIDES:
            raise MembudgetError(f"unknown slide {slide!r}; known: {', '.join(SLIDES)}")
        if tries < 1:
            raise MembudgetError(f"tries must be >= 1, got {tries}")
        if remat_share is not None and not remat_share > 0:
            raise MembudgetError(f"remat_share must be > 0 or None, got {remat_share}")
        super().__init__()
        self.fallback = fallback
        self.tries = tries
        self.slide = slide
        self.remat_share = remat_share
        self._window: list[Storage] = []  # evicted in place of moves, by the next victims()
        self._renting = (-1, 0.0)  # (allocation, victims' cost so far) while a slide waits

    def relocations(self, pool: CandidatePool, clock: float,
                    request: Storage) -> list[tuple[Storage, Block | None]]:
        alloc = self.engine.allocator
        need = alloc.block_bytes(request.nbytes)
        self._window = []
        if not alloc.has_layout or alloc.free_bytes < need:
            return []
        blocks = alloc.layout(request)
        moves: list[tuple[Storage, Block | None]] = []
        moves.extend(emptying_moves(alloc, blocks, need, self.tries))
        if moves and self.remat_share is not None:
            self._window = self._cheaper_window(pool, clock, blocks, need, moves)
            if self._window:
                return []
        if not moves and self.slide != "never" and (self.slide == "rent" or not pool.items):
            slid: list[tuple[Storage, Block | None]] = [
                (s, None) for s in sliding_moves(blocks, need, int(alloc.free_bytes))]
            if slid and pool.items and self._rent(slid):
                return []
            moves.extend(slid)
        deficit = alloc.segment_deficit(request.nbytes)
        if not moves and deficit:
            moves.extend(evacuating_moves(alloc, blocks, deficit))
        return moves

    def _rent(self, slid: list[tuple[Storage, Block | None]]) -> bool:
        """Evict the fallback's victims (by the next ``victims()``, which counts their
        recomputation cost) instead of sliding, while their cost in this allocation stays
        below the slide's price?"""
        allocation = self.engine.stats.failed_allocations
        at, spent = self._renting
        if at != allocation:
            self._renting = (allocation, 0.0)
            spent = 0.0
        price = self.engine.executor.move_price
        return spent < sum(price(s) for s, _ in slid)

    def _cheaper_window(self, pool: CandidatePool, clock: float, blocks: list[Block],
                        need: int, moves: list[tuple[Storage, Block | None]]
                        ) -> list[Storage]:
        """The storages of the cheapest covering run to evict, if their recomputation (own
        cost plus evicted neighbourhood, times ``remat_share``) costs less than ``moves``;
        else none."""
        assert self.remat_share is not None
        copies = self.engine.executor.batch_price([s for s, _ in moves])
        run = cheapest_eviction_window(self, pool, clock, blocks, need)
        if run is None:
            return []
        inside = [b.storage for b in blocks[run[0]: run[1] + 1] if b.storage is not None]
        remat = sum(float(pool.cost[s.slot]) + self.neighbour_cost(s) for s in inside)
        return inside if remat * self.remat_share < copies else []

    def victims(self, pool: CandidatePool, clock: float, request: Storage) -> list[Storage]:
        chosen = ([s for s in self._window if s.slot >= 0]  # chosen just now
                  or self._fallback(pool, clock, request))
        self._window = []
        at, spent = self._renting
        if at == self.engine.stats.failed_allocations:  # evicting before a slide
            self._renting = (at, spent + sum(float(pool.cost[s.slot]) + self.neighbour_cost(s)
                                             for s in chosen))
        return chosen

    def _fallback(self, pool: CandidatePool, clock: float, request: Storage) -> list[Storage]:
        alloc = self.engine.allocator
        need = alloc.block_bytes(request.nbytes)
        if self.fallback == "window" and alloc.has_layout and alloc.free_bytes >= need:
            blocks = alloc.layout(request)
            run = cheapest_eviction_window(self, pool, clock, blocks, need)
            if run is not None:
                return [b.storage for b in blocks[run[0]: run[1] + 1] if b.storage is not None]
        return [self.choose(pool, clock)]


def _runs(blocks: list[Block], need: int, free_only: bool, room: int | None = None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of ``blocks`` between storages that cannot move (and segment boundaries)
    that cover ``need`` bytes, each the shortest ending where it ends (``covering_runs``):
    counting free and movable bytes, or (``free_only``) free bytes alone. Returns their
    starts, ends and the bytes of movable storages in each. With ``room``, a storage of
    more bytes than that cannot move."""
    n = len(blocks)
    sizes = np.fromiter(map(_size, blocks), dtype=np.int64, count=n)
    free = np.array([b.storage is None for b in blocks])
    movable = np.array([s is not None and s.movable and (room is None or s.nbytes <= room)
                        for s in map(_storage, blocks)])
    segments = (None if blocks[0].segment == blocks[-1].segment else
                np.fromiter(map(_segment, blocks), dtype=np.int64, count=n))
    starts, ends = covering_runs(np.where(free, sizes, 0) if free_only else sizes,
                                 ~(free | movable), need, segments)
    moved = np.concatenate(([0], np.cumsum(np.where(movable, sizes, 0))))
    return starts, ends, moved[ends + 1] - moved[starts]


def emptying_moves(alloc: Allocator, blocks: list[Block], need: int,
                   tries: int) -> list[tuple[Storage, Block]]:
    """Moves that empty a run of ``blocks`` covering ``need`` bytes: of the ``tries`` runs
    with the fewest bytes of movable storages, the first whose storages all fit, best fit
    and largest first, in the free blocks outside it; empty when none does. Storages that
    cannot move are barriers, as are segment boundaries."""
    if not blocks:
        return []
    starts, ends, cost = _runs(blocks, need, free_only=False)
    holes = [k for k, b in enumerate(blocks) if b.storage is None]
    for r in np.lexsort((starts, cost))[:tries].tolist():
        i, j = int(starts[r]), int(ends[r])
        movers = [s for s in map(_storage, blocks[i: j + 1]) if s is not None and s.movable]
        plan = fit_into(alloc, blocks, [k for k in holes if k < i or k > j], movers)
        if plan is not None:
            return plan
    return []


def sliding_moves(blocks: list[Block], need: int, room: int) -> list[Storage]:
    """Storages to slide down, in address order, so that the free blocks of a run of
    ``blocks`` merge into one of ``need`` bytes or more at its end: of the runs between
    storages that cannot move whose free bytes cover ``need``, the one with the fewest
    bytes to slide; empty when there is none. Its storages need no hole elsewhere, only
    ``room`` (the pool's free bytes) for the copy of each in turn, so it works where moving
    a run's storages out does not (free bytes split into holes smaller than them)."""
    if not blocks:
        return []
    starts, ends, cost = _runs(blocks, need, free_only=True, room=room)
    if ends.size == 0:
        return []
    r = int(np.lexsort((starts, cost))[0])
    return [s for s in map(_storage, blocks[int(starts[r]): int(ends[r]) + 1])
            if s is not None]


def evacuating_moves(alloc: Allocator, blocks: list[Block],
                     deficit: int) -> list[tuple[Storage, Block]]:
    """Moves that empty whole segments of ``blocks`` (one pool's, in address order) worth
    ``deficit`` bytes, so that they are released and a new segment fits: the segments with
    the fewest movable bytes first, their storages fit, best fit and largest first, in the
    free blocks of the others; empty when that does not work."""
    segments: dict[int, list[int]] = {}
    for k, b in enumerate(blocks):
        segments.setdefault(b.segment, []).append(k)
    loads = []
    for ks in segments.values():
        owners = [s for s in (blocks[k].storage for k in ks) if s is not None]
        if owners and all(s.movable for s in owners):  # (idle ones are counted already)
            loads.append((sum(blocks[k].size for k in ks if blocks[k].storage is not None),
                          -sum(blocks[k].size for k in ks), ks))
    loads.sort(key=lambda x: (x[0], x[1]))
    chosen: set[int] = set()
    freed = 0
    for _, size, ks in loads:
        if freed >= deficit:
            break
        chosen.update(ks)
        freed -= size
    if freed < deficit:
        return []
    holes = [k for k, b in enumerate(blocks) if b.storage is None and k not in chosen]
    movers = [s for s in (blocks[k].storage for k in sorted(chosen)) if s is not None]
    plan = fit_into(alloc, blocks, holes, movers)
    return plan or []
