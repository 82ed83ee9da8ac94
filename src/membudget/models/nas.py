"""A Single Path One-Shot (SPOS, Guo et al. 2020) supernet: a ShuffleNetV2 backbone whose 20
layers each hold 4 candidate blocks, one drawn per layer at every forward."""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
from torch import nn

# ShuffleNetV2 stage widths and depths of the SPOS supernet (first_conv 16, last conv 1024).
STAGES: tuple[tuple[int, int], ...] = ((64, 4), (160, 4), (320, 8), (640, 4))
STEM_CHANNELS = 16
LAST_CHANNELS = 1024


def _pointwise(cin: int, cout: int, relu: bool = True) -> list[nn.Module]:
    """1×1 convolution and batch norm, optionally followed by ReLU."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout)]
    return [*layers, nn.ReLU(inplace=True)] if relu else layers


def _depthwise(channels: int, kernel: int, stride: int) -> list[nn.Module]:
    """Depthwise convolution and batch norm (no ReLU, as in ShuffleNetV2)."""
    return [nn.Conv2d(channels, channels, kernel, stride=stride, padding=kernel // 2,
                      groups=channels, bias=False), nn.BatchNorm2d(channels)]


class ShuffleUnit(nn.Module):
    """ShuffleNetV2 unit. Stride 1: half the channels pass through, the other half go through
    ``main``. Stride 2: ``main`` and a depthwise ``proj`` branch both read the whole input."""

    def __init__(self, cin: int, stride: int, main: list[nn.Module], proj_kernel: int) -> None:
        super().__init__()
        self.main = nn.Sequential(*main)
        self.proj = (nn.Sequential(*_depthwise(cin, proj_kernel, 2), *_pointwise(cin, cin))
                     if stride == 2 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.proj is None:
            b, c, h, w = x.shape
            pairs = x.reshape(b, c // 2, 2, h, w)  # channel shuffle: even channels pass through
            return torch.cat([pairs[:, :, 0], self.main(pairs[:, :, 1])], 1)
        return torch.cat([self.proj(x), self.main(x)], 1)


def shuffle_block(cin: int, cout: int, stride: int, kernel: int) -> ShuffleUnit:
    """ShuffleNetV2 block with a ``kernel``×``kernel`` depthwise conv (SPOS choices 0–2)."""
    inner = cin if stride == 2 else cin // 2
    mid = cout // 2
    main = [*_pointwise(inner, mid), *_depthwise(mid, kernel, stride),
            *_pointwise(mid, cout - inner)]
    return ShuffleUnit(cin, stride, main, kernel)


def xception_block(cin: int, cout: int, stride: int) -> ShuffleUnit:
    """ShuffleNetV2 block with three depthwise 3×3 + pointwise pairs (SPOS choice 3)."""
    inner = cin if stride == 2 else cin // 2
    mid = cout // 2
    main = [*_depthwise(inner, 3, stride), *_pointwise(inner, mid),
            *_depthwise(mid, 3, 1), *_pointwise(mid, mid),
            *_depthwise(mid, 3, 1), *_pointwise(mid, cout - inner)]
    return ShuffleUnit(cin, stride, main, 3)


class ChoiceLayer(nn.Module):
    """One searchable layer: the four SPOS candidates (kernel 3, 5, 7, Xception-style)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.candidates = nn.ModuleList(
            [*(shuffle_block(cin, cout, stride, k) for k in (3, 5, 7)),
             xception_block(cin, cout, stride)])

    def forward(self, x: torch.Tensor, choice: int) -> torch.Tensor:
        return self.candidates[choice](x)


class SPOSSupernet(nn.Module):
    """The SPOS ShuffleNetV2 supernet for 224×224 inputs. Each forward draws a fresh path, one
    candidate per layer, from the model's own ``random.Random(seed)``: the graph changes every
    step, deterministically, independent of data and of torch's RNG."""

    def __init__(self, classes: int = 1000, seed: int = 0) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.last_path: tuple[int, ...] = ()
        self.stem = nn.Sequential(nn.Conv2d(3, STEM_CHANNELS, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(STEM_CHANNELS), nn.ReLU(inplace=True))
        layers = []
        cin = STEM_CHANNELS
        for width, depth in STAGES:
            for i in range(depth):
                layers.append(ChoiceLayer(cin, width, stride=2 if i == 0 else 1))
                cin = width
        self.layers = nn.ModuleList(layers)
        self.head = nn.Sequential(*_pointwise(cin, LAST_CHANNELS), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Dropout(0.1),
                                  nn.Linear(LAST_CHANNELS, classes, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_path = tuple(self.rng.randrange(len(layer.candidates)) for layer in self.layers)
        x = self.stem(x)
        for layer, choice in zip(self.layers, self.last_path, strict=True):
            x = layer(x, choice)
        return self.head(x)

    def path_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters the last forward used: stem, head and the chosen candidates."""
        yield from self.stem.parameters()
        for layer, choice in zip(self.layers, self.last_path, strict=True):
            yield from layer.candidates[choice].parameters()
        yield from self.head.parameters()
