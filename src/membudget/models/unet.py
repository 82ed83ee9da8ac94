"""U-Net (Ronneberger et al. 2015) with padded convolutions and batch norm: a 64→1024-channel
encoder, a transposed-conv decoder with skip connections, and per-pixel class scores."""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn


class DoubleConv(nn.Module):
    """Two 3×3 conv-BN-ReLU layers at the same resolution: the unit of every U-Net level."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Up(nn.Module):
    """Decoder level: 2× transposed-conv upsampling, zero-padded to the skip's size (odd sizes
    lose a row or column on the way down), concatenated with the skip, then a DoubleConv."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = DoubleConv(cin, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        dh, dw = skip.shape[2] - x.shape[2], skip.shape[3] - x.shape[3]
        x = F.pad(x, (dw // 2, dw - dw // 2, dh // 2, dh - dh // 2))
        return self.conv(torch.cat([skip, x], 1))


class UNet(nn.Module):
    """The classic five-level U-Net (31.0M parameters at 2 classes); any input size works and
    the output has the input's height and width."""

    def __init__(self, in_channels: int = 3, classes: int = 2) -> None:
        super().__init__()
        widths = (64, 128, 256, 512, 1024)
        self.inc = DoubleConv(in_channels, widths[0])
        self.downs = nn.ModuleList(DoubleConv(a, b) for a, b in pairwise(widths))
        self.ups = nn.ModuleList(Up(a, b) for a, b in pairwise(widths[::-1]))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(F.max_pool2d(skips[-1], 2)))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.head(x)
