"""``phase-sided``: segregated best fit that puts what backward makes beside the pinned state.

Segregation by lifetime class. Forward activations live until backward reads them; storages
made in backward (gradients and their temporaries, kind ``"gradient"``: set by a trace's phase
markers or a live session's ``phase("backward")``) are mostly short-lived, and the parameters'
gradients then live to the step's end. Here backward's storages take the topmost hole that fits,
as pinned ones do, and forward's the best fit from the bottom. An ablation of ``dtr-compact``'s
pool in the address-aware benchmark.
"""

from __future__ import annotations

from membudget.core.allocators.segregated import SegregatedAllocator
from membudget.core.records import Storage


class PhaseSidedAllocator(SegregatedAllocator):
    """Segregated best fit; storages made in backward packed from the top with pinned ones."""

    name = "phase-sided"

    def _on_top(self, s: Storage) -> bool:
        return s.pinned or s.kind == "gradient"
