"""The allocator interface: where (and whether) a storage's bytes fit in the budget's pool."""

from __future__ import annotations

from abc import ABC, abstractmethod

from membudget.core.records import Storage


class Allocator(ABC):
    """Places storages in a pool of ``capacity`` bytes and tracks bytes held and their peak.

    ``allocate`` either places the storage and returns True or changes nothing and returns
    False; the engine then evicts and retries. Layout-aware allocators set ``storage.addr``.
    """

    name: str = ""

    def __init__(self, capacity: float) -> None:
        if capacity < 0:
            raise ValueError(f"allocator capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self.peak = 0

    @abstractmethod
    def allocate(self, s: Storage) -> bool:
        """Place ``s`` (``s.nbytes`` bytes); False, with nothing changed, if it does not fit."""

    @abstractmethod
    def free(self, s: Storage) -> None:
        """Return the bytes of a placed storage to the pool."""
