"""The parts of offset packing (:mod:`membudget.plan.pack` runs them): the preprocessed
instance, greedy packers, the canonical search, CP-SAT, decomposition and test problems."""

from pathlib import Path

from membudget.core import COMPILED, warn_if_stale

if COMPILED:  # the canonical search is compiled with the core
    warn_if_stale(Path(__file__).parent)
