"""``size-sided``: the two-sided pool partitioned by size instead of cost density.

Storages larger than the running geometric mean of the sizes allocated so far take the low
end of their best-fit hole and the rest the high end, pinned storages the very top: small
temporaries gather away from the large activations that are evicted and moved to make room
for large requests (a caching allocator's small and large pools, in one address space). An
ablation of ``dtr-compact``'s pool in the address-aware benchmark; a fixed ``threshold``
(bytes) replaces the running mean.
"""

from __future__ import annotations

from membudget.core.allocators.two_sided import TwoSidedAllocator
from membudget.core.records import Storage


class SizeSidedAllocator(TwoSidedAllocator):
    """Segregated best fit; large storages at the low end of the hole, small ones high."""

    name = "size-sided"

    def measure(self, s: Storage) -> float:
        return float(s.nbytes)
