"""``dtr``: the DTR paper's h_DTR with the exact evicted neighbourhood e*(S).

h(S) = (c(S) + c(evicted ancestors region) + c(evicted descendants region)) / (m(S) · s(S)).
"""

from __future__ import annotations

from membudget.core.policies.cost import CostPolicy, evicted_region_cost
from membudget.core.records import Storage


class DTR(CostPolicy):
    name = "dtr"
    use_parents = True
    use_children = True

    def neighbour_cost(self, s: Storage) -> float:
        return evicted_region_cost(s, forward=False) + evicted_region_cost(s, forward=True)
