"""Planned tensor locations for DTR's schedule: lifetimes of a fungible run packed into the
budget's bytes, checked by the independent validator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_outputs import cli

from membudget.errors import MembudgetError
from membudget.plan.minimalloc_csv import read_csv
from membudget.plan.run_layout import SHRINKS, RunLayout, lay_out
from membudget.plan.validate import validate
from membudget.sim import simulate
from membudget.trace import load_trace
from membudget.trace.format import write_trace
from membudget.trace.synthetic import resnet_step

LOGS_ZIP = Path(__file__).parents[1].parent / "shared" / "dtr-logs" / "logs.zip"


def check_layout(trace, ratio: float) -> RunLayout:
    """A fitting layout places every storage the run held, within the budget, no two live
    ones overlapping, and the run is DTR's own run on the fungible pool at its budget."""
    lay = lay_out(trace, ratio=ratio, time_limit=5)
    assert lay.fits and lay.problem is not None and lay.packing is not None
    assert validate(lay.problem, lay.packing.offsets, capacity=lay.budget) <= lay.budget
    # the lifetimes cover every byte the engine held, at every event
    assert lay.problem.max_load() == lay.run.peak_bytes <= lay.run_budget <= lay.budget
    alone = simulate(trace, "dtr", budget=lay.run_budget, allocator="fungible")
    assert (lay.run.status, lay.run.evictions, lay.run.remat_ops, lay.run.executed_cost) \
        == (alone.status, alone.evictions, alone.remat_ops, alone.executed_cost)
    return lay


@pytest.mark.parametrize("ratio", [0.9, 0.7, 0.5])
def test_dtrs_schedule_on_a_resnet_step_gets_an_offset_for_every_storage(ratio):
    check_layout(resnet_step(depth=8, batch=64), ratio)


@pytest.mark.skipif(not LOGS_ZIP.is_file(), reason=f"DTR logs not found at {LOGS_ZIP}")
def test_dtrs_schedule_on_the_unet_log_fits_the_budget_where_the_default_pays_for_addresses():
    """On the DTR paper's UNet log at 0.7, the laid-out schedule costs the fungible pool's
    overhead, less than the default pays on its address-ordered pool."""
    trace = load_trace(f"{LOGS_ZIP}::logs/unet-6-8000000000.0-2020-10-1-10-57-18-default.log")
    lay = check_layout(trace, 0.7)
    default = simulate(trace, "default", ratio=0.7)
    assert lay.run.overhead < default.overhead


def test_a_run_that_does_not_complete_has_no_layout_and_each_run_is_reported():
    heard: list[str] = []
    lay = lay_out(resnet_step(depth=8, batch=64), ratio=0.3, time_limit=1, progress=heard.append)
    assert lay.run.status != "ok" and not lay.fits
    assert lay.packing is None and lay.problem is None
    assert [h for _, h in lay.tried] == [None] * len(SHRINKS)
    assert [m.split(":")[0] for m in heard] == [f"run {k} of {len(SHRINKS)}"
                                                for k in range(1, len(SHRINKS) + 1)]


def test_bad_arguments_are_named():
    trace = resnet_step(depth=2, batch=8)
    with pytest.raises(MembudgetError, match="exactly one of ratio and budget"):
        lay_out(trace)
    with pytest.raises(MembudgetError, match="shrinks must be shares"):
        lay_out(trace, ratio=0.5, shrinks=(1.0,))


def test_the_command_writes_a_layout_the_validator_accepts_only_when_it_fits(tmp_path):
    """``membudget layout`` on a trace file: the CSV it writes is a packing within the
    budget; a budget no run completes exits 1, says so and writes nothing."""
    path = tmp_path / "resnet.jsonl"
    trace = resnet_step(depth=8, batch=64)
    write_trace(path, trace.header, trace.events)
    out = tmp_path / "layout.csv"
    r = cli("layout", str(path), "--ratio", "0.7", "--json", "-o", str(out))
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["fits"] and obj["status"] == "ok"
    problem = read_csv(out)
    assert validate(problem, capacity=obj["budget_bytes"]) == obj["height"]
    assert problem.max_load() == obj["max_load"]
    low = tmp_path / "low.csv"
    r = cli("layout", str(path), "--ratio", "0.3", "--time-limit", "1", "-o", str(low))
    assert r.returncode == 1 and "does NOT fit" in r.stdout
    assert "did not write" in r.stderr and not low.exists()
