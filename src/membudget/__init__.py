"""membudget: train PyTorch models under a memory budget, and compare the methods for it."""

from membudget.errors import (
    EngineError,
    MembudgetError,
    OutOfBudget,
    Thrashed,
    TraceError,
    UnknownNameError,
)

__version__ = "0.1.0"

__all__ = ["EngineError", "MembudgetError", "OutOfBudget", "Thrashed", "TraceError",
           "UnknownNameError", "__version__"]
