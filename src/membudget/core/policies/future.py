"""``dtr-future``: DTR's cost over the bytes and the time until the next read (offline).

DTR's staleness, the time since a storage was last read, stands in for how long its bytes
would stay free if it left. Replaying a recorded step, the time until its next read is
known, as in Belady's rule: h(S) = (c(S) + e*(S)) / (m(S) · (next read − now)), with
``staleness=True`` also times DTR's staleness. The time is counted in calls, or with
``by_time=True`` in the ops' recorded cost (in units of the mean op's, so that a long op
counts for more than a short one). Only a replay knows the future: the
simulator tells the policy where the program is (:meth:`at`) and when each new storage will
be read (:meth:`will_read`); a live session refuses it, and planned mode compares its
schedule among the others (:data:`~membudget.core.policies.SCHEDULE_CANDIDATES`).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from membudget.core.policies.dtr import DTR
from membudget.core.pool import CandidatePool
from membudget.core.records import Storage

#: The distance of a storage the program never reads again (or of one it was not told of):
#: beyond any step, so such a storage leaves first.
NEVER = 1e12


class DTRFuture(DTR):
    name = "dtr-future"
    needs_future: ClassVar[bool] = True

    def __init__(self, staleness: bool = False, by_time: bool = False) -> None:
        super().__init__()
        self.with_staleness = staleness
        self.by_time = by_time  # positions in op cost, not in calls (the replay converts)
        self.now = 0.0  # the program's position: the index of the running call
        self._reads: dict[Storage, list[float]] = {}  # when each storage is read, sorted
        self._next: dict[Storage, int] = {}  # the index of its first read not yet passed

    def at(self, k: float) -> None:
        """The program is at position ``k``: the running call's (recomputations do not
        move it)."""
        self.now = k

    def will_read(self, s: Storage, reads: Sequence[float]) -> None:
        """``s`` will be read at the positions ``reads`` (none before the running call's),
        besides any told before (another view of it)."""
        known = self._reads.get(s)
        if known is None:
            self._reads[s] = sorted(reads)
        else:
            for r in reads:
                insort(known, r)

    def distance(self, s: Storage) -> float:
        """Positions until ``s`` is next read, plus 1 (the running call's)."""
        reads = self._reads.get(s)
        if reads is None:
            return NEVER
        i, now, n = self._next.get(s, 0), self.now, len(reads)
        while i < n and reads[i] < now:
            i += 1
        self._next[s] = i
        return reads[i] - now + 1.0 if i < n else NEVER

    def denominator(self, pool: CandidatePool, n: int, clock: float) -> np.ndarray:
        ahead = np.array([self.distance(s) for s in pool.items[:n]], dtype=np.float64)
        d = self.memory(pool, n) * ahead
        return d * (clock - pool.last[:n]) if self.with_staleness else d

    def on_forget(self, s: Storage) -> None:
        super().on_forget(s)
        self._reads.pop(s, None)
        self._next.pop(s, None)
