"""Capturing zoo models: a live step and a fake one record the same ops with the same sizes,
a fake step allocates nothing, and bad input fails early with a clear message."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from membudget import UnknownNameError, models
from membudget.cli import app
from membudget.sim import simulate
from membudget.trace import read_trace
from membudget.trace.capture import LiveStepTooLarge, capture_step

# a CNN, a transformers model and the supernet whose path changes each step: a few seconds
# each; the other models are in the slow run
FAST = {"alexnet", "googlenet", "mobilenet-v2", "spos-supernet"}


def _without_costs(path):
    """The trace's events with the costs left out (measured live, predicted when fake)."""
    events = []
    for ev in read_trace(path).events:
        ev = ev[:1] + ev[2:]  # drop the line number
        events.append(ev[:6] + ev[7:] if ev[0] == "call" else ev)
    return events


# PyTorch's meta kernel for native_layer_norm_backward gives grad_input the strides of
# grad_output, where the CPU kernel returns it contiguous; a reshape after it then copies under
# FakeTensorMode and views live (5 of Swin-T's 3,054 ops differ)
STRIDES_DIFFER = {"swin-t"}


def _marks(name: str) -> list:
    marks = [] if name in FAST else [pytest.mark.slow]
    if name in STRIDES_DIFFER:
        marks.append(pytest.mark.xfail(strict=True, reason="a meta kernel's output strides "
                                                           "differ from the CPU kernel's"))
    return marks


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n))
                                  for n in models.names() if n != "gpt3-2.7b"])
def test_a_live_step_and_a_fake_one_record_the_same_ops_and_sizes(tmp_path, name):
    batch = models.get(name).small_batch
    live = capture_step(name, batch, path=tmp_path / "live.jsonl", check_fits=False)
    fake = capture_step(name, batch, fake=True, path=tmp_path / "fake.jsonl")
    assert live.ops == fake.ops > 0
    assert live.peak_bytes == fake.peak_bytes
    assert _without_costs(live.path) == _without_costs(fake.path)
    head = read_trace(fake.path).header
    assert head["model"] == name and head["batch"] == batch and head["fake"] is True
    assert head["cost_source"] == "predicted:a100-80gb"
    # under the session's own peak as budget, the simulator replays it with that peak
    result = simulate(read_trace(fake.path), "dtr", budget=fake.peak_bytes)
    assert result.status == "ok" and result.evictions == 0
    assert result.peak_bytes == fake.peak_bytes


@pytest.mark.slow
def test_gpt3_shape_records_the_same_ops_live_and_fake_at_two_layers(tmp_path, monkeypatch):
    """gpt3-2.7b cannot train here; its builder with two of its 32 layers can, and a fake
    capture of that records what a live one does."""
    entry = models.get("gpt3-2.7b")
    build = entry.build
    monkeypatch.setitem(models.ZOO, "gpt3-2.7b", type(entry)(
        entry.name, lambda b: build(b, n_layer=2), entry.batch, entry.small_batch, entry.paper,
        entry.description))
    live = capture_step("gpt3-2.7b", 1, path=tmp_path / "live.jsonl", check_fits=False)
    fake = capture_step("gpt3-2.7b", 1, fake=True, path=tmp_path / "fake.jsonl")
    assert _without_costs(live.path) == _without_costs(fake.path)


def test_a_fake_step_allocates_nothing_however_large_the_batch():
    c = capture_step("mobilenet-v2", 100_000, fake=True)
    assert c.peak_bytes > 10**12  # a terabyte of activations, recorded
    assert c.max_rss_bytes < 8 * 2**30


def test_a_live_capture_that_cannot_fit_says_so_before_it_starts():
    with pytest.raises(LiveStepTooLarge, match=r"vgg-16 at batch 100000 needs about .* --fake"):
        capture_step("vgg-16", 100_000)


def test_an_unknown_model_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match=r"unknown zoo model 'resnet-5'; known: .*resnet-50"):
        models.get("resnet-5")
    result = CliRunner().invoke(app, ["trace", "resnet-5", "-o", "x.jsonl"])
    assert result.exit_code != 0 and "resnet-50" in str(result.exception)


def test_trace_and_sweep_commands_accept_zoo_models(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMBUDGET_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "tree.jsonl.gz"
    result = CliRunner().invoke(app, ["trace", "treelstm", "--batch", "2", "--fake",
                                      "--device-spec", "titan-v", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert read_trace(out).header["cost_source"] == "predicted:titan-v"
    args = ["sweep", "treelstm", "--batch", "2", "--policies", "dtr,coop", "--ratios", "0.8",
            "--workers", "1"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    cached = list((tmp_path / "cache" / "traces").glob("treelstm-b2-a100-80gb-adamw-*.jsonl.gz"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and cached[0].stat().st_mtime_ns == stamp  # not captured again
    assert "coop" in again.output and "dtr" in again.output


@pytest.mark.parametrize("spec", ["a100-80gb", "h100"])
def test_a_step_priced_on_a_device_spec_prices_its_moves_on_that_spec(tmp_path, spec):
    """The move price in the header decides moves against evictions in the simulator: it is
    the spec's, not a price measured on the machine that captured the step."""
    from membudget.cost import get_spec
    from membudget.sim.simulate import copy_executor

    fake = capture_step("mobilenet-v2", 2, fake=True, spec=spec, path=tmp_path / "t.jsonl")
    header = read_trace(fake.path).header
    ns_per_byte, launch_ns = get_spec(spec).move_ns()
    assert header["move_price"] == {"ns_per_byte": ns_per_byte, "launch_ns": launch_ns}
    executor = copy_executor(header)
    assert (executor.copy_ns_per_byte, executor.copy_launch) == (ns_per_byte, launch_ns)
