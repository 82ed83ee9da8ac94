"""membudget: train PyTorch models under a memory budget, and compare the methods for it."""

from typing import Any

from membudget.errors import (
    BudgetRaisedWarning,
    BudgetTooSmallError,
    EngineError,
    MembudgetError,
    OutOfBudget,
    RecomputationError,
    Thrashed,
    TraceError,
    UnknownNameError,
    UnsupportedTensorError,
)

__version__ = "0.1.0"

__all__ = ["BudgetRaisedWarning", "BudgetTooSmallError", "EngineError", "MembudgetError",
           "OutOfBudget", "RecomputationError", "Thrashed", "TraceError", "UnknownNameError",
           "UnsupportedTensorError", "__version__", "budget", "reversible"]


def __getattr__(name: str) -> Any:
    """``membudget.budget`` and ``membudget.reversible`` import torch on first use, so the
    engine and simulator don't."""
    if name == "budget":
        from membudget.runtime.session import budget

        return budget
    if name == "reversible":
        import membudget.reversible

        return membudget.reversible
    raise AttributeError(f"module 'membudget' has no attribute {name!r}")
