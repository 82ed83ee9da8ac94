"""Executors do the actual work of an op for the engine; the engine only decides.

The torch executor (live runtime) runs aten ops; the simulated executor charges the cost a trace
recorded and produces no data, so the same policy code decides in both worlds.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

from mypy_extensions import mypyc_attr

from membudget.core.records import ComputePath, Storage, Tensor


@mypyc_attr(allow_interpreted_subclasses=True)  # (compiled: see setup.py)
class Executor(ABC):
    """What the engine needs from whoever holds the data."""

    @abstractmethod
    def run(self, path: ComputePath, remat: bool) -> float:
        """Compute the outputs of ``path`` (inputs are materialized); return its cost."""

    def probe(self, path: ComputePath) -> tuple[list[int], list[int] | None, float]:
        """Describe a new op whose outputs the caller could not (its inputs are locked and
        materialized): their bytes, aliased inputs (None: none aliases an input) and the
        op's cost, known before it runs so that the engine makes room first; an executor
        that cannot tell without running the op may run it here, and the following ``run``
        then only keeps the result."""
        raise NotImplementedError(f"{type(self).__name__} needs output sizes up front")

    @abstractmethod
    def drop(self, storage: Storage) -> None:
        """Release the data of an evicted or dead storage."""

    @abstractmethod
    def value(self, tensor: Tensor) -> object:
        """The data of a materialized tensor (for ``Engine.get_value``)."""

    def move(self, storage: Storage, batched: bool = False) -> float:
        """Copy the data of a resident storage to its new block (the allocator moved it to
        merge free blocks); return the copy's cost. ``batched``: it goes in the same launch
        as the copy before it (independent copies, one multi-tensor copy kernel, as
        ``torch._foreach_copy_`` makes them), so no launch overhead of its own."""
        raise NotImplementedError(f"{type(self).__name__} cannot move storages")

    #: a move's price: ns per byte (read and written) and per copy; 0 where the executor
    #: cannot say (moves are then taken as free, and preferred to evictions)
    copy_ns_per_byte: float = 0.0
    copy_launch: float = 0.0

    def move_price(self, storage: Storage, batched: bool = False) -> float:
        """What moving ``storage`` would cost, before deciding to (``batched``: as
        :meth:`move`)."""
        return (0.0 if batched else self.copy_launch) + 2 * storage.nbytes * self.copy_ns_per_byte

    def batch_price(self, storages: list[Storage]) -> float:
        """What moving ``storages`` into free blocks elsewhere costs: independent copies,
        one launch."""
        return sum(self.move_price(s, k > 0) for k, s in enumerate(storages))

    # Swapping: a storage's bytes copied to host memory and back over the device's host link.
    # Every figure is in the cost unit; a stall is the time the ops wait for a copy.
    #: whether host copies run on copy streams of their own, beside the ops (the engine then
    #: backs values up to the host while the link is idle, and only waits for unfinished copies)
    overlaps: bool = False
    #: whether a pinned storage (a parameter, optimizer state, an output that cannot be
    #: recomputed) may leave for the host too: only where the executor owns its bytes (a
    #: simulated device does; a live runtime does not own the program's parameters)
    swaps_pinned: bool = False

    def transfer(self, storage: Storage) -> float:
        """What copying the bytes of ``storage`` over the host link costs, one way."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap to host memory")

    def swap_out(self, storage: Storage, now: float) -> float:
        """Make sure a host copy of resident ``storage`` exists (``storage.host_ready`` is inf
        while it has none); return how long the ops wait for it from ``now``."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap to host memory")

    def out_wait(self, storage: Storage, now: float) -> float:
        """How long the ops would wait, from ``now``, for the host copy of resident
        ``storage`` if it left now: none once it has one, else the whole copy (a synchronous
        copy; an executor with copy streams adds the copies queued ahead of it)."""
        return 0.0 if storage.host_ready != math.inf else self.transfer(storage)

    def swap_in(self, storage: Storage, now: float) -> float:
        """Copy the host copy of ``storage`` back into its new block; return the wait."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap to host memory")

    def backup(self, storage: Storage, now: float) -> float:
        """Start a host copy of resident ``storage`` on the copy stream if the link is idle at
        ``now``: when it will be complete, or inf if the link is busy (only if ``overlaps``)."""
        return math.inf

    def prefetch(self, storage: Storage, now: float) -> float:
        """Start copying ``storage`` back from host memory into its new block if the link
        is idle at ``now``: when it will be there, or inf if the link is busy (only if
        ``overlaps``)."""
        return math.inf

    def drop_host(self, storage: Storage) -> None:
        """Release the host copy of ``storage`` (it died, or its values changed)."""


class SimulatedExecutor(Executor):
    """Charges each op the cost recorded with it, and a move what copying its bytes costs
    (``copy_ns_per_byte`` for the bytes read plus written, plus ``copy_launch``); holds no
    data.

    A host copy costs ``link_launch + nbytes · link_ns_per_byte`` each way. With ``overlap``
    the copies to and from the host run on two copy streams (the link is full duplex), each a
    queue: the ops wait only for a copy they need that has not finished. Without it every
    copy stalls the ops for its whole time (a synchronous copy, as the live runtime makes).
    Pinned storages may be swapped too, as ZeRO-Offload swaps optimizer state: the simulated
    device owns every byte it counts."""

    def __init__(self, copy_ns_per_byte: float = 0.0, copy_launch: float = 0.0,
                 link_ns_per_byte: float = 0.0, link_launch: float = 0.0,
                 overlap: bool = True) -> None:
        self.copy_ns_per_byte = copy_ns_per_byte
        self.copy_launch = copy_launch
        self.link_ns_per_byte = link_ns_per_byte
        self.link_launch = link_launch
        self.overlaps = overlap
        self.swaps_pinned = True
        self.d2h = 0.0  # when the stream of copies to the host is next free
        self.h2d = 0.0  # and that of copies back

    def transfer(self, storage: Storage) -> float:
        return self.link_launch + storage.nbytes * self.link_ns_per_byte

    def swap_out(self, storage: Storage, now: float) -> float:
        wait = self.out_wait(storage, now)
        if storage.host_ready == math.inf and self.overlaps:  # its copy joins the queue
            self.d2h = now + wait
        return wait

    def out_wait(self, storage: Storage, now: float) -> float:
        if storage.host_ready != math.inf:  # a backup, finished or on its way
            return max(0.0, storage.host_ready - now)
        if not self.overlaps:
            return self.transfer(storage)
        return max(self.d2h, now) - now + self.transfer(storage)

    def swap_in(self, storage: Storage, now: float) -> float:
        if not self.overlaps:
            return self.transfer(storage)
        self.h2d = max(self.h2d, now) + self.transfer(storage)
        return self.h2d - now

    def backup(self, storage: Storage, now: float) -> float:
        if not self.overlaps or self.d2h > now:
            return math.inf
        self.d2h = now + self.transfer(storage)
        return self.d2h

    def prefetch(self, storage: Storage, now: float) -> float:
        if not self.overlaps or self.h2d > now:
            return math.inf
        self.h2d = now + self.transfer(storage)
        return self.h2d

    def move(self, storage: Storage, batched: bool = False) -> float:
        return self.move_price(storage, batched)

    def run(self, path: ComputePath, remat: bool) -> float:
        return path.cost

    def drop(self, storage: Storage) -> None:
        return None

    def value(self, tensor: Tensor) -> object:
        return None
