"""Residual networks: He et al.'s CIFAR ResNet-(6n+2) (DTR's ResNet-1202 is n=200) and the 3-D
ResNet-18 video classifier (torchvision's r3d_18, which OLLA benchmarks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PadShortcut(nn.Module):
    """Parameter-free shortcut ("option A"): subsample by 2 and zero-pad the new channels."""

    def __init__(self, extra_channels: int) -> None:
        super().__init__()
        self.extra = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = self.extra // 2
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, half, self.extra - half))


class CifarBlock(nn.Module):
    """Two 3×3 conv-BN layers plus the identity (or padded, strided) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = PadShortcut(cout - cin) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32×32 inputs: three stages of ``n`` blocks at 16/32/64 channels.
    n=200 is ResNet-1202 (19.4M parameters), the deepest network of He et al. 2016."""

    def __init__(self, n: int, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        cin = 16
        for stage, width in enumerate((16, 32, 64)):
            for i in range(n):
                blocks.append(CifarBlock(cin, width, stride=2 if stage > 0 and i == 0 else 1))
                cin = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _conv_bn_3d(cin: int, cout: int, kernel: tuple[int, int, int], stride: tuple[int, int, int],
                padding: tuple[int, int, int]) -> nn.Sequential:
    """A bias-free 3-D convolution followed by batch norm."""
    return nn.Sequential(
        nn.Conv3d(cin, cout, kernel, stride=stride, padding=padding, bias=False),
        nn.BatchNorm3d(cout),
    )


class VideoBlock(nn.Module):
    """Basic residual block of full 3×3×3 convolutions; a strided 1×1×1 conv-BN shortcut when
    the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        s = (stride, stride, stride)
        self.conv1 = _conv_bn_3d(cin, cout, (3, 3, 3), s, (1, 1, 1))
        self.conv2 = _conv_bn_3d(cout, cout, (3, 3, 3), (1, 1, 1), (1, 1, 1))
        self.shortcut = (_conv_bn_3d(cin, cout, (1, 1, 1), s, (0, 0, 0))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.conv1(x), inplace=True)
        return F.relu(self.conv2(out) + self.shortcut(x), inplace=True)


class R3D18(nn.Module):
    """3-D ResNet-18 (Tran et al. 2018; torchvision ``r3d_18``): clips of 3×T×112×112 frames,
    400 Kinetics classes, 33.4M parameters."""

    def __init__(self, classes: int = 400) -> None:
        super().__init__()
        self.stem = _conv_bn_3d(3, 64, (3, 7, 7), (1, 2, 2), (1, 3, 3))
        blocks: list[nn.Module] = []
        cin = 64
        for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [VideoBlock(cin, width, stride), VideoBlock(width, width, 1)]
            cin = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x), inplace=True))
        return self.fc(torch.flatten(F.adaptive_avg_pool3d(x, 1), 1))
