"""Coop's Table 1 as a check on the cost model: cost density (time per MB of output) of forward
fp32 ops on an RTX 2080 Ti, for ResNet-50 (batch 64) and BERT-Large (batch 8, seq 512) shapes.

The paper (Zhang et al., "Coop: Memory is not a Commodity", NeurIPS 2023) gives one density
per op type: convolution and matmul about 33-89 µs/MB, layer and batch norm about 4-5, ReLU
and GELU about 3.9. Density grows with the reduction length of a matmul or convolution, so
only some shapes fall in the paper's range; ``canonical`` marks the shape each row stands for.
MB here is 2^20 bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from membudget.cost.model import CostMode, CostModel

MB = 1 << 20
CONV_MATMUL = (33.0, 89.0)
NORM = (4.0, 5.0)
ACTIVATION = (3.9, 3.9)


@dataclass(frozen=True)
class DensityCase:
    """One op at one shape: ``inputs()`` builds its inputs (on the current device), ``run``
    applies the op to them and returns the output whose size the density divides by."""

    op: str
    model: str
    shape: str
    paper: tuple[float, float]
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    run: Callable[..., torch.Tensor]
    canonical: bool = False


def _conv(n: int, cin: int, cout: int, hw: int, k: int, stride: int = 1) -> DensityCase:
    return DensityCase(
        "conv2d", "ResNet-50", f"{k}×{k}/{stride} {cin}→{cout}, {hw}×{hw}, batch {n}",
        CONV_MATMUL, lambda: (torch.empty(n, cin, hw, hw), torch.empty(cout, cin, k, k)),
        lambda x, w: F.conv2d(x, w, stride=stride, padding=k // 2),
        canonical=(k, cin, cout) == (3, 256, 256))


def _linear(tokens: int, fin: int, fout: int, what: str) -> DensityCase:
    return DensityCase(
        "matmul", "BERT-Large", f"{what}: [8, 512, {fin}] × [{fin}, {fout}]", CONV_MATMUL,
        lambda: (torch.empty(8, tokens // 8, fin), torch.empty(fout, fin), torch.empty(fout)),
        F.linear, canonical=(fin, fout) == (1024, 4096))


def _bmm(a: tuple[int, int, int], b: tuple[int, int, int], what: str) -> DensityCase:
    return DensityCase(
        "matmul", "BERT-Large", f"{what}: [{a[0]}, {a[1]}, {a[2]}] × [{b[0]}, {b[1]}, {b[2]}]",
        CONV_MATMUL, lambda: (torch.empty(*a), torch.empty(*b)), torch.bmm)


def _batch_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, mean: torch.Tensor,
                var: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, mean, var, w, b, training=True)


CASES: tuple[DensityCase, ...] = (
    _conv(64, 3, 64, 224, 7, stride=2),
    _conv(64, 256, 64, 56, 1),
    _conv(64, 64, 64, 56, 3),
    _conv(64, 64, 256, 56, 1),
    _conv(64, 1024, 256, 14, 1),
    _conv(64, 256, 256, 14, 3),
    _linear(4096, 1024, 1024, "QKV / output projection"),
    _linear(4096, 1024, 4096, "FFN up"),
    _linear(4096, 4096, 1024, "FFN down"),
    _bmm((128, 512, 64), (128, 64, 512), "attention scores QKᵀ"),
    _bmm((128, 512, 512), (128, 512, 64), "attention × V"),
    DensityCase("batch norm", "ResNet-50", "256 ch, 56×56, batch 64, training", NORM,
                lambda: (torch.empty(64, 256, 56, 56), torch.empty(256), torch.empty(256),
                         torch.empty(256), torch.empty(256)), _batch_norm, canonical=True),
    DensityCase("layer norm", "BERT-Large", "[8, 512, 1024]", NORM,
                lambda: (torch.empty(8, 512, 1024), torch.empty(1024), torch.empty(1024)),
                lambda x, w, b: F.layer_norm(x, (1024,), w, b), canonical=True),
    DensityCase("ReLU", "ResNet-50", "[64, 256, 56, 56]", ACTIVATION,
                lambda: (torch.empty(64, 256, 56, 56),), F.relu, canonical=True),
    DensityCase("GELU", "BERT-Large", "[8, 512, 4096]", ACTIVATION,
                lambda: (torch.empty(8, 512, 4096),), F.gelu, canonical=True),
)


@dataclass(frozen=True)
class Density:
    """A case's prediction: seconds of all its aten ops, output MB, and µs per MB."""

    case: DensityCase
    seconds: float
    out_mb: float

    @property
    def us_per_mb(self) -> float:
        return self.seconds * 1e6 / self.out_mb

    @property
    def within_2x(self) -> bool:
        lo, hi = self.case.paper
        return lo / 2 <= self.us_per_mb <= hi * 2


def density(case: DensityCase, model: CostModel) -> Density:
    """Predict ``case`` on meta tensors (nothing is allocated, so paper-sized shapes are free)."""
    with torch.device("meta"):
        inputs = case.inputs()
        with CostMode(model) as mode:
            out = case.run(*inputs)
    return Density(case, mode.seconds, out.numel() * out.element_size() / MB)
