"""``two-sided``: Coop's cheap-tensor partitioning on the best-fit pool.

Outputs of costly ops (high cost density: compute cost per byte) take the low end of their
best-fit hole and cheap ones the high end, so, from an empty pool, expensive tensors grow up
from address 0 and cheap ones down from the top: cheap tensors cluster into contiguous runs
that are cheap to evict together. Parameters and other leaves (pinned, no producer) go to the
very top (so do all pinned storages: they are never evicted, so they must not split the
activations' space).

Coop classified by a list of op types (conv, matmul, ...); we use the cost density itself, as
the paper describes it, so any trace works. The threshold is fixed, or by default the running
geometric mean of the densities seen so far (scale-free: traces measure cost in ns or µs).
"""

from __future__ import annotations

import math

from membudget.core.allocators.segregated import SegregatedAllocator
from membudget.core.records import Storage


class TwoSidedAllocator(SegregatedAllocator):
    """Segregated best fit; expensive outputs at the low end of the hole, cheap ones at the
    high end."""

    name = "two-sided"

    def __init__(self, capacity: float, threshold: float | None = None) -> None:
        super().__init__(capacity)
        if threshold is not None and not threshold >= 0:
            raise ValueError(f"{self.name} threshold must be >= 0, got {threshold}")
        self.threshold = threshold
        self._log_sum = 0.0
        self._count = 0

    def measure(self, s: Storage) -> float:
        """The quantity the pool is partitioned on: cost density (compute cost per byte)."""
        return s.cost / s.nbytes

    def above(self, s: Storage) -> bool:
        """Is ``s`` above the threshold (for cost density: the output of a costly op)?"""
        value = self.measure(s)
        if self.threshold is not None:
            return value > self.threshold
        if value <= 0:
            return False
        log_d = math.log(value)
        # compare against the mean before this storage joins it (the first one is below)
        above = self._count > 0 and log_d > self._log_sum / self._count
        self._log_sum += log_d
        self._count += 1
        return above

    def _at_low_end(self, s: Storage) -> bool:
        return self.above(s)
