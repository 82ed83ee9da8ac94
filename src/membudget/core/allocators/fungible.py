"""The fungible allocator: only the byte total matters (the DTR paper's assumption)."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from membudget.core.allocators.base import Allocator
from membudget.core.records import Storage


@mypyc_attr(allow_interpreted_subclasses=True)  # (plan.run_layout logs its lifetimes)
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


class LiftedAllocator(FungibleAllocator):
    """A fungible pool of ``capacity`` bytes that takes over from a budgeted one whose budget
    had to be raised (to hand a program the values it holds at the end): ``peak`` stays the
    budgeted run's, and ``high`` is the most it held itself."""

    name = "lifted"

    def __init__(self, replaced: Allocator, capacity: float) -> None:
        super().__init__(capacity)
        self.used = replaced.used
        self.peak = replaced.peak
        self.high: int = replaced.high if isinstance(replaced, LiftedAllocator) else replaced.used

    def allocate(self, s: Storage) -> bool:
        used = self.used + s.nbytes
        if used > self.capacity:
            return False
        self.used = used
        if used > self.high:
            self.high = used
        return True
