"""What a new aten op will make, known before it runs: its outputs' bytes, aliases and cost.

The engine makes room for an op's outputs before the op runs, so that the budget bounds real
memory and not only the engine's count. The outputs of an op are worked out once per
*signature* (the op, its non-tensor arguments and grad mode, and each tensor input's shape,
strides, offset, dtype and device) by running it on meta tensors, which allocate nothing; the
op's first real run checks that prediction, and every later call with that signature reads
the real layout from a process-wide cache, so the steady state pays one dictionary lookup.

An op's cost is known before it runs too, so that a live run and its replay price it alike
and a layout-aware pool can place its outputs by cost: the first measured run of its
signature, kept; for a signature never run before, the cost model's estimate
(``membudget.cost``) on the predicted outputs.

An op whose output shapes depend on the data (nonzero, unique, masked_select, indexing by a
mask, ...) is sized at the most it can make, every time (``runtime.bounds``), and its outputs
are resized to what it made. Two kinds of op cannot be sized before they run, and run first
(their outputs are held, for a moment, beside the budget; ``unsized_ops`` counts them): such
ops whose sizes come from values (bincount, ...), every time, and ops with no meta kernel,
on their signature's first call only.
"""

from __future__ import annotations

import warnings
from contextlib import suppress
from functools import cache
from typing import Any, Generic, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from membudget.core.records import ComputePath, Tensor
from membudget.errors import UnsupportedTensorError
from membudget.runtime.bounds import data_dependent, largest_outputs
from membudget.runtime.call import Slot, below_autograd
from membudget.runtime.flat import flatten_result, unflatten

#: The most signatures a cache keeps (a long run that keeps making new shapes, or scalars
#: that change every step, must not grow it without bound).
CACHE_LIMIT = 1 << 16

Meta = tuple  # (shape, stride, storage offset, dtype, device) of one tensor
V = TypeVar("V")


def meta_of(x: torch.Tensor) -> Meta:
    """What an op's outputs can depend on, of one tensor input (and what a recomputation of
    an output must reproduce)."""
    return (x.shape, x.stride(), x.storage_offset(), x.dtype, x.device)


class Layout:
    """The outputs of one signature: positions of the tensors in the flattened result, their
    bytes and aliased inputs as the engine takes them (``out_alias`` None: none aliases an
    input), each one's :func:`meta_of`, and the op's cost in ns (``measured``: the first real
    run's time, else an estimate). ``real``: read off a real run, not predicted; ``bound``:
    predicted at the most a data-dependent op can make, for this call only."""

    __slots__ = ("bound", "cost", "key", "measured", "meta", "out_alias", "out_bytes",
                 "outputs", "real")

    def __init__(self, outputs: list[int], out_bytes: list[int], out_alias: list[int] | None,
                 meta: list[Meta], cost: float, measured: bool, real: bool) -> None:
        self.outputs = outputs
        self.out_bytes = out_bytes
        self.out_alias = out_alias
        self.meta = meta
        self.cost = cost
        self.measured = measured
        self.real = real
        self.bound = False
        self.key: tuple | None = None  # a predicted layout's signature, until its real run


class Recent(Generic[V]):
    """Values by signature, at most ``limit`` of them, keeping those in use: new ones go to
    a young generation; when it holds half the limit it becomes the old one and the old one
    is dropped, and a hit in the old one moves the entry back to the young. A signature
    every step meets stays; one that never repeats (a scalar that changes every step, such
    as Adam's step size) is gone two generations later."""

    def __init__(self, limit: int = CACHE_LIMIT) -> None:
        self.half = max(1, limit // 2)
        self._young: dict[tuple, V] = {}
        self._old: dict[tuple, V] = {}

    def get(self, key: tuple) -> V | None:
        """The value kept for this signature, if any (None for an unhashable argument,
        which never repeats anyway)."""
        try:
            hit = self._young.get(key)
            if hit is None and self._old:
                hit = self._old.pop(key, None)
                if hit is not None:
                    self._keep(key, hit)
            return hit
        except TypeError:
            return None

    def keep(self, key: tuple, value: V) -> None:
        """Keep ``value`` for this signature."""
        with suppress(TypeError):  # (an unhashable argument: never repeats anyway)
            self._keep(key, value)

    def _keep(self, key: tuple, value: V) -> None:
        if len(self._young) >= self.half:
            self._old, self._young = self._young, {}
        self._young[key] = value

    def __len__(self) -> int:
        return len(self._young) + len(self._old)


#: The real layouts of the signatures seen, one cache per world: fake tensors are sized by
#: meta kernels, whose strides may differ from the real ones.
REAL: Recent[Layout] = Recent()
FAKE: Recent[Layout] = Recent()


def signature(call: Any, inputs: tuple[Tensor, ...]) -> tuple:
    """The key of a call's outputs: everything they can depend on but the data (the op by
    its C++ handle, whose hash is C's: an OpOverload hashes in Python)."""
    key = [call.func._op, call.spec, call.grad]
    for x in call.leaves:
        kind = type(x)
        if kind is list:
            key.append(tuple(x))
        elif kind is Slot:
            key.append(inputs[x.index].meta)
        else:
            key.append(x)
    return tuple(key)


def predict(call: Any, path: ComputePath) -> tuple[Layout, tuple, dict, Any] | None:
    """The layout of a new signature, from a run on meta tensors (with its meta arguments
    and result, which the cost model prices); None if it cannot be predicted. An op whose
    outputs depend on its data is sized at the most it can make (``runtime.bounds``), in a
    layout marked ``bound``."""
    storages: dict[object, torch.UntypedStorage] = {}  # engine storage -> its meta twin
    ins = []
    with _disable_current_modes(), below_autograd(call.grad):
        for t in path.inputs:
            shape, stride, offset, dtype, _ = t.meta
            st = storages.get(t.storage)
            if st is None:
                st = storages[t.storage] = torch.UntypedStorage(t.storage.nbytes, device="meta")
            ins.append(torch.empty(0, dtype=dtype, device="meta").set_(st, offset, shape, stride))
        leaves = [ins[x.index] if type(x) is Slot else _on_meta(x) for x in call.leaves]
        args, kwargs = unflatten(leaves, call.spec)
        bound = data_dependent(call.func, args, kwargs)
        try:
            out = (largest_outputs(call.func, args, kwargs) if bound else
                   call.func(*args, **kwargs))
        except Exception:  # no meta kernel, or one that needs the data
            return None
        if out is None:  # nothing bounds its outputs
            return None
    flat = flatten_result(out)[0]
    outputs = [k for k, o in enumerate(flat) if isinstance(o, torch.Tensor)]
    results = [flat[k] for k in outputs]
    if any(o.device.type != "meta" for o in results):
        return None  # an op that places its result by itself: only a real run tells
    out_bytes, out_alias = layout_of(results, ins, call.func)
    layout = Layout(outputs, out_bytes, out_alias, [meta_of(o) for o in results], 0.0, False,
                    False)
    layout.bound = bound
    return layout, args, kwargs, out


def observed(call: Any, flat: list[Any], real: list[torch.Tensor], cost: float) -> Layout:
    """The layout a real run made (its result ``flat``, its inputs ``real``)."""
    outputs = [k for k, o in enumerate(flat) if isinstance(o, torch.Tensor)]
    results = [flat[k] for k in outputs]
    out_bytes, out_alias = layout_of(results, real, call.func)
    return Layout(outputs, out_bytes, out_alias, [meta_of(o) for o in results], cost, True, True)


def check_prediction(call: Any, predicted: Layout, real: Layout) -> bool:
    """Did a meta kernel size the outputs other than the real kernel did? (It warns, once
    per op: those outputs were held beside the budget until the engine resized them.)"""
    if predicted.out_bytes == real.out_bytes and predicted.out_alias == real.out_alias:
        return False
    _warn_once(str(call.func), tuple(predicted.out_bytes), tuple(real.out_bytes))
    return True


@cache
def _warn_once(op: str, predicted: tuple[int, ...], real: tuple[int, ...]) -> None:
    warnings.warn(f"the meta kernel of {op} sized its outputs at {predicted} bytes but the "
                  f"real kernel made {real}; on that first call they were held beside the "
                  "budget, later calls are sized right", RuntimeWarning, stacklevel=2)


def estimate(func: Any, args: tuple, kwargs: dict, out: Any, device: str) -> float:
    """The cost model's estimate of an op never run before, in ns, on the spec of its
    device kind: this machine's measured ``cpu`` spec, or an A100's for an accelerator.
    Only relative costs steer eviction (DTR's score and Coop's cost density are scale-free),
    and the first real run's time replaces it for the next call."""
    return _model(device).op_seconds(func, args, kwargs, out) * 1e9


def model_seconds(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """The cost model's seconds for an op on the spec of its device kind (as ``estimate``):
    a price that depends only on the op and its shapes, so the same program gets the same
    prices, and so makes the same decisions, on every run."""
    device = next((x.device.type for x in tree_leaves((args, kwargs))
                   if isinstance(x, torch.Tensor)), "cpu")
    return _model("cpu" if device == "cpu" else "cuda").op_seconds(func, args, kwargs, out)


def link_prices() -> tuple[float, float]:
    """ns per byte and ns per copy of a swap to host memory on this machine's device kind:
    the host link of the spec the cost model prices its ops on (an A100's PCIe 4.0 x16 for
    an accelerator; on a CPU, a copy within memory)."""
    return _model("cuda" if torch.accelerator.is_available() else "cpu").spec.host_copy_ns()


def move_prices() -> tuple[float, float]:
    """ns per byte (each way) and ns per copy of a move within device memory on this
    machine's device kind, on the spec the cost model prices its ops on: a stable price,
    so that whether to move or evict does not depend on timings."""
    return _model("cuda" if torch.accelerator.is_available() else "cpu").spec.move_ns()


def _model(device: str) -> Any:
    """The cost model of a device kind: the ``cpu`` spec is measured per thread count (it
    changes the numbers), so it is the one for the thread count of the moment."""
    cpu = device == "cpu"
    return _cost_model(cpu, torch.get_num_threads() if cpu else 0)


@cache
def _cost_model(cpu: bool, threads: int) -> Any:
    """One model per device kind, and for the ``cpu`` one per thread count (``threads`` keys
    the cache: the spec it reads is measured at the thread count of its first use; 0 for an
    accelerator's, which no thread count changes)."""
    from membudget.cost import CostModel

    return CostModel("cpu" if cpu else "a100-80gb")


def budgetable(x: torch.Tensor, what: str) -> None:
    """Refuse, with a clear error, a tensor with no strided storage of its own to count
    (``what``: where it came from, for the message)."""
    if x.layout is not torch.strided:
        raise UnsupportedTensorError(f"{what} a tensor of layout {x.layout}",
                                     " (for a sparse gradient, use a dense one: "
                                     "nn.Embedding(..., sparse=False))")
    if torch._C._functorch.is_functorch_wrapped_tensor(x):
        raise UnsupportedTensorError(f"{what} a tensor of a torch.func transform (vmap, grad, "
                                     "jacrev, ...)")


def layout_of(tensors: list[torch.Tensor], inputs: list[torch.Tensor], op: object
              ) -> tuple[list[int], list[int] | None]:
    """Bytes and aliased input of each output of ``op`` (None: no output aliases an input):
    a view shares its input's storage. Storages are compared by identity, not data pointer,
    which fake and meta tensors do not have (an output of 0 bytes aliases nothing)."""
    out_bytes = []
    out_alias = None
    owners = None  # looked up only if some output has bytes
    for k, o in enumerate(tensors):
        if o.layout is not torch.strided:
            budgetable(o, f"{op} made")
        st = o.untyped_storage()
        nbytes = st.nbytes()
        if nbytes:
            if owners is None:
                owners = [v.untyped_storage()._cdata for v in inputs]
            where = st._cdata
            if where in owners:
                if out_alias is None:
                    out_alias = [-1] * len(tensors)
                out_alias[k] = owners.index(where)
                nbytes = 0
        out_bytes.append(nbytes)
    return out_bytes, out_alias


def _on_meta(x: Any) -> Any:
    """A non-tensor argument as the meta run takes it: devices become the meta device (a
    factory op must not allocate on the real one)."""
    if type(x) is torch.device:
        return _META
    return x


_META = torch.device("meta")
