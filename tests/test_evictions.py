"""Eviction plans: a policy's decisions, recorded once, replay to the same run."""

from __future__ import annotations

from pathlib import Path

import pytest

from membudget.sim import measure_baseline, simulate
from membudget.sim.evictions import EvictionPlan
from membudget.trace import load_trace

LOGS = Path(__file__).resolve().parents[1].parent / "shared" / "dtr-logs" / "logs.zip"
needs_logs = pytest.mark.skipif(not LOGS.is_file(), reason=f"{LOGS} is missing")


@needs_logs
@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_a_recorded_plan_replays_the_same_decisions_with_no_search(ratio, tmp_path):
    tr = load_trace(f"{LOGS}::resnet32")
    base = measure_baseline(tr)
    dynamic = simulate(tr, "dtr-eq", ratio=ratio, baseline=base, record_plan=True)
    assert dynamic.status == "ok" and dynamic.evictions > 0
    plan = dynamic.eviction_plan
    assert plan is not None and plan.evictions == dynamic.evictions
    plan.save(tmp_path / "plan.json")
    # lru as the fallback would decide differently: the run is the plan's own
    planned = simulate(tr, "lru", ratio=ratio, baseline=base,
                       plan=EvictionPlan.load(tmp_path / "plan.json"))
    assert planned.status == "ok"
    assert planned.extra["policy_searches"] == 0  # the plan answered every search
    assert planned.extra["plan_evictions"] == dynamic.evictions
    assert planned.executed_cost == pytest.approx(dynamic.executed_cost, rel=1e-12)
    assert planned.peak_bytes <= planned.budget_bytes


@needs_logs
def test_a_plan_that_does_not_cover_the_budget_falls_back_to_the_policy():
    tr = load_trace(f"{LOGS}::resnet32")
    base = measure_baseline(tr)
    loose = simulate(tr, "dtr-eq", ratio=0.6, baseline=base, record_plan=True)
    tight = simulate(tr, "dtr-eq", ratio=0.4, baseline=base, plan=loose.eviction_plan)
    assert tight.status == "ok" and tight.extra["policy_searches"] > 0
    assert tight.peak_bytes <= tight.budget_bytes


def test_a_malformed_plan_is_refused_with_the_expected_shape():
    from membudget.errors import MembudgetError
    with pytest.raises(MembudgetError, match="not an eviction plan"):
        EvictionPlan.from_json({"before": {"3": [[1]]}})


@needs_logs
def test_following_a_plan_while_recording_gives_a_plan_of_the_whole_run():
    """A plan that leaves allocations to the policy (a looser run's), followed and recorded:
    the recording holds the plan's evictions and the policy's, so it replays the whole run
    with no search, whatever the fallback policy."""
    tr = load_trace(f"{LOGS}::resnet32")
    base = measure_baseline(tr)
    loose = simulate(tr, "dtr-eq", ratio=0.6, baseline=base, record_plan=True)
    tight = simulate(tr, "dtr-eq", ratio=0.4, baseline=base, plan=loose.eviction_plan,
                     record_plan=True)
    assert tight.status == "ok" and tight.extra["policy_searches"] > 0
    whole = tight.eviction_plan
    assert whole is not None and whole.evictions == tight.evictions
    again = simulate(tr, "lru", ratio=0.4, baseline=base, plan=whole)
    assert again.status == "ok" and again.extra["policy_searches"] == 0
    assert again.executed_cost == pytest.approx(tight.executed_cost, rel=1e-12)
    assert again.peak_bytes <= again.budget_bytes
