"""The zoo models built from transformers configs (``membudget.models.hf``): published parameter
counts, builds on the default device and dtype with torch's layer init skipped, deterministic
seeded builds, real training steps at small batches, and allocation-free steps at paper batches
under ``FakeTensorMode``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from membudget.models import hf
from membudget.models.zoo import ZOO, Workload

# Published parameter counts: torchvision's tables for the vision models; for the language
# models the exact counts of the released checkpoints (the papers round GPT-2 to 117M, BERT-Large
# to 340M and XLM-R base to 270M).
PUBLISHED_PARAMS = {
    "resnet-50": 25.6e6,
    "swin-t": 28.3e6,
    "gpt2": 124.4e6,
    "bert-large": 335e6,  # MLM head tied to the input embedding
    "gpt3-2.7b": 2.65e9,  # GPT-3's table rounds it to 2.7B
    "mobilenet-v2": 3.5e6,
    "efficientnet-b0": 5.3e6,
    "vit-b16": 86.6e6,
    "xlm-r-base": 278e6,
}
NAMES = list(PUBLISHED_PARAMS)

# Per-example input shape: the sequence length is part of the workload at every batch size.
EXAMPLE_SHAPE = {
    "gpt2": (512,),
    "bert-large": (512,),
    "gpt3-2.7b": (1024,),
    "xlm-r-base": (128,),
}
IMAGE_SHAPE = (3, 224, 224)
# Models with attention, all on torch's scaled_dot_product_attention.
ATTENTION = {"swin-t", "gpt2", "bert-large", "gpt3-2.7b", "vit-b16", "xlm-r-base"}

# Live steps at small_batch that take over ~3 s on 2 cores (batch 1 is already the least).
SLOW_LIVE = {"gpt2", "bert-large", "xlm-r-base"}
LIVE = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LIVE else n
        for n in NAMES if n != "gpt3-2.7b"]

# Vision models cheap enough to build and run forward twice: ViT-B/16 for its truncated-normal
# init, the others for their dropout or drop-path.
DETERMINISM = ["mobilenet-v2", "efficientnet-b0", "swin-t", "vit-b16"]


def _params(model: torch.nn.Module) -> int:
    """Parameter count; a tied weight counts once, as ``parameters()`` yields it once."""
    return sum(p.numel() for p in model.parameters())


def _tensors(workload: Workload) -> Iterator[torch.Tensor]:
    """Every tensor a workload holds: parameters, buffers and the batch."""
    yield from workload.model.parameters()
    yield from workload.model.buffers()
    yield from workload.batch.values()


def _check_batch(name: str, workload: Workload, batch: int) -> None:
    """The inputs are ``batch`` examples of the model's full size (image or sequence), with
    labels and no attention mask."""
    inputs = "input_ids" if name in EXAMPLE_SHAPE else "pixel_values"
    assert set(workload.batch) == {inputs, "labels"}
    shape = (batch, *EXAMPLE_SHAPE.get(name, IMAGE_SHAPE))
    assert tuple(workload.batch[inputs].shape) == shape


def _step(workload: Workload) -> torch.Tensor:
    """One forward and backward of the workload's loss; returns the loss."""
    loss = workload.loss(workload.model, workload.batch)
    loss.backward()
    return loss


def _check_live_step(workload: Workload) -> None:
    """A real step gives a finite scalar loss and a finite gradient on every parameter."""
    loss = _step(workload)
    assert loss.ndim == 0 and torch.isfinite(loss)
    for pname, p in workload.model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.fixture
def bfloat16_default() -> Iterator[None]:
    """Make bfloat16 the default dtype for one test."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    yield
    torch.set_default_dtype(previous)


def test_zoo_entries() -> None:
    """Every model is registered with its paper batch and a smaller live batch."""
    assert set(NAMES) <= set(ZOO)
    for name in NAMES:
        entry = ZOO[name]
        assert entry.build.__module__ == hf.__name__
        assert 1 <= entry.small_batch <= entry.batch
        assert entry.paper in ("Coop", "OLLA")


@pytest.mark.parametrize("name", NAMES)
def test_parameter_count_matches_published(name: str) -> None:
    """The meta build at the paper batch has the published parameter count (within 2%)."""
    with torch.device("meta"):
        workload = ZOO[name].build(ZOO[name].batch)
    assert _params(workload.model) == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.usefixtures("bfloat16_default")
def test_builds_on_default_device_and_dtype_in_train_mode(name: str) -> None:
    """Under a meta device and a bfloat16 default, every tensor is meta and every float is
    bfloat16 (no ``device=`` or ``.to()``); the model trains, with sdpa attention."""
    with torch.device("meta"):
        workload = ZOO[name].build(2)
    _check_batch(name, workload, 2)
    for t in _tensors(workload):
        assert t.is_meta
        assert t.dtype in (torch.bfloat16, torch.int64)
    assert all(m.training for m in workload.model.modules())
    if name in ATTENTION:
        assert workload.model.config._attn_implementation == "sdpa"


def test_gpt3_builds_on_meta_in_seconds() -> None:
    """GPT-3 2.7B builds on meta in seconds: no init runs on its 2.65B parameters."""
    start = time.perf_counter()
    with torch.device("meta"):
        hf.build_gpt3(ZOO["gpt3-2.7b"].batch)
    assert time.perf_counter() - start < 5


def test_torch_default_layer_init_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch.nn.init calls in layers' constructors never run: transformers' init, which
    replaces them, is then the only init."""
    calls: list[str] = []

    def counted(fn: str) -> Callable[..., torch.Tensor]:
        """``torch.nn.init.<fn>``, recording each call in ``calls``."""
        original = getattr(torch.nn.init, fn)

        def init(*args: Any, **kwargs: Any) -> torch.Tensor:
            """Record the call, then initialize."""
            calls.append(fn)
            return original(*args, **kwargs)
        return init

    for fn in ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_"):
        monkeypatch.setattr(torch.nn.init, fn, counted(fn))
    for name in NAMES:
        with torch.device("meta"):
            ZOO[name].build(1)
    assert calls == []


@pytest.mark.parametrize("name", DETERMINISM)
def test_seeded_builds_are_deterministic(name: str) -> None:
    """The same seed gives the same weights, buffers, batch and (dropout included) loss."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        workload = ZOO[name].build(2)
        loss = workload.loss(workload.model, workload.batch)
        runs.append(([t.detach() for t in _tensors(workload)], loss.detach()))
    (first, first_loss), (second, second_loss) = runs
    assert len(first) == len(second)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert torch.equal(first_loss, second_loss)


@pytest.mark.parametrize("name", LIVE)
def test_live_step_at_small_batch(name: str) -> None:
    """A real step at small_batch (full-size examples) gives finite gradients everywhere."""
    entry = ZOO[name]
    torch.manual_seed(0)
    workload = entry.build(entry.small_batch)
    _check_batch(name, workload, entry.small_batch)
    assert _params(workload.model) == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)
    _check_live_step(workload)


@pytest.mark.slow
def test_gpt3_live_step_with_two_layers() -> None:
    """The full GPT-3 cannot train here, so its builder runs for real with 2 of its 32 layers."""
    torch.manual_seed(0)
    workload = hf.build_gpt3(ZOO["gpt3-2.7b"].small_batch, n_layer=2)
    _check_batch("gpt3-2.7b", workload, ZOO["gpt3-2.7b"].small_batch)
    assert len(workload.model.transformer.h) == 2
    _check_live_step(workload)


@pytest.mark.parametrize("name", NAMES)
def test_fake_step_at_paper_batch(name: str) -> None:
    """At the paper batch, a step under FakeTensorMode runs and only makes fake tensors."""
    entry = ZOO[name]
    with FakeTensorMode():
        workload = entry.build(entry.batch)
        loss = _step(workload)
    _check_batch(name, workload, entry.batch)
    assert isinstance(loss, FakeTensor) and loss.ndim == 0
    assert all(isinstance(t, FakeTensor) for t in _tensors(workload))
    assert _params(workload.model) == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)
    for pname, p in workload.model.named_parameters():
        assert isinstance(p.grad, FakeTensor) and p.grad.shape == p.shape, pname


# ru_maxrss survives exec, so a child of pytest would report pytest's own peak: the child forks
# first, while still small, and the fork (whose count starts afresh) measures the step.
GPT3_FAKE_STEP = """
import os
if os.fork():
    raise SystemExit(os.waitstatus_to_exitcode(os.wait()[1]))
import json, resource, time
from torch._subclasses.fake_tensor import FakeTensorMode
from membudget.models.hf import build_gpt3
start = time.perf_counter()
with FakeTensorMode():
    workload = build_gpt3(2)
    workload.loss(workload.model, workload.batch).backward()
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "peak_rss": peak}))
"""


def test_gpt3_fake_step_allocates_nothing() -> None:
    """GPT-3 2.7B's fake step at batch 2 in a fresh process peaks far below the 10.6 GB its
    fp32 parameters alone would take (the interpreter with torch and transformers is ~0.4 GB)."""
    assert ZOO["gpt3-2.7b"].batch == 2
    out = subprocess.run([sys.executable, "-c", GPT3_FAKE_STEP], capture_output=True, text=True,
                         check=True)
    result = json.loads(out.stdout.splitlines()[-1])
    print(f"gpt3-2.7b fake step: {result['seconds']:.1f} s, peak RSS "
          f"{result['peak_rss'] / 2**30:.2f} GiB")
    assert result["peak_rss"] < 2 * 2**30
