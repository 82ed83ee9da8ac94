"""The framework-free engine: records, allocators, policies, executors and stats. No torch."""

from membudget.core.engine import Engine
from membudget.core.executor import Executor, SimulatedExecutor
from membudget.core.records import ComputePath, Storage, Tensor

__all__ = ["ComputePath", "Engine", "Executor", "SimulatedExecutor", "Storage", "Tensor"]
