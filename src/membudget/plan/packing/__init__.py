"""The parts of offset packing (:mod:`membudget.plan.pack` runs them): the preprocessed
instance, greedy packers, the canonical search, CP-SAT, decomposition and test problems."""
