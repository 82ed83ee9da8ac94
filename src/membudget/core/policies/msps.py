"""``msps``: Capuchin's memory saving per second, (c(S) + c(evicted ancestors)) / m(S).

No staleness term; the ancestors are the exact evicted region reached through parent edges.
"""

from __future__ import annotations

from membudget.core.policies.cost import CostPolicy, evicted_region_cost
from membudget.core.records import Storage


class MSPS(CostPolicy):
    name = "msps"
    staleness = False
    use_parents = True

    def neighbour_cost(self, s: Storage) -> float:
        return evicted_region_cost(s, forward=False)
