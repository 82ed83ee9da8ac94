"""Shared test configuration."""

from hypothesis import settings

# Engine runs vary in wall time (numpy warm-up, machine load): never fail on a deadline.
settings.register_profile("membudget", deadline=None)
settings.load_profile("membudget")
