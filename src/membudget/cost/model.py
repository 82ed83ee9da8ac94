"""Predicted time of one aten op on a named device: a roofline over FLOPs and bytes moved.

``seconds = launch overhead + max(FLOPs / matmul FLOP/s, bytes read and written / bandwidth)``.
FLOPs come from ``torch.utils.flop_counter``'s registry (matmuls, convolutions, attention,
plus the CPU flash attention it misses); other ops are timed by their bytes alone, except
where the spec has a measured element rate for the op (``DeviceSpec.math_rates``: tanh, exp,
softmax, ... on a CPU), which is then a third term: output elements / rate. Ops that
launch no kernel on a GPU cost 0: views (every return aliases an input without writing it),
in-place metadata changes (``Tag.inplace_view``: ``transpose_``, ``resize_``, ``set_``), shape
queries (no tensor return, no write, not data dependent) and bare allocations (``empty*``).
Only shapes, strides and dtypes are read, so real, meta and fake tensors get the same
prediction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from membudget.cost.devices import DeviceSpec, get_spec

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload

CONV_PACKETS = frozenset({
    aten.convolution, aten._convolution, aten.cudnn_convolution, aten.convolution_overrideable,
    aten._slow_conv2d_forward, aten.convolution_backward,
})
# Kernels the registry misses whose arguments match those of a registered formula: the CPU
# flash attention that scaled_dot_product_attention runs on the CPU (and so in CPU traces).
EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.sdpa_backward_flop,
}
# Ops that allocate without launching a kernel; _unsafe_view is a view whose schema hides it.
ALLOCATION_ONLY = frozenset({
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
    "aten::new_empty_strided", "aten::empty_permuted", "aten::_unsafe_view",
})

FREE, MEMORY, COMPUTE = "free", "memory", "compute"


@dataclass(frozen=True)
class OpPlan:
    """What the model does with an op, decided once from its schema and tags. ``flops`` is
    the registry's formula; with ``on_shapes`` it is the formula inside the registry's shape
    wrapper, called with shapes directly (30× faster than the wrapper's pytree map).
    ``write_only``: keyword arguments the op writes without reading (``out=``);
    ``unreturned_writes``: (position, name) of arguments an op that returns nothing writes
    (``_foreach_add_``, ``_fused_adam_``), counted as written on top of being read."""

    kind: str
    flops: Callable[..., int] | None = None
    on_shapes: bool = False
    conv: bool = False
    write_only: frozenset[str] = frozenset()
    unreturned_writes: tuple[tuple[int, str], ...] = ()


@cache
def op_plan(func: OpOverload) -> OpPlan:
    """The op's kind: free (no kernel), memory-bound, or compute (in the FLOP registry)."""
    schema = func._schema
    packet = func._overloadpacket
    returns = schema.returns
    written = [(i, a) for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    views = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                  for r in returns)
    query = (not written and not any("Tensor" in str(r.type) for r in returns)
             and torch.Tag.data_dependent_output not in func.tags)
    if (views or query or torch.Tag.inplace_view in func.tags
            or schema.name in ALLOCATION_ONLY):
        return OpPlan(FREE)
    write_only = frozenset(a.name for _, a in written if a.kwarg_only)
    unreturned = () if returns else tuple((i, a.name) for i, a in written)
    flops = flop_registry.get(packet) or EXTRA_FLOPS.get(packet)
    if flops is None:
        return OpPlan(MEMORY, write_only=write_only, unreturned_writes=unreturned)
    inner = getattr(flops, "__wrapped__", None)  # set by functools.wraps in shape_wrapper
    return OpPlan(COMPUTE, inner or flops, inner is not None, packet in CONV_PACKETS,
                  write_only, unreturned)


class OpCost(NamedTuple):
    """One op's prediction: FLOPs counted, bytes read plus written, and seconds."""

    flops: int
    bytes: int
    seconds: float


class CostModel:
    """Predicts aten op times on ``spec``. fp32 follows PyTorch's CUDA defaults: matmuls in
    full fp32 (``tf32_matmul=False``), cuDNN convolutions in TF32 (``tf32_conv=True``), which
    matters only on devices with TF32 units (A100, H100)."""

    def __init__(self, spec: DeviceSpec | str, *, tf32_matmul: bool = False,
                 tf32_conv: bool = True) -> None:
        self.spec = get_spec(spec) if isinstance(spec, str) else spec
        self.tf32_matmul = tf32_matmul
        self.tf32_conv = tf32_conv
        self._bandwidth = self.spec.bandwidth * self.spec.bandwidth_efficiency
        self._rates: dict[tuple[torch.dtype, bool], float] = {}
        self._math = {getattr(aten, name): rate for name, rate in self.spec.math_rates.items()}

    def op_seconds(self, func: OpOverload, args: tuple, kwargs: dict[str, Any],
                   out: Any) -> float:
        """Predicted seconds of ``func(*args, **kwargs)`` that returned ``out``."""
        return self.op_cost(func, args, kwargs, out).seconds

    def op_cost(self, func: OpOverload, args: tuple, kwargs: dict[str, Any],
                out: Any) -> OpCost:
        """The prediction with its FLOPs and bytes (for reports and checks)."""
        plan = op_plan(func)
        if plan.kind is FREE:
            return OpCost(0, 0, 0.0)
        nbytes = _bytes(args) + _bytes(out) + sum(
            _bytes(v) for k, v in kwargs.items() if k not in plan.write_only)
        for i, name in plan.unreturned_writes:
            nbytes += _bytes(args[i] if i < len(args) else kwargs.get(name))
        seconds = nbytes / self._bandwidth
        flops = 0
        if plan.on_shapes:
            flops = plan.flops(*_shapes(args), **_shapes(kwargs), out_shape=_shapes(out))
        elif plan.flops is not None:
            flops = plan.flops(*args, **kwargs, out_val=out)
        if flops:
            seconds = max(seconds, flops / self._rate(_first_dtype(args), plan.conv))
        rate = self._math.get(func._overloadpacket) if self._math else None
        if rate:
            seconds = max(seconds, _first_numel(out) / rate)
        return OpCost(flops, nbytes, self.spec.launch_overhead + seconds)

    def _rate(self, dtype: torch.dtype, conv: bool) -> float:
        rate = self._rates.get((dtype, conv))
        if rate is None:
            tf32 = self.tf32_conv if conv else self.tf32_matmul
            rate = self.spec.peak_flops(dtype, tf32=tf32) * self.spec.flops_efficiency
            self._rates[dtype, conv] = rate
        return rate


class CostMode(TorchDispatchMode):
    """Runs every aten op as usual and records ``(func, OpCost)``: under
    ``torch.device("meta")`` or ``FakeTensorMode`` this prices a model too big to run."""

    def __init__(self, model: CostModel) -> None:
        super().__init__()
        self.model = model
        self.ops: list[tuple[OpOverload, OpCost]] = []

    def __torch_dispatch__(self, func: OpOverload, types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, self.model.op_cost(func, args, kwargs, out)))
        return out

    @property
    def seconds(self) -> float:
        return sum(c.seconds for _, c in self.ops)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches in ``t``: its own elements, not its storage's, and each element
    of a broadcast (stride-0) dimension once."""
    n = t.numel()
    if n > 1 and t.layout == torch.strided:
        stride = t.stride()
        if 0 in stride:
            n = math.prod(s for s, st in zip(t.shape, stride, strict=True) if st)
    return n * t.element_size()


def _bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return tensor_bytes(x)
    if isinstance(x, (list, tuple)):
        return sum(_bytes(v) for v in x)
    return 0


def _shapes(x: Any) -> Any:
    """``x`` with every tensor replaced by its shape (lists, tuples and dict values too)."""
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, (list, tuple)):
        return type(x)(_shapes(v) for v in x)
    if isinstance(x, dict):
        return {k: _shapes(v) for k, v in x.items()}
    return x


def _first_numel(out: Any) -> int:
    """Elements of the op's first returned tensor."""
    if isinstance(out, torch.Tensor):
        return out.numel()
    return next((x.numel() for x in out if isinstance(x, torch.Tensor)), 0)


def _first_dtype(args: tuple) -> torch.dtype:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.dtype
    return torch.float32
