"""The generated ResNet training-step trace: well-formed, round-trips, and replays."""

from __future__ import annotations

import pytest

from membudget.sim import measure_baseline, simulate
from membudget.trace.format import (
    CALL,
    COPY,
    COPY_FROM,
    GET,
    PHASE,
    PUT,
    RELEASE,
    Trace,
    read_trace,
    write_trace,
)
from membudget.trace.synthetic import resnet_step


@pytest.fixture(scope="module")
def trace() -> Trace:
    return resnet_step()


def test_handles_are_live_when_used(trace: Trace) -> None:
    live: set[int] = set()
    defined: set[int] = set()

    def define(tid: int) -> None:
        assert tid not in defined, f"handle {tid} defined twice"
        defined.add(tid)
        live.add(tid)

    def use(*tids: int) -> None:
        for tid in tids:
            assert tid in live, f"handle {tid} used while not live"

    for ev in trace.events:
        kind = ev[0]
        if kind == PUT:
            define(ev[2])
        elif kind == CALL:
            _, _, _op, ins, outs, nbytes, alias, cost, mut = ev
            use(*ins)
            assert len(outs) == len(nbytes) == len(alias) and cost > 0
            assert all(m < len(ins) for m in mut) and all(a < len(ins) for a in alias)
            for tid in outs:
                define(tid)
        elif kind == COPY:
            use(ev[2])
            define(ev[3])
        elif kind == COPY_FROM:
            use(ev[2], ev[3])
        elif kind == RELEASE:
            use(ev[2])
            live.remove(ev[2])
        elif kind == GET:
            use(ev[2])
        else:
            assert kind == PHASE
    params = {ev[2] for ev in trace.events if ev[0] == PUT and ev[4] == "param"}
    loss = next(ev[4][0] for ev in trace.events if ev[0] == CALL and ev[2] == "nll_loss")
    assert live == params | {loss}


def test_views_and_updates(trace: Trace) -> None:
    calls = [ev for ev in trace.events if ev[0] == CALL]
    views = [ev for ev in calls if ev[6] == (0,)]
    assert views and all(ev[5] == (0,) for ev in views)
    updates = [ev for ev in calls if ev[8]]
    n_params = sum(1 for ev in trace.events if ev[0] == PUT and ev[4] == "param")
    assert len(updates) == n_params
    assert all(ev[2] == "sgd_" and ev[4] == () and ev[8] == (0,) for ev in updates)
    assert [ev[2] for ev in trace.events if ev[0] == PHASE] == ["forward", "backward",
                                                               "optimizer"]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_round_trip(trace: Trace, tmp_path, suffix: str) -> None:
    path = tmp_path / f"step{suffix}"
    assert write_trace(path, trace.header, trace.events) == len(trace.events)
    back = read_trace(path)
    assert back.events == trace.events  # line numbers included: they match the file
    assert back.header == {"membudget_trace": 1, **trace.header}


def test_baseline_and_budgets(trace: Trace) -> None:
    base = measure_baseline(trace)
    params = sum(ev[3] for ev in trace.events if ev[0] == PUT and ev[4] == "param")
    assert base.peak_bytes > params
    full = simulate(trace, "dtr-eq", ratio=1.0, baseline=base)
    assert full.status == "ok" and full.peak_bytes <= full.budget_bytes
    half = simulate(trace, "dtr-eq", ratio=0.5, baseline=base)
    assert half.status == "ok" and half.peak_bytes <= half.budget_bytes
    assert half.overhead > 0


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        resnet_step(depth=0)
