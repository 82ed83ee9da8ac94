"""Reversible layers: blocks whose inputs are recomputed from their outputs during backward,
so that training keeps no activations inside them (RevNet, RevViT, RevBiFPN).

A block is an :class:`Invertible`: ``forward(*xs)`` and ``inverse(*ys)`` over a few tensors
(its *streams*). :class:`Coupling` is the additive step ``x[t] += fn(x[s] for s in sources)``
of every published reversible network; a :class:`Chain` of couplings is a RevNet block
(:class:`RevBlock`: two streams) or a multi-scale fusion (:class:`RevSilo`: N streams, one
pass from fine to coarse, one back). :func:`invertible` turns any module with a known
inverse into a block.

:class:`ReversibleSequence` runs its blocks inside one autograd function that saves only the
last block's outputs. Backward walks the steps in reverse: a coupling re-runs ``fn`` with
gradients once, which both inverts the step (``x[t] = y[t] - fn(...)``) and backpropagates
through it; any other block is inverted without gradients, then re-run with them. So the
memory of a chain does not grow with its depth, at the price of one more forward of each
step. ``reversible=False`` runs the same modules with plain autograd (the twin to compare
with). Each step's RNG state (CPU, and the devices its streams are on) is kept and restored,
so dropout draws the same masks when recomputed. Caveats: a step's ``fn`` must not modify
its inputs in place, and a module that updates buffers in forward (BatchNorm's running
statistics) updates them again when recomputed; autocast state is not replayed; double
backward is not supported (it raises).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

Streams = tuple[torch.Tensor, ...]


def _streams(out: torch.Tensor | Sequence[torch.Tensor]) -> Streams:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _unwrap(xs: Streams) -> torch.Tensor | Streams:
    return xs[0] if len(xs) == 1 else xs


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, as a leaf that collects its gradient (if it can have one)."""
    return x.detach().requires_grad_(x.is_floating_point() or x.is_complex())


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class Invertible(nn.Module):
    """A bijective block over streams: subclasses define ``forward(*xs)`` and
    ``inverse(*ys)``, each returning a tensor or a tuple of them. Its backward step inverts
    the outputs without gradients, then re-runs ``forward`` on them with gradients."""

    def inverse(self, *ys: torch.Tensor) -> torch.Tensor | Streams:
        raise NotImplementedError(f"{type(self).__name__} defines no inverse")

    def steps(self) -> Iterator[Invertible]:
        """The blocks a backward pass inverts one by one (a chain's, or this one)."""
        yield self

    def backprop(self, ys: Streams, grads: Streams) -> tuple[Streams, Streams, list]:
        """From this block's outputs and their gradients: its inputs, their gradients and
        the gradients of its trainable parameters (None where unused)."""
        with torch.no_grad():
            xs = tuple(_leaf(x) for x in _streams(self.inverse(*ys)))
        params = _trainable(self)
        with torch.enable_grad():
            out = _streams(self(*xs))
        got = torch.autograd.grad(out, [x for x in xs if x.requires_grad] + params, grads,
                                  allow_unused=True)
        it = iter(got)
        dxs = tuple(next(it) if x.requires_grad else None for x in xs)
        return tuple(x.detach() for x in xs), dxs, list(it)


class _Wrapped(Invertible):
    """A module and a function inverting it: see :func:`invertible`."""

    def __init__(self, module: nn.Module,
                 inverse: Callable[..., torch.Tensor | Sequence[torch.Tensor]]) -> None:
        super().__init__()
        self.module = module
        self._inverse = inverse

    def forward(self, *xs: torch.Tensor) -> Any:
        return self.module(*xs)

    def inverse(self, *ys: torch.Tensor) -> torch.Tensor | Streams:
        return _streams(self._inverse(self.module, *ys))


def invertible(module: nn.Module,
               inverse: Callable[..., torch.Tensor | Sequence[torch.Tensor]]) -> Invertible:
    """``module`` as a reversible block; ``inverse(module, *ys)`` returns its inputs."""
    return _Wrapped(module, inverse)


class Coupling(Invertible):
    """The additive coupling ``x[target] += fn(*(x[s] for s in sources))`` over streams
    ``x``; the other streams pass unchanged, so ``fn``'s inputs are known on both sides."""

    def __init__(self, target: int, sources: Sequence[int], fn: nn.Module) -> None:
        super().__init__()
        if target in sources:
            raise ValueError(f"a coupling's target stream {target} cannot be one of its "
                             f"sources {list(sources)}")
        self.target, self.sources, self.fn = target, tuple(sources), fn

    def _add(self, xs: Sequence[torch.Tensor], sign: int) -> Streams:
        out = list(xs)
        update = self.fn(*(xs[s] for s in self.sources))
        out[self.target] = xs[self.target] + update if sign > 0 else xs[self.target] - update
        return tuple(out)

    def forward(self, *xs: torch.Tensor) -> Streams:
        return self._add(xs, 1)

    def inverse(self, *ys: torch.Tensor) -> Streams:
        return self._add(ys, -1)

    def backprop(self, ys: Streams, grads: Streams) -> tuple[Streams, Streams, list]:
        """One run of ``fn`` with gradients serves both the inverse and its backward."""
        z = [_leaf(ys[s]) for s in self.sources]
        params = _trainable(self)
        with torch.enable_grad():
            update = self.fn(*z)
        xs = list(ys)
        with torch.no_grad():
            xs[self.target] = ys[self.target] - update
        got = torch.autograd.grad(update, z + params, grads[self.target], allow_unused=True)
        dxs = list(grads)
        for s, dz in zip(self.sources, got, strict=False):
            if dz is not None:
                dxs[s] = dz if dxs[s] is None else dxs[s] + dz
        return tuple(xs), tuple(dxs), list(got[len(z):])


class Chain(Invertible):
    """Blocks applied in order and inverted in reverse order."""

    def __init__(self, *blocks: Invertible) -> None:
        super().__init__()
        if not blocks:
            raise ValueError("a chain needs at least one block")
        self.blocks = nn.ModuleList(blocks)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor | Streams:
        for block in self.blocks:
            xs = _streams(block(*xs))
        return _unwrap(xs)

    def inverse(self, *ys: torch.Tensor) -> torch.Tensor | Streams:
        for block in reversed(self.blocks):
            ys = _streams(block.inverse(*ys))
        return _unwrap(ys)

    def steps(self) -> Iterator[Invertible]:
        for block in self.blocks:
            yield from block.steps()


class RevBlock(Chain):
    """RevNet's block on two streams: ``y1 = x1 + f(x2)``, then ``y2 = x2 + g(y1)``."""

    def __init__(self, f: nn.Module, g: nn.Module) -> None:
        super().__init__(Coupling(0, (1,), f), Coupling(1, (0,), g))


class RevSilo(Chain):
    """RevBiFPN's reversible multi-scale fusion over N streams, finest first. Bottom-up,
    stream i = 1 … N-1 adds ``bottom_up[i-1]`` of streams 0 … i-1 (already updated); then
    top-down, stream i = N-2 … 0 adds ``top_down[i]`` of streams i+1 … N-1 (already updated).
    The functions do the resampling (down from finer streams, up from coarser ones)."""

    def __init__(self, bottom_up: Sequence[nn.Module], top_down: Sequence[nn.Module]) -> None:
        n = len(bottom_up) + 1
        if len(top_down) != n - 1:
            raise ValueError(f"{n} streams need {n - 1} top-down functions, got {len(top_down)}")
        up = [Coupling(i, range(i), bottom_up[i - 1]) for i in range(1, n)]
        down = [Coupling(i, range(i + 1, n), top_down[i]) for i in reversed(range(n - 1))]
        super().__init__(*up, *down)


@dataclass(frozen=True)
class RngState:
    """The CPU generator's state and those of the devices some tensors are on."""

    cpu: torch.Tensor
    devices: tuple[tuple[torch.device, torch.Tensor], ...]

    @staticmethod
    def capture(tensors: Iterable[torch.Tensor]) -> RngState:
        devices = {t.device for t in tensors if t.device.type not in ("cpu", "meta")}
        return RngState(torch.get_rng_state(), tuple(
            (d, torch.get_device_module(d).get_rng_state(d)) for d in sorted(devices, key=str)))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.devices:
            torch.get_device_module(device).set_rng_state(state, device)


class _Reverse(torch.autograd.Function):
    """A sequence's forward that saves only its outputs; backward inverts step by step."""

    @staticmethod
    def forward(ctx: Any, seq: ReversibleSequence, n: int, *args: torch.Tensor) -> Streams:
        ran: list[tuple[Invertible, RngState | None]] = []  # the steps, in the order they ran

        def note(step: nn.Module, xs: tuple) -> None:
            state = RngState.capture(xs) if seq.preserve_rng_state else None
            ran.append((step, state))

        hooks = [s.register_forward_pre_hook(note) for s in seq.steps()]
        try:
            ys = _streams(Chain.forward(seq, *args[:n]))
        finally:
            for h in hooks:
                h.remove()
        ctx.ran, ctx.params = ran, [id(p) for p in args[n:]]
        ctx.save_for_backward(*ys)
        return ys

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ys, index = ctx.saved_tensors, {p: k for k, p in enumerate(ctx.params)}
        pgrads: list[torch.Tensor | None] = [None] * len(ctx.params)
        replay = any(state is not None for _, state in ctx.ran)
        keep = RngState.capture(ys) if replay else None  # the RNG as backward found it
        try:
            for step, state in reversed(ctx.ran):
                if state is not None:
                    state.restore()
                ys, grads, got = step.backprop(ys, grads)
                for p, g in zip(_trainable(step), got, strict=True):
                    k = index[id(p)]
                    if g is not None:
                        pgrads[k] = g if pgrads[k] is None else pgrads[k] + g
        finally:
            if keep is not None:
                keep.restore()
        return None, None, *grads, *pgrads


class ReversibleSequence(Chain):
    """Blocks that run reversibly: training keeps only the last block's outputs and
    recomputes the rest in backward. ``reversible=False`` (settable) runs the same math
    with plain autograd; without gradients both run the plain forward. ``preserve_rng_state``
    replays each step's random draws (dropout) exactly when it is recomputed."""

    def __init__(self, *blocks: Invertible, reversible: bool = True,
                 preserve_rng_state: bool = True) -> None:
        super().__init__(*blocks)
        self.reversible = reversible
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *xs: torch.Tensor) -> torch.Tensor | Streams:
        params = _trainable(self)
        if not (self.reversible and torch.is_grad_enabled()
                and (params or any(x.requires_grad for x in xs))):
            return super().forward(*xs)
        return _unwrap(_Reverse.apply(self, len(xs), *xs, *params))

    def extra_repr(self) -> str:
        return f"reversible={self.reversible}"


__all__ = ["Chain", "Coupling", "Invertible", "RevBlock", "RevSilo", "ReversibleSequence",
           "invertible"]
