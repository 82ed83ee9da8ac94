"""DenseNet-121 (Huang et al. 2017) as torchvision defines it: every layer reads the
concatenation of all earlier feature maps of its block, a memory-hungry pattern."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _bn_relu_conv(cin: int, cout: int, kernel: int) -> nn.Sequential:
    """Pre-activation unit: batch norm, ReLU, then a bias-free convolution."""
    return nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=True),
                         nn.Conv2d(cin, cout, kernel, padding=kernel // 2, bias=False))


class DenseLayer(nn.Module):
    """Bottleneck layer: BN-ReLU-1×1 conv to 4·growth channels, then BN-ReLU-3×3 conv to growth."""

    def __init__(self, cin: int, growth: int, bottleneck: int = 4) -> None:
        super().__init__()
        self.reduce = _bn_relu_conv(cin, bottleneck * growth, 1)
        self.grow = _bn_relu_conv(bottleneck * growth, growth, 3)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.grow(self.reduce(torch.cat(features, 1)))


class DenseBlock(nn.Module):
    """``layers`` dense layers; the block's output concatenates its input and every new map."""

    def __init__(self, cin: int, layers: int, growth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet121(nn.Module):
    """DenseNet-121 for 224×224 ImageNet inputs: growth 32, blocks of 6/12/24/16 layers, 8.0M."""

    def __init__(self, classes: int = 1000, growth: int = 32,
                 block_layers: tuple[int, ...] = (6, 12, 24, 16)) -> None:
        super().__init__()
        stages: list[nn.Module] = [
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
            nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1),
        ]
        channels = 64
        for i, layers in enumerate(block_layers):
            stages.append(DenseBlock(channels, layers, growth))
            channels += layers * growth
            if i < len(block_layers) - 1:
                stages += [_bn_relu_conv(channels, channels // 2, 1), nn.AvgPool2d(2, stride=2)]
                channels //= 2
        stages.append(nn.BatchNorm2d(channels))
        self.features = nn.Sequential(*stages)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.features(x), inplace=True)
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
