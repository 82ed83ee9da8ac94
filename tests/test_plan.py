"""Whole static plans (order + offsets) and the plan and pack commands; every plan produced
is re-checked here by the independent validators."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from membudget.cli import app
from membudget.plan.graph import from_trace
from membudget.plan.minimalloc_csv import read_csv
from membudget.plan.planner import location_problem, plan_trace
from membudget.plan.problem import Problem
from membudget.plan.validate import PackingError, validate, validate_plan
from membudget.trace.synthetic import resnet_step

SHARED = Path(__file__).resolve().parents[2] / "shared"


def _assert_valid(plan, trace) -> None:
    graph = from_trace(trace)
    problem = location_problem(graph, plan.order.order)
    validate_plan(graph, plan.order.order, plan.max_live, problem, plan.packing.offsets,
                  plan.arena)
    assert validate(problem, plan.packing.offsets) == plan.arena
    assert plan.order.lower_bound <= plan.max_live <= plan.recorded_peak
    assert plan.max_live <= plan.arena


def test_the_plan_validator_rejects_lifetimes_shorter_than_the_order_needs():
    trace = resnet_step(batch=1)
    graph = from_trace(trace)
    order = list(range(graph.n))
    problem = location_problem(graph, order)
    offsets, top = {}, 0
    for b in problem.buffers:  # no sharing at all: a valid, wasteful packing
        offsets[b.id], top = top, top + b.size
    validate_plan(graph, order, graph.recorded_peak(), problem, offsets, top)
    short = Problem(tuple(replace(b, upper=b.lower + 1) if k == 5 else b
                          for k, b in enumerate(problem.buffers)))
    with pytest.raises(PackingError, match="is live over steps"):
        validate_plan(graph, order, graph.recorded_peak(), short, offsets, top)
    with pytest.raises(PackingError, match="exceeds the capacity"):
        validate_plan(graph, order, graph.recorded_peak(), problem, offsets, top - 1)


@pytest.mark.parametrize("batch", [1, 32])
def test_a_plan_of_a_training_step_is_valid_and_beats_the_recorded_order_at_batch_1(batch):
    trace = resnet_step(batch=batch)
    plan = plan_trace(trace, time_limit=10)
    _assert_valid(plan, trace)
    if batch == 1:  # early weight updates free the gradients (docs/results/olla-order.md)
        assert plan.max_live < 0.8 * plan.recorded_peak
    assert plan.caching_peak >= plan.recorded_peak * 0.99


def test_a_tiny_time_limit_still_returns_a_valid_plan_and_says_it_is_not_proven():
    trace = resnet_step(batch=8)
    plan = plan_trace(trace, time_limit=0.1, caching=False)
    _assert_valid(plan, trace)
    assert not plan.order.optimal and "not proven" in plan.order.message


def test_plan_command_prints_the_figures_and_writes_json(tmp_path):
    from membudget.trace import write_trace

    trace = resnet_step(batch=1)
    path = tmp_path / "step.jsonl"
    write_trace(path, trace.header, trace.events)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", str(path), "--time-limit", "5", "-o", str(out)])
    assert result.exit_code == 0, result.output
    for what in ("recorded order", "planned order", "arena", "lower bound"):
        assert what in result.output
    assert out.is_file() and '"offsets"' in out.read_text()


@pytest.mark.skipif(not (SHARED / "minimalloc").is_dir(), reason="../shared/minimalloc missing")
def test_pack_command_meets_a_capacity_or_exits_1(tmp_path):
    problem = SHARED / "minimalloc" / "input.12.csv"
    sol = tmp_path / "sol.csv"
    ok = CliRunner().invoke(app, ["pack", str(problem), "--capacity", "12", "-o", str(sol)])
    assert ok.exit_code == 0, ok.output
    assert "height 12" in ok.output and sol.read_text().splitlines()[0].endswith("offset")
    unfit = tmp_path / "unfit.csv"
    too_small = CliRunner().invoke(app, ["pack", str(problem), "--capacity", "11",
                                         "--time-limit", "1", "-o", str(unfit)])
    assert too_small.exit_code == 1 and "does NOT fit" in too_small.output
    assert "did not write" in too_small.output and not unfit.exists()
    asked = CliRunner().invoke(app, ["pack", str(problem), "--capacity", "11",
                                     "--time-limit", "1", "-o", str(unfit), "--write-unfit"])
    assert asked.exit_code == 1 and "does NOT fit capacity 11" in asked.output
    assert validate(read_csv(unfit)) == 12


def test_plan_exports_the_recorded_order_as_a_minimalloc_problem(tmp_path):
    """The exported problem's max load is the recorded order's peak (freed at last use),
    and `membudget pack` packs it."""
    from membudget.trace import write_trace

    trace = resnet_step(batch=1)
    path = tmp_path / "step.jsonl"
    write_trace(path, trace.header, trace.events)
    csv = tmp_path / "step.csv"
    result = CliRunner().invoke(app, ["plan", str(path), "--export-problem", str(csv)])
    assert result.exit_code == 0, result.output
    assert "planned order" not in result.output, "exporting does not plan"
    problem = read_csv(csv)
    assert problem.max_load() == from_trace(trace).recorded_peak()
    assert len(problem) > 100
    packed = CliRunner().invoke(app, ["pack", str(csv), "--time-limit", "5"])
    assert packed.exit_code == 0, packed.output
    assert "lower bound" in packed.output
