"""The fungible allocator: only the byte total matters (the DTR paper's assumption)."""

from __future__ import annotations

from membudget.core.allocators.base import Allocator
from membudget.core.records import Storage


class FungibleAllocator(Allocator):
    """Any ``n`` free bytes can hold an ``n``-byte storage: no layout, no fragmentation."""

    name = "fungible"

    def allocate(self, s: Storage) -> bool:
        used = self.used + s.nbytes
        if used > self.capacity:
            return False
        self.used = used
        if used > self.peak:
            self.peak = used
        return True

    def free(self, s: Storage) -> None:
        self.used -= s.nbytes

    def transfer(self, old: Storage, new: Storage) -> None:
        self.used += new.nbytes - old.nbytes
