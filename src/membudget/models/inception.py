"""GoogLeNet and Inception-v3 as torchvision defines them, without auxiliary classifiers:
multi-branch blocks whose outputs are concatenated, so many activations are live at once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Size = int | tuple[int, int]


class ConvBN(nn.Module):
    """Convolution without bias, batch norm (eps 1e-3) and in-place ReLU: every Inception conv."""

    def __init__(self, cin: int, cout: int, kernel: Size, stride: Size = 1,
                 padding: Size = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)), inplace=True)


def _chain(*convs: ConvBN) -> nn.Sequential:
    """Convolutions applied one after the other: one branch of an Inception block."""
    return nn.Sequential(*convs)


def _max_pool(kernel: int) -> nn.MaxPool2d:
    """GoogLeNet's stride-2 max pool, rounding the output size up as the Caffe model does."""
    return nn.MaxPool2d(kernel, stride=2, ceil_mode=True)


class GoogLeNetBlock(nn.Module):
    """GoogLeNet's Inception block: 1×1, 1×1→3×3, 1×1→3×3 and pool→1×1 branches, concatenated.
    The third branch uses a 3×3 kernel where the paper has 5×5, as torchvision does (6.6M)."""

    def __init__(self, cin: int, c1: int, c3red: int, c3: int, c5red: int, c5: int,
                 pool_proj: int) -> None:
        super().__init__()
        self.branch1 = ConvBN(cin, c1, 1)
        self.branch2 = _chain(ConvBN(cin, c3red, 1), ConvBN(c3red, c3, 3, padding=1))
        self.branch3 = _chain(ConvBN(cin, c5red, 1), ConvBN(c5red, c5, 3, padding=1))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True),
                                     ConvBN(cin, pool_proj, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = (self.branch1, self.branch2, self.branch3, self.branch4)
        return torch.cat([branch(x) for branch in branches], 1)


class GoogLeNet(nn.Module):
    """Szegedy et al. 2015 (torchvision layout, aux classifiers off): 6.6M parameters."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            ConvBN(3, 64, 7, stride=2, padding=3), _max_pool(3),
            ConvBN(64, 64, 1), ConvBN(64, 192, 3, padding=1), _max_pool(3),
        )
        self.blocks = nn.Sequential(
            GoogLeNetBlock(192, 64, 96, 128, 16, 32, 32),
            GoogLeNetBlock(256, 128, 128, 192, 32, 96, 64),
            _max_pool(3),
            GoogLeNetBlock(480, 192, 96, 208, 16, 48, 64),
            GoogLeNetBlock(512, 160, 112, 224, 24, 64, 64),
            GoogLeNetBlock(512, 128, 128, 256, 24, 64, 64),
            GoogLeNetBlock(512, 112, 144, 288, 32, 64, 64),
            GoogLeNetBlock(528, 256, 160, 320, 32, 128, 128),
            _max_pool(2),
            GoogLeNetBlock(832, 256, 160, 320, 32, 128, 128),
            GoogLeNetBlock(832, 384, 192, 384, 48, 128, 128),
        )
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(1024, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1)
        return self.fc(self.dropout(torch.flatten(x, 1)))


class InceptionA(nn.Module):
    """35×35 block: 1×1, 5×5, double 3×3 and average-pool branches."""

    def __init__(self, cin: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = ConvBN(cin, 64, 1)
        self.branch5x5 = _chain(ConvBN(cin, 48, 1), ConvBN(48, 64, 5, padding=2))
        self.branch3x3dbl = _chain(ConvBN(cin, 64, 1), ConvBN(64, 96, 3, padding=1),
                                   ConvBN(96, 96, 3, padding=1))
        self.branch_pool = ConvBN(cin, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.branch_pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.branch1x1(x), self.branch5x5(x), self.branch3x3dbl(x), pooled], 1)


class InceptionB(nn.Module):
    """35→17 grid reduction: strided 3×3, strided double 3×3 and max-pool branches."""

    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3 = ConvBN(cin, 384, 3, stride=2)
        self.branch3x3dbl = _chain(ConvBN(cin, 64, 1), ConvBN(64, 96, 3, padding=1),
                                   ConvBN(96, 96, 3, stride=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.max_pool2d(x, 3, stride=2)
        return torch.cat([self.branch3x3(x), self.branch3x3dbl(x), pooled], 1)


class InceptionC(nn.Module):
    """17×17 block with factorized 7×7 convolutions (1×7 then 7×1), ``c7`` channels inside."""

    def __init__(self, cin: int, c7: int) -> None:
        super().__init__()
        self.branch1x1 = ConvBN(cin, 192, 1)
        self.branch7x7 = _chain(ConvBN(cin, c7, 1), ConvBN(c7, c7, (1, 7), padding=(0, 3)),
                                ConvBN(c7, 192, (7, 1), padding=(3, 0)))
        self.branch7x7dbl = _chain(
            ConvBN(cin, c7, 1),
            ConvBN(c7, c7, (7, 1), padding=(3, 0)), ConvBN(c7, c7, (1, 7), padding=(0, 3)),
            ConvBN(c7, c7, (7, 1), padding=(3, 0)), ConvBN(c7, 192, (1, 7), padding=(0, 3)),
        )
        self.branch_pool = ConvBN(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.branch_pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.branch1x1(x), self.branch7x7(x), self.branch7x7dbl(x), pooled], 1)


class InceptionD(nn.Module):
    """17→8 grid reduction: strided 3×3, 7×7-then-strided-3×3 and max-pool branches."""

    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3 = _chain(ConvBN(cin, 192, 1), ConvBN(192, 320, 3, stride=2))
        self.branch7x7x3 = _chain(
            ConvBN(cin, 192, 1), ConvBN(192, 192, (1, 7), padding=(0, 3)),
            ConvBN(192, 192, (7, 1), padding=(3, 0)), ConvBN(192, 192, 3, stride=2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.max_pool2d(x, 3, stride=2)
        return torch.cat([self.branch3x3(x), self.branch7x7x3(x), pooled], 1)


class SplitConv(nn.Module):
    """A 1×3 and a 3×1 convolution of the same input, concatenated (InceptionE's fan-out)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.wide = ConvBN(channels, channels, (1, 3), padding=(0, 1))
        self.tall = ConvBN(channels, channels, (3, 1), padding=(1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.wide(x), self.tall(x)], 1)


class InceptionE(nn.Module):
    """8×8 block with expanded filter banks: 1×1, split 3×3, double split 3×3 and pool branches."""

    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch1x1 = ConvBN(cin, 320, 1)
        self.branch3x3 = nn.Sequential(ConvBN(cin, 384, 1), SplitConv(384))
        self.branch3x3dbl = nn.Sequential(ConvBN(cin, 448, 1), ConvBN(448, 384, 3, padding=1),
                                          SplitConv(384))
        self.branch_pool = ConvBN(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.branch_pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.branch1x1(x), self.branch3x3(x), self.branch3x3dbl(x), pooled], 1)


class InceptionV3(nn.Module):
    """Szegedy et al. 2016 for 299×299 inputs (torchvision layout, aux logits off): 23.8M."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            ConvBN(3, 32, 3, stride=2), ConvBN(32, 32, 3), ConvBN(32, 64, 3, padding=1),
            nn.MaxPool2d(3, stride=2),
            ConvBN(64, 80, 1), ConvBN(80, 192, 3),
            nn.MaxPool2d(3, stride=2),
        )
        self.blocks = nn.Sequential(
            InceptionA(192, 32), InceptionA(256, 64), InceptionA(288, 64),
            InceptionB(288),
            InceptionC(768, 128), InceptionC(768, 160), InceptionC(768, 160), InceptionC(768, 192),
            InceptionD(768),
            InceptionE(1280), InceptionE(2048),
        )
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1)
        return self.fc(self.dropout(torch.flatten(x, 1)))
