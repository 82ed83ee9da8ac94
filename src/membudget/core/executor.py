"""Executors do the actual work of an op for the engine; the engine only decides.

The torch executor (live runtime) runs aten ops; the simulated executor charges the cost a trace
recorded and produces no data, so the same policy code decides in both worlds.
"""

from __future__ import annotations

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

    def move(self, storage: Storage) -> float:
        """Copy the data of a resident storage to its new block (the allocator moved it to
        merge free blocks); return the copy's cost."""
        raise NotImplementedError(f"{type(self).__name__} cannot move storages")


class SimulatedExecutor(Executor):
    """Charges each op the cost recorded with it, and a move what copying its bytes costs
    (``copy_ns_per_byte`` for the bytes read plus written, plus ``copy_launch``); holds no
    data."""

    def __init__(self, copy_ns_per_byte: float = 0.0, copy_launch: float = 0.0) -> None:
        self.copy_ns_per_byte = copy_ns_per_byte
        self.copy_launch = copy_launch

    def move(self, storage: Storage) -> float:
        return self.copy_launch + 2 * storage.nbytes * self.copy_ns_per_byte

    def run(self, path: ComputePath, remat: bool) -> float:
        return path.cost

    def drop(self, storage: Storage) -> None:
        return None

    def value(self, tensor: Tensor) -> object:
        return None
