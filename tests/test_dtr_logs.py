"""The DTR paper's simulator logs: baseline cost and peak, and one budgeted run per log.

The expected costs are recomputed here straight from the zip with ``json`` (the sum of TIME of
every CALL and MUTATE record after ANNOTATE START), independently of the importer; the peak
figures are what an independent re-run of the paper's simulator (simrd) reported.
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import pytest

from membudget.sim import measure_baseline, simulate
from membudget.trace import expand_sources, load_trace

LOGS_ZIP = Path(__file__).parents[1].parent / "shared" / "dtr-logs" / "logs.zip"

pytestmark = pytest.mark.skipif(
    not LOGS_ZIP.is_file(), reason=f"DTR simulator logs not found at {LOGS_ZIP} "
    "(copy simrd/logs.zip from uwsampl/dtr-prototype there to run these tests)")

# log file name prefix -> baseline peak in MB (bytes / 1e6, one decimal) reported by simrd
PAPER_PEAK_MB = {
    "tv_densenet121": 11020.7,
    "inceptionv4": 11245.3,
    "resnet32": 10061.2,
    "transformer": 9864.4,
    "unet": 8415.8,
    "treelstm": 170.2,
    "lstm": 5595.1,
    "unroll_gan": 252.7,
}
MODELS = sorted(PAPER_PEAK_MB)


def member(prefix: str) -> str:
    with zipfile.ZipFile(LOGS_ZIP) as z:
        (name,) = [n for n in z.namelist() if n.rsplit("/", 1)[-1].startswith(prefix + "-")]
    return name


def independent_cost(name: str) -> int:
    total, started = 0, False
    with zipfile.ZipFile(LOGS_ZIP) as z, z.open(name) as f:
        for raw in f:
            if not raw.strip():
                continue
            rec = json.loads(raw)
            ins = rec["INSTRUCTION"]
            if not started:
                started = ins == "ANNOTATE" and rec.get("ANNOTATION") == "START"
            elif ins in ("CALL", "MUTATE"):
                total += int(rec["TIME"])
    assert started, f"{name} has no ANNOTATE START"
    return total


@pytest.fixture(scope="module")
def runs() -> dict:
    cache: dict = {}

    def get(prefix: str):
        if prefix not in cache:
            name = member(prefix)
            trace = load_trace(f"{LOGS_ZIP}::{name}")
            cache[prefix] = (name, trace, measure_baseline(trace))
        return cache[prefix]

    return get


def test_the_zip_holds_the_eight_logs():
    sources = expand_sources([str(LOGS_ZIP)])
    assert len(sources) == 8
    names = [s.rsplit("/", 1)[-1] for s in sources]
    for prefix in MODELS:
        assert sum(n.startswith(prefix + "-") for n in names) == 1, prefix


@pytest.mark.parametrize("prefix", MODELS)
def test_baseline_cost_is_the_sum_of_call_and_mutate_times(runs, prefix):
    name, trace, base = runs(prefix)
    assert base.cost == independent_cost(name)
    assert base.ops == sum(1 for ev in trace.events if ev[0] == "call")


@pytest.mark.parametrize("prefix", MODELS)
def test_baseline_peak_matches_the_paper_simulator(runs, prefix):
    _, _, base = runs(prefix)
    assert base.peak_bytes > 0
    assert round(base.peak_bytes / 1e6, 1) == PAPER_PEAK_MB[prefix]


@pytest.mark.parametrize("prefix", MODELS)
def test_half_budget_dtr_eq_respects_the_budget(runs, prefix):
    _, trace, base = runs(prefix)
    r = simulate(trace, "dtr-eq", ratio=0.5, baseline=base)
    assert r.status in ("ok", "thrashed", "oom")
    assert r.budget_bytes == int(base.peak_bytes * 0.5)
    assert 0 < r.peak_bytes <= r.budget_bytes
    assert r.baseline_cost == base.cost and r.baseline_peak_bytes == base.peak_bytes
    assert r.executed_cost == pytest.approx(base.cost + r.remat_cost)
    if r.status == "ok":
        assert r.ops == base.ops
        assert r.overhead == pytest.approx(r.remat_cost / base.cost)


def test_a_failing_recomputation_claims_no_lower_bound_that_another_schedule_beats():
    """UNet at 0.3 of its peak: DTR runs out while recomputing an evicted value, needing
    more than the budget at that point of its schedule, yet msps completes in that budget.
    So only an op the program runs may state a lower bound for the run (before: "this op
    alone needs a budget of at least 2,818,938,404 B (a lower bound for the run)"). With no
    overhead limit: the frames below a recomputation give up their locks before it fails,
    so at the default limit DTR thrashes first."""
    trace = load_trace(f"{LOGS_ZIP}::{member('unet')}")
    dtr = simulate(trace, "dtr", ratio=0.3, overhead_limit=math.inf)
    assert dtr.status == "oom" and dtr.needed_bytes > dtr.budget_bytes
    assert "recomputing an evicted value" in dtr.message and "lower bound" not in dtr.message
    assert simulate(trace, "msps", ratio=0.3).status == "ok"
