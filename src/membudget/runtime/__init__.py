"""The live PyTorch side: a dispatch mode and wrapper tensors that put real training under
the engine's budget."""

from membudget.runtime.session import Session, SessionStats, budget

__all__ = ["Session", "SessionStats", "budget"]
