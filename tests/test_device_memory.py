"""The accelerator cross-check of a session's peak (runtime/device_memory.py)."""

from __future__ import annotations

import pytest
import torch

import membudget
from membudget.runtime.device_memory import DeviceMeter


class FakeAccelerator:
    """Stands in for torch.accelerator on a machine with a device: allocated bytes go up and
    down as the test says, and the peak follows them."""

    def __init__(self, kind: str) -> None:
        self.kind, self.now, self.high = kind, 0, 0

    def hold(self, delta: int) -> None:
        self.now += delta
        self.high = max(self.high, self.now)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        acc = torch.accelerator
        monkeypatch.setattr(acc, "is_available", lambda: True)
        monkeypatch.setattr(acc, "current_accelerator", lambda: torch.device(self.kind))
        monkeypatch.setattr(acc, "memory_allocated", lambda: self.now)
        monkeypatch.setattr(acc, "max_memory_allocated", lambda: self.high)
        monkeypatch.setattr(acc, "reset_peak_memory_stats",
                            lambda: setattr(self, "high", self.now))


def test_the_meter_reports_the_peak_above_what_was_held_at_the_start(monkeypatch):
    dev = FakeAccelerator("xpu")
    dev.install(monkeypatch)
    dev.hold(700)  # the model, before the session
    dev.high = 5000  # an earlier peak must not count
    meter = DeviceMeter()
    dev.hold(300)
    dev.hold(-200)
    dev.hold(100)
    assert meter.peak() == 300


def test_an_uninitialised_cuda_is_left_alone(monkeypatch):
    dev = FakeAccelerator("cuda")
    dev.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats",
                        lambda: pytest.fail("would initialise CUDA for a CPU session"))
    assert DeviceMeter().peak() is None


def test_a_cpu_session_has_no_device_peak():
    with membudget.budget("1 MiB") as session:
        (torch.ones(8) * 2.0).sum()
    assert session.stats.device_peak_bytes is None and session.stats.peak_bytes > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_allocator_sees_what_the_session_counts():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    x = torch.randn(4096, 1024, device="cuda")
    leaves = x.nbytes + sum(p.nbytes for p in model.parameters())  # held before it began
    with membudget.budget(10**11, "dtr") as free:
        model(x).square().mean().backward()
    budget = free.stats.peak_bytes // 2
    model.zero_grad(set_to_none=True)
    with membudget.budget(budget, "dtr") as session:
        model(x).square().mean().backward()
    st = session.stats
    assert st.evictions > 0 and st.peak_bytes <= budget and st.device_peak_bytes is not None
    # everything the engine counts is a real allocation; beyond it the device also holds one
    # op's fresh outputs while the engine makes room for them (16 MiB here) and workspaces
    assert st.peak_bytes - leaves <= st.device_peak_bytes <= budget - leaves + 64 * 2**20
