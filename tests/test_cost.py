"""The cost model: hand-computed roofline times, free views, the same answer for real, meta
and fake tensors, named specs, the measured CPU spec, and Coop's Table 1 within ×2."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from membudget.cost import CostMode, CostModel, DeviceSpec, devices, get_spec, known_specs
from membudget.cost.reference import CASES, density
from membudget.errors import MembudgetError, UnknownNameError
from membudget.runtime import sizing

aten = torch.ops.aten

# Round numbers so that every expected time below is computed by hand.
TOY = DeviceSpec("toy", fp32_flops=1e12, fp16_flops=4e12, bf16_flops=None, tf32_flops=8e12,
                 fp64_flops=0.5e12, bandwidth=1e11, launch_overhead=1e-6)


def seconds(model: CostModel, func: torch._ops.OpOverload, *args: object,
            **kwargs: object) -> float:
    out = func(*args, **kwargs)
    return model.op_seconds(func, args, kwargs, out)


def test_mm_compute_bound_by_hand() -> None:
    a, b = torch.ones(256, 512), torch.ones(512, 128)
    # 2·256·512·128 FLOPs at 1e12/s = 33.554432 µs; (256·512 + 512·128 + 256·128)·4 B at
    # 1e11 B/s = 9.18 µs: compute-bound.
    assert seconds(CostModel(TOY), aten.mm.default, a, b) == pytest.approx(1e-6 + 33.554432e-6)


def test_mm_memory_bound_by_hand() -> None:
    a, b = torch.ones(4096, 8), torch.ones(8, 4096)
    # 268,435,456 FLOPs = 268 µs, but (2·4096·8 + 4096²)·4 = 67,371,008 B = 673.7 µs.
    assert seconds(CostModel(TOY), aten.mm.default, a, b) == pytest.approx(1e-6 + 673.71008e-6)


def test_conv_by_hand_and_tf32_follows_pytorch_defaults() -> None:
    x, w, bias = torch.ones(2, 16, 32, 32), torch.ones(32, 16, 3, 3), torch.ones(32)
    args = (x, w, bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    # 2 · (2·32·32·32 outputs) · (16·3·3) = 18,874,368 FLOPs; bytes are only 4.1 µs.
    fp32 = seconds(CostModel(TOY, tf32_conv=False), aten.convolution.default, *args)
    assert fp32 == pytest.approx(1e-6 + 18.874368e-6)
    # cuDNN convolutions use TF32 by default (8e12 FLOP/s here), so the bytes win:
    # (32768 + 4608 + 32 + 65536) · 4 B = 411,776 B = 4.11776 µs.
    tf32 = seconds(CostModel(TOY), aten.convolution.default, *args)
    assert tf32 == pytest.approx(1e-6 + 4.11776e-6)
    # ...while matmuls stay in full fp32 unless asked.
    a, b = torch.ones(256, 512), torch.ones(512, 128)
    assert seconds(CostModel(TOY, tf32_matmul=True), aten.mm.default, a, b) == pytest.approx(
        1e-6 + 9.175040e-6)


def test_a_measured_element_rate_bounds_a_math_op_by_hand() -> None:
    x = torch.ones(1 << 20)
    # 8 MiB read and written at 1e11 B/s: 83.9 µs. At 1e9 tanh elements/s: 1,048.6 µs.
    assert seconds(CostModel(TOY), aten.tanh.default, x) == pytest.approx(1e-6 + 83.88608e-6)
    toy = dataclasses.replace(TOY, math_rates={"tanh": 1e9, "_softmax": 1e12})
    assert seconds(CostModel(toy), aten.tanh.default, x) == pytest.approx(1e-6 + 1048.576e-6)
    # A rate faster than the bytes changes nothing; an op without a rate keeps its bytes.
    assert seconds(CostModel(toy), aten._softmax.default, x, 0, False) == pytest.approx(
        1e-6 + 83.88608e-6)
    assert seconds(CostModel(toy), aten.relu.default, x) == pytest.approx(1e-6 + 83.88608e-6)


def test_relu_and_inplace_and_out_variants_by_hand() -> None:
    model = CostModel(TOY)
    x = torch.ones(1000, 1000)
    # read 4e6 B + write 4e6 B at 1e11 B/s = 80 µs.
    assert seconds(model, aten.relu.default, x) == pytest.approx(81e-6)
    assert seconds(model, aten.relu_.default, x.clone()) == pytest.approx(81e-6)
    assert seconds(model, aten.relu.default, x.half()) == pytest.approx(41e-6)
    # out= is written, not read: a + b -> out is 3 · 4e6 B.
    assert seconds(model, aten.add.out, x, x, out=torch.empty_like(x)) == pytest.approx(121e-6)


def test_inplace_ops_that_return_nothing_are_priced() -> None:
    model = CostModel(TOY)
    xs = [torch.ones(1000, 1000), torch.ones(500, 1000)]
    ys = [torch.ones(1000, 1000), torch.ones(500, 1000)]
    # Reads 6e6 B (xs) + 6e6 B (ys), writes xs again: 18e6 B = 180 µs.
    assert seconds(model, aten._foreach_add_.List, xs, ys) == pytest.approx(181e-6)


def test_broadcast_input_counts_its_elements_once() -> None:
    model = CostModel(TOY)
    x, b = torch.ones(1000, 1000), torch.ones(1000)
    expanded = b.expand(1000, 1000)
    assert seconds(model, aten.add.Tensor, x, expanded) == pytest.approx(
        seconds(model, aten.add.Tensor, x, b))
    # A view of part of a big storage counts its own elements only.
    assert seconds(model, aten.relu.default, x[:10]) == pytest.approx(1e-6 + 8e4 / 1e11)


def test_fp16_and_bf16_rates() -> None:
    a100, turing = get_spec("a100-80gb"), get_spec("rtx-2080ti")
    assert a100.peak_flops(torch.float16) == a100.peak_flops(torch.bfloat16) == 312e12
    assert a100.peak_flops(torch.float32) == 19.5e12
    assert a100.peak_flops(torch.float32, tf32=True) == 156e12
    assert turing.peak_flops(torch.bfloat16) == turing.peak_flops(torch.float32)
    assert turing.peak_flops(torch.float32, tf32=True) == turing.peak_flops(torch.float32)
    a = b = torch.empty(2048, 2048, dtype=torch.float16, device="meta")
    flops = 2 * 2048**3
    expected = a100.launch_overhead + flops / (312e12 * a100.flops_efficiency)
    assert seconds(CostModel(a100), aten.mm.default, a, b) == pytest.approx(expected)


def test_views_and_metadata_ops_cost_nothing() -> None:
    x = torch.ones(6, 4)
    with CostMode(CostModel(TOY)) as mode:
        x.view(4, 6)
        x.t()
        x[1:3, ::2]
        x[0]
        x.unsqueeze(0).expand(3, 6, 4)
        x.split(2)
        x.unbind()
        x.detach()
        x.as_strided((2, 2), (1, 1))
        x.reshape(24)
        torch.empty(3, 3)
        x.clone().transpose_(0, 1)  # clone costs, transpose_ does not
    costs = {str(f): c.seconds for f, c in mode.ops}
    assert costs.pop("aten.clone.default") > 0
    assert len(costs) >= 11 and set(costs.values()) == {0.0}, costs


def _model_step(model: CostModel) -> CostMode:
    """One training step of a small CNN + MLP (convs, batch norm, pooling, matmuls, loss),
    priced op by op; the model and batch are made outside the pricing."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10))
    x = torch.randn(2, 3, 8, 8)
    y = torch.zeros(2, dtype=torch.long)
    with CostMode(model) as mode:
        F.cross_entropy(net(x), y).backward()
    return mode


def _priced(spec: str) -> list[tuple[str, float]]:
    """The step's aten ops and their times, without the device queries (``prim.device``,
    free) that autograd makes of fake tensors only."""
    ops = _model_step(CostModel(spec)).ops
    assert all(c.seconds == 0 for f, c in ops if f.namespace == "prim")
    return [(str(f), c.seconds) for f, c in ops if f.namespace != "prim"]


def test_meta_and_fake_tensors_price_like_real_ones() -> None:
    real = _priced("a100-80gb")
    with torch.device("meta"):
        meta = _priced("a100-80gb")
    with FakeTensorMode():
        fake = _priced("a100-80gb")
    assert any(name == "aten.convolution_backward.default" for name, _ in real)
    assert meta == real
    assert fake == real


def test_flops_match_flop_counter_mode() -> None:
    with FlopCounterMode(display=False) as counter:
        mode = _model_step(CostModel(TOY))
    assert counter.get_total_flops() > 0
    assert sum(c.flops for _, c in mode.ops) == counter.get_total_flops()


def test_cpu_attention_is_priced_by_flops() -> None:
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    with CostMode(CostModel(TOY)) as mode:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    flops = {f._overloadpacket.__name__: c.flops for f, c in mode.ops if c.flops}
    # Forward: Q·Kᵀ and P·V, 2·2·4·64·64·16 FLOPs each; backward: five such matmuls (the
    # scores recomputed, then the gradients of P, V, Q and K).
    assert flops == {"_scaled_dot_product_flash_attention_for_cpu": 4 * 2 * 4 * 64 * 64 * 16,
                     "_scaled_dot_product_flash_attention_for_cpu_backward":
                         10 * 2 * 4 * 64 * 64 * 16}


def test_unknown_spec_lists_the_known_ones() -> None:
    with pytest.raises(UnknownNameError) as err:
        get_spec("a100-8gb")
    assert err.value.known == sorted(known_specs())
    for name in ("a100-80gb", "a100-40gb", "h100", "rtx-2080ti", "titan-v", "cpu"):
        assert name in str(err.value)


def test_cpu_spec_is_measured_and_cached(tmp_path: pytest.TempPathFactory,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMBUDGET_CACHE", str(tmp_path))
    monkeypatch.delenv(devices.PINNED_SPEC_ENV)  # (the suite pins one: see conftest.py)
    with torch.device("meta"), FakeTensorMode():  # as when a trace is being recorded
        spec = get_spec("cpu")
    # Real CPU numbers, not those of meta or fake tensors (which measure as > 1e13 FLOP/s and
    # > 1e12 B/s here, since they take no time).
    assert 1e8 < spec.fp32_flops < 5e12 and 1e8 < spec.bandwidth < 5e11
    assert 1e-8 < spec.launch_overhead < 1e-3
    assert set(spec.math_rates) == set(devices.MATH_BOUND)
    assert all(1e6 < r < 1e12 for r in spec.math_rates.values())
    file = tmp_path / "cpu-spec.json"
    entries = json.loads(file.read_text())
    key = devices._cache_key()
    assert DeviceSpec(**entries[key]) == spec
    # A later process reads the file instead of measuring.
    entries[key]["bandwidth"] = 123.0
    file.write_text(json.dumps(entries))
    devices._cpu_spec.cache_clear()
    assert get_spec("cpu").bandwidth == 123.0
    devices._cpu_spec.cache_clear()


def test_a_pinned_cpu_spec_prices_every_op_and_a_bad_one_names_the_variable_and_the_fix(
        tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """$MEMBUDGET_CPU_SPEC names one spec to price CPU ops with instead of measuring this
    machine, so that the same program makes the same decisions on every machine."""
    from membudget.runtime.sizing import model_seconds

    file = tmp_path / "spec.json"
    pinned = {**json.loads((Path(__file__).parent / "data" / "cpu-spec.json").read_text()),
              "fp32_flops": 1e9, "launch_overhead": 0.0}
    file.write_text(json.dumps(pinned))
    monkeypatch.setenv(devices.PINNED_SPEC_ENV, str(file))
    devices._pinned_spec.cache_clear()
    sizing._cost_model.cache_clear()
    a, b = torch.ones(100, 100), torch.ones(100, 100)
    try:
        assert get_spec("cpu") == DeviceSpec(**pinned)
        # 2·100³ FLOPs at 1 GFLOP/s, on the pinned spec whatever this machine measures
        price = model_seconds(torch.ops.aten.mm.default, (a, b), {}, a @ b)
        assert price == pytest.approx(2e-3, rel=0.01)
        for text, why in [("{", "not the fields of one device spec"),
                          (json.dumps({"name": "cpu", "flops": 1}), "unexpected keyword")]:
            file.write_text(text)
            devices._pinned_spec.cache_clear()
            with pytest.raises(MembudgetError, match=why) as err:
                get_spec("cpu")
            assert "$MEMBUDGET_CPU_SPEC=" in str(err.value) and "unset it" in str(err.value)
        monkeypatch.setenv(devices.PINNED_SPEC_ENV, str(tmp_path / "missing.json"))
        with pytest.raises(MembudgetError, match="cannot read it"):
            get_spec("cpu")
    finally:
        monkeypatch.undo()
        devices._pinned_spec.cache_clear()
        sizing._cost_model.cache_clear()


def test_a_session_prices_ops_on_the_cpu_spec_of_the_thread_count_it_runs_at() -> None:
    """The cpu spec is measured per thread count; a session's op prices must follow the
    count of the moment, not whichever count priced an op first in the process (a test that
    ran at one thread used to change the evictions of every later one)."""
    from membudget.runtime.sizing import model_seconds

    a, b = torch.ones(256, 256), torch.ones(256, 256)
    out = a @ b
    threads = torch.get_num_threads()
    try:
        prices = {}
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            price = model_seconds(torch.ops.aten.mm.default, (a, b), {}, out)
            assert price == CostModel("cpu").op_seconds(torch.ops.aten.mm.default, (a, b), {}, out)
            assert prices.setdefault(n, price) == price
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", [c for c in CASES if c.canonical], ids=lambda c: c.op)
def test_coop_table1_within_2x(case: object) -> None:
    d = density(case, CostModel("rtx-2080ti"))  # type: ignore[arg-type]
    lo, hi = d.case.paper
    assert lo / 2 <= d.us_per_mb <= hi * 2, (d.case.shape, d.us_per_mb)
