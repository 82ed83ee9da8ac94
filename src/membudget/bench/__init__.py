"""Sweeps, reports and plots over simulated runs."""

from membudget.bench.sweep import DEFAULT_POLICIES, DEFAULT_RATIOS, sweep

__all__ = ["DEFAULT_POLICIES", "DEFAULT_RATIOS", "sweep"]
