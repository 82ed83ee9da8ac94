"""``dte``: DTE (MegTaiChi, as OneFlow reimplemented it for the Coop paper).

h(S) = c_eq(S) / (staleness(S) · (m(S) + free bytes directly before and after S)), evicting
one storage at a time until the request fits. The free-neighbour term favours victims whose
eviction merges into a large hole. c_eq is dtr-eq's union-find neighbourhood cost.
"""

from __future__ import annotations

import numpy as np

from membudget.core.policies.dtr_eq import DTREq
from membudget.core.pool import CandidatePool


class DTE(DTREq):
    name = "dte"
    default_allocator = "best-fit"
    reads_free_adj = True

    def memory(self, pool: CandidatePool, n: int) -> np.ndarray:
        return pool.nbytes[:n] + pool.free_adj[:n]
