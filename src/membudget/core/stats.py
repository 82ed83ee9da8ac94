"""Counters the engine keeps while it runs; one definition of each metric (see DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Stats:
    """What happened during a run. Costs are in the trace's cost unit (ns for DTR logs)."""

    base_cost: float = 0.0  # cost of the program's own ops
    remat_cost: float = 0.0  # cost of recomputations
    ops: int = 0  # program ops executed
    remat_ops: int = 0  # ops executed to rematerialize evicted tensors
    evictions: int = 0  # storages evicted by the policy to make room
    eager_evictions: int = 0  # storages evicted because the program released them
    frees: int = 0  # storages freed for good
    failed_allocations: int = 0  # allocations that needed a search for victims
    search_ns: list[int] = field(default_factory=list)  # policy time per failed allocation
    # free bytes / pool bytes at each failed allocation (before any eviction for it)
    fragmentation: list[float] = field(default_factory=list)
    inplace_reuses: int = 0  # in-place writes whose new version took the old value's block
    inplace_copies: int = 0  # in-place writes that fell back to copy-on-write (see Engine)
    moves: int = 0  # live storages copied to another address to merge free blocks
    moved_bytes: int = 0  # their bytes
    move_cost: float = 0.0  # what those copies cost (the executor's figure)
    swap_outs: int = 0  # storages evicted to host memory (a copy, unless one existed)
    swap_ins: int = 0  # storages copied back from host memory
    swapped_bytes: int = 0  # bytes copied to host memory (backups included)
    backups: int = 0  # host copies made ahead of need while the link was idle
    shelved: int = 0  # released storages kept on the host (a finished copy), not dropped
    prefetches: int = 0  # values copied back ahead of need while the link was idle
    swap_stall: float = 0.0  # time the ops waited for copies to or from host memory
    host_bytes: int = 0  # bytes of host copies held now
    host_peak: int = 0  # the most held at once

    @property
    def executed_cost(self) -> float:
        """Ops run, recomputations, moves and the waits for host copies: what the overhead
        counts."""
        return self.base_cost + self.remat_cost + self.move_cost + self.swap_stall

    def fragmentation_summary(self) -> dict[str, float]:
        """Mean and max of the free fraction of the pool at failed allocations."""
        if not self.fragmentation:
            return {"mean": 0.0, "max": 0.0, "count": 0}
        a = np.asarray(self.fragmentation)
        return {"mean": float(a.mean()), "max": float(a.max()), "count": int(a.size)}

    def search_us(self) -> dict[str, float]:
        """p50, p99 and max of the policy's search time per failed allocation, in µs."""
        if not self.search_ns:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
        a = np.asarray(self.search_ns, dtype=np.float64) / 1e3
        return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
                "max": float(a.max()), "count": int(a.size)}
