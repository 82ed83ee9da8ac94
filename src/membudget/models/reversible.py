"""Reversible zoo models and their plain twins: a RevViT (Mangalam et al., CVPR 2022) and a
RevBiFPN-style CNN (Chiley et al., MLSys 2023), built on :mod:`membudget.reversible`.

Each model's reversible part is one :class:`ReversibleSequence`; its ``-plain`` twin is the
same module tree and parameters with ``reversible=False`` (plain autograd keeps every
activation), so the two compute the same function and differ only in memory and time.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from membudget.models.custom import classification
from membudget.models.zoo import Workload, ZooModel, register
from membudget.reversible import RevBlock, ReversibleSequence, RevSilo


class Attention(nn.Module):
    """RevViT's F: pre-norm multi-head self-attention over (N, T, D) tokens."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.heads = heads
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        qkv = self.qkv(self.norm(x)).view(n, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        return self.drop(self.proj(out))


class MLP(nn.Module):
    """RevViT's G: pre-norm two-layer GELU MLP."""

    def __init__(self, dim: int, ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, ratio * dim), nn.GELU(),
                                 nn.Dropout(dropout), nn.Linear(ratio * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class RevViT(nn.Module):
    """Patch embedding, ``depth`` reversible blocks (F attention, G MLP) on two copies of
    the tokens, their mean, a LayerNorm, mean pooling and a linear head."""

    def __init__(self, image: int = 224, patch: int = 16, dim: int = 384, depth: int = 12,
                 heads: int = 6, classes: int = 1000, dropout: float = 0.0,
                 reversible: bool = True) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2, dim) * 0.02)
        self.blocks = ReversibleSequence(
            *[RevBlock(Attention(dim, heads, dropout), MLP(dim, dropout=dropout))
              for _ in range(depth)], reversible=reversible)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        a, b = self.blocks(tokens, tokens)
        return self.head(self.norm((a + b) / 2).mean(1))


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class Fuse(nn.Module):
    """A RevSilo function: the source streams resampled to the target's scale (average
    pooling down from finer ones, nearest up from coarser ones) and width (1×1 convs), summed,
    then GroupNorm, SiLU and a 3×3 conv. ``sources`` are (channels, scale) pairs, scale
    ``s`` being 2**s times coarser than the finest stream."""

    def __init__(self, sources: list[tuple[int, int]], channels: int, scale: int) -> None:
        super().__init__()
        self.shifts = [scale - s for _, s in sources]
        self.widths = nn.ModuleList(nn.Conv2d(c, channels, 1, bias=False) for c, _ in sources)
        self.out = nn.Sequential(_group_norm(channels), nn.SiLU(),
                                 nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        total = None
        for x, width, shift in zip(xs, self.widths, self.shifts, strict=True):
            if shift > 0:
                x = width(F.avg_pool2d(x, 2 ** shift))
            else:
                x = F.interpolate(width(x), scale_factor=2 ** -shift, mode="nearest")
            total = x if total is None else total + x
        return self.out(total)


def rev_silo(channels: tuple[int, ...]) -> RevSilo:
    """A RevSilo over streams of ``channels`` widths, stream i at scale i."""
    n = len(channels)
    up = [Fuse([(channels[j], j) for j in range(i)], channels[i], i) for i in range(1, n)]
    down = [Fuse([(channels[j], j) for j in range(i + 1, n)], channels[i], i)
            for i in range(n - 1)]
    return RevSilo(up, down)


class RevBiFPN(nn.Module):
    """RevBiFPN's SpaceToDepth stem (4×4 pixel unshuffle, then a 1×1 conv) to the stream at
    1/4 of the image, strided conv-GroupNorm-SiLU layers to the coarser ones (1/8, 1/16),
    ``depth`` RevSilos over them, and a head: each stream pooled, concatenated, linear."""

    def __init__(self, channels: tuple[int, ...] = (32, 64, 128), depth: int = 4,
                 classes: int = 1000, reversible: bool = True) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                                 _group_norm(cout), nn.SiLU())

        self.stem = nn.Sequential(nn.PixelUnshuffle(4), nn.Conv2d(48, channels[0], 1))
        self.down = nn.ModuleList(conv(a, b) for a, b in pairwise(channels))
        self.silos = ReversibleSequence(*[rev_silo(channels) for _ in range(depth)],
                                        reversible=reversible)
        self.head = nn.Linear(sum(channels), classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        streams = [self.stem(x)]
        for down in self.down:
            streams.append(down(streams[-1]))
        out = self.silos(*streams)
        return self.head(torch.cat([s.mean((2, 3)) for s in out], 1))


def build_revvit(batch: int, reversible: bool = True, **config: Any) -> Workload:
    """RevViT-S (384 wide, 12 blocks, 6 heads, 16×16 patches) on 3×224×224, 1000 classes;
    ``config`` overrides :class:`RevViT`'s arguments (``image`` included)."""
    model = RevViT(reversible=reversible, **config)
    image = config.get("image", 224)
    return classification(model, batch, (3, image, image), model.head.out_features)


def build_revvit_plain(batch: int) -> Workload:
    """:func:`build_revvit` with plain autograd."""
    return build_revvit(batch, reversible=False)


def build_revbifpn(batch: int, reversible: bool = True, image: int = 224,
                   **config: Any) -> Workload:
    """A RevBiFPN-style CNN: 32/64/128 channels at 1/4, 1/8, 1/16 of a 3×224×224 image,
    4 RevSilos, 1000 classes; ``config`` overrides :class:`RevBiFPN`'s arguments."""
    model = RevBiFPN(reversible=reversible, **config)
    return classification(model, batch, (3, image, image), model.head.out_features)


def build_revbifpn_plain(batch: int) -> Workload:
    """:func:`build_revbifpn` with plain autograd."""
    return build_revbifpn(batch, reversible=False)


PLAIN = "the same modules and parameters run with plain autograd (every activation kept)"

register(ZooModel(
    "revvit", build_revvit, batch=64, small_batch=2, paper="RevViT",
    description="Reversible ViT-S: 16×16 patches of 3×224×224, 384 wide, 12 reversible blocks "
                "(F attention, G MLP, pre-LayerNorm, 6 heads), mean-pooled, 1000 classes; "
                "batch 64 (ours: the paper reports memory per image)"))
register(ZooModel(
    "revvit-plain", build_revvit_plain, batch=64,
    small_batch=2, paper="RevViT", description=f"revvit's twin: {PLAIN}"))
register(ZooModel(
    "revbifpn", build_revbifpn, batch=64, small_batch=2, paper="RevBiFPN",
    description="RevBiFPN-style CNN: SpaceToDepth stem, streams of 32/64/128 channels at "
                "1/4, 1/8, 1/16 of the image, "
                "4 RevSilos (bottom-up then top-down additive couplings), pooled linear "
                "head, 3×224×224, 1000 classes; batch 64 (ours)"))
register(ZooModel(
    "revbifpn-plain", build_revbifpn_plain, batch=64,
    small_batch=2, paper="RevBiFPN", description=f"revbifpn's twin: {PLAIN}"))
