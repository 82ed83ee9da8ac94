"""Shared test configuration."""

import os
from pathlib import Path

from hypothesis import settings

# The cost model prices CPU ops on a spec measured on the machine at first use; measured
# under load it can be 20x off, and the live tests' decisions (evictions, moves) follow the
# prices. Tests that assert what completes at a given budget then pass or fail by the load
# at that moment, so the suite prices on one pinned spec, on every machine (subprocesses
# inherit it); test_cost measures its own.
os.environ.setdefault("MEMBUDGET_CPU_SPEC", str(Path(__file__).parent / "data" / "cpu-spec.json"))

# Engine runs vary in wall time (numpy warm-up, machine load): never fail on a deadline.
# On a failure, shrink one failing example only: shrinking every distinct one takes minutes.
settings.register_profile("membudget", deadline=None, report_multiple_bugs=False)
settings.load_profile("membudget")
