"""Independent components: after the buffers live throughout are set aside, the times no
buffer crosses split a problem into parts that can be packed separately (each from offset
0; the arena is as high as the highest part)."""

from __future__ import annotations

import numpy as np

from membudget.plan.packing.instance import Instance


def components(inst: Instance) -> list[np.ndarray]:
    """Index arrays of the independent parts, in time order."""
    if not len(inst):
        return []
    order = np.argsort(inst.lo, kind="stable")
    reach = np.maximum.accumulate(inst.hi[order])  # latest end among buffers started so far
    starts = np.flatnonzero(inst.lo[order][1:] >= reach[:-1]) + 1
    return [np.sort(part) for part in np.split(order, starts)]
