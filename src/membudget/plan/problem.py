"""Offset-assignment problems: buffers with fixed half-open lifetimes to place in one arena."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from membudget.errors import MembudgetError


class PlanError(MembudgetError, ValueError):
    """A planning problem or packing that is not well formed; names the offending buffers."""


@dataclass(frozen=True)
class Buffer:
    """A block of ``size`` bytes live on the half-open time interval ``[lower, upper)``.

    ``offset`` is its address in the arena when a packing has been given, else None.
    """

    id: str
    lower: int
    upper: int
    size: int
    offset: int | None = None


@dataclass(frozen=True)
class Problem:
    """Buffers with distinct ids, non-negative sizes and non-empty lifetimes."""

    buffers: tuple[Buffer, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for b in self.buffers:
            if b.id in seen:
                raise PlanError(f"duplicate buffer id {b.id!r}")
            seen.add(b.id)
            if b.size < 0:
                raise PlanError(f"buffer {b.id!r} has negative size {b.size}")
            if b.lower >= b.upper:
                raise PlanError(f"buffer {b.id!r} has an empty lifetime "
                                f"[{b.lower}, {b.upper})")

    def __len__(self) -> int:
        return len(self.buffers)

    def max_load(self) -> int:
        """The largest total size live at one time: a lower bound on any packing's height."""
        events = sorted([(b.lower, 1, b.size) for b in self.buffers]
                        + [(b.upper, 0, -b.size) for b in self.buffers])
        load = best = 0
        for _, _, delta in events:  # at equal times, frees (kind 0) come before allocations
            load += delta
            best = max(best, load)
        return best

    def with_offsets(self, offsets: Mapping[str, int]) -> Problem:
        """A copy whose buffers carry the given offsets (buffers not in the map get None)."""
        return Problem(tuple(replace(b, offset=offsets.get(b.id)) for b in self.buffers))

    def offsets(self) -> dict[str, int]:
        """The offsets carried by the buffers, for those that have one."""
        return {b.id: b.offset for b in self.buffers if b.offset is not None}
