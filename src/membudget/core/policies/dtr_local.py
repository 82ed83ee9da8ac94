"""``dtr-local``: h_DTR^local = c(S) / (m(S) · s(S)), no neighbourhood term."""

from __future__ import annotations

from membudget.core.policies.cost import CostPolicy


class DTRLocal(CostPolicy):
    name = "dtr-local"
