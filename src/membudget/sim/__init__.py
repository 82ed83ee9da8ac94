"""The simulator: replay traces through the engine with the simulated executor."""

from membudget.sim.replay import replay
from membudget.sim.simulate import Baseline, SimResult, measure_baseline, simulate

__all__ = ["Baseline", "SimResult", "measure_baseline", "replay", "simulate"]
