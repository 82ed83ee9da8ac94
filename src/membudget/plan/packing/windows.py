"""Large-neighbourhood search for parts too large for the exact solvers whole: the buffers
at the top of the packing are re-packed band by band. A band is the highest buffers of a
time window around one of them, or of all buffers live with it; CP-SAT re-packs them as
low as it can, starting from where they are, around the fixed buffers reaching into it.
Every step keeps the packing valid, so the search can stop at any time."""

from __future__ import annotations

import os
import time

import numpy as np

from membudget.plan.packing.cp_sat import CpSat
from membudget.plan.packing.exact import Incumbent
from membudget.plan.packing.instance import Instance

#: Buffers re-packed per window, drawn at random per window.
BANDS = (150, 300, 600)
#: Seconds CP-SAT gets per window.
WINDOW_SECONDS = 2.0


def improve(inc: Incumbent, deadline: float) -> None:
    """Lower the incumbent until it is settled or the deadline passes, counting the windows
    tried in ``inc.windows``. Each round re-packs a band around one of the highest buffers;
    bands are drawn at random, so one that failed may work next time."""
    inst = inc.inst
    off = inc.offsets.copy()
    rng = np.random.default_rng(0)
    while not inc.done.is_set() and time.perf_counter() < deadline:
        height = inst.height(off)
        tops = off + inst.size
        i = int(rng.choice(np.flatnonzero(tops == height)))
        inc.windows += 1
        new = _window(inst, off, i, int(rng.choice(BANDS)), deadline, rng)
        if new is None or (new[1] + inst.size[new[0]]).max(initial=0) > height:
            continue
        off[new[0]] = new[1]
        if inst.height(off) < height:
            inc.offer(off.copy(), "windowed CP-SAT")  # which reports it


def _window(inst: Instance, off: np.ndarray, i: int, band: int, deadline: float,
            rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray] | None:
    """Re-pack a band around buffer i as low as CP-SAT can in its time: the band's buffers
    and their new offsets, or None if it found nothing. Half the time the band is drawn
    from a time window (grown from i's lifetime by random steps on either side until it
    holds ``band`` buffers), half the time from every buffer live with i, long-lived ones
    included (what a peak of live memory needs moved). The band is the ``band`` highest
    of those (and i), kept above the lowest offset among them; every other buffer reaching
    into it stays where it is."""
    lo, hi, size = inst.lo, inst.hi, inst.size
    a, b = int(lo[i]), int(hi[i])
    if rng.random() < 0.5:
        pool = np.flatnonzero((lo < b) & (hi > a))
    else:
        end = int(hi.max())
        step = max(b - a, 1)
        while True:  # widen the window until it holds enough buffers
            pool = np.flatnonzero((lo >= a) & (hi <= b))
            if len(pool) >= band or (a <= 0 and b >= end):
                break
            a = max(a - int(step * rng.random()) - 1, 0)
            b = min(b + int(step * rng.random()) + 1, end)
    level = min(int(np.sort(off[pool])[-min(band, len(pool))]), int(off[i]))
    free = pool[off[pool] >= level]
    a, b = int(lo[free].min()), int(hi[free].max())
    fixed = np.flatnonzero((lo < b) & (hi > a) & (off + size > level))
    fixed = fixed[~np.isin(fixed, free)]
    obstacles = np.stack([np.maximum(lo[fixed], a), np.minimum(hi[fixed], b), off[fixed],
                          size[fixed]], axis=1) if len(fixed) else None
    solver = CpSat(inst.part(free), workers=os.cpu_count() or 1,
                   floor=np.full(len(free), level, dtype=np.int64), obstacles=obstacles,
                   hint=off[free])
    solver.solver.parameters.max_time_in_seconds = max(
        0.01, min(WINDOW_SECONDS, deadline - time.perf_counter()))
    values = solver.lowest(inst.height(off), lambda: False)
    return None if values is None else (free, values)
