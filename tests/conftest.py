"""Shared test configuration."""

from hypothesis import settings

# Engine runs vary in wall time (numpy warm-up, machine load): never fail on a deadline.
# On a failure, shrink one failing example only: shrinking every distinct one takes minutes.
settings.register_profile("membudget", deadline=None, report_multiple_bugs=False)
settings.load_profile("membudget")
