"""The torch executor: runs aten ops for the engine and holds the real tensors it may drop.

Every engine tensor's value is a real ``torch.Tensor`` kept in ``values`` while its storage is
resident. A new op first runs in ``probe`` (the engine needs its output sizes to make room),
so ``run`` then only stores that result; a recomputation rebuilds the op's arguments from the
current values, restores the RNG state the op first ran with, and writes the outputs the
engine placed. In-place ops write their new version into the old value's
tensor when the engine lets them (it handed them its block, or nothing can need the old value
any more), and into a copy otherwise (copy-on-write).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from time import perf_counter_ns
from typing import Any

import torch

from membudget.core.executor import Executor
from membudget.core.records import ComputePath, Storage, Tensor
from membudget.runtime.flat import NO_KWARGS, Spec, flatten_result, unflatten


class Slot:
    """Placeholder in an op's flattened arguments for its ``index``-th engine input
    (immutable, so ``slot(i)`` shares one per index)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_grad_enabled = torch._C.is_grad_enabled  # torch.is_grad_enabled's own Python frame skipped
SLOTS = [Slot(i) for i in range(64)]  # SLOTS[i] is slot(i); it only ever grows


def slot(i: int) -> Slot:
    """The placeholder of engine input ``i``."""
    while len(SLOTS) <= i:
        SLOTS.append(Slot(len(SLOTS)))
    return SLOTS[i]


class OpCall:
    """One aten call as the engine records it: enough to run it again.

    ``leaves``/``spec`` are the flattened (args, kwargs) with engine inputs replaced by
    :class:`Slot`; ``random`` whether it draws random numbers, and then ``rng`` the generator
    states of its first run; ``grad`` the grad mode it ran in (some kernels consult it:
    mkldnn's RNN keeps its workspace only with grad on). After the first run, ``outputs`` are
    the positions of the recorded tensors in the flattened result, ``result`` those tensors
    until the engine takes them, and ``returned`` the whole flattened result (with its
    ``returned_kind``) until the session has wrapped it.
    """

    __slots__ = ("cost", "func", "grad", "leaves", "outputs", "random", "rerun_leaves",
                 "result", "returned", "returned_kind", "rng", "spec")

    def __init__(self, func: torch._ops.OpOverload, leaves: list[Any], spec: Spec,
                 random: bool = False) -> None:
        self.func = func
        self.leaves = leaves
        self.spec = spec
        self.random = random
        self.grad = _grad_enabled()
        self.outputs: Sequence[int] = ()
        self.rng: tuple | None = None
        self.result: list[torch.Tensor] | None = None
        self.returned: list[Any] | None = None
        self.returned_kind: type | None = None
        self.cost = 0.0  # measured on the first run (ns)
        # the arguments of a recomputation, when they differ from the first run's (side
        # effects dropped: see runtime.classify.UNDECLARED_WRITES)
        self.rerun_leaves: list[Any] | None = None

    def __repr__(self) -> str:
        return str(self.func)


def capture_rng(devices: Sequence[torch.device], generators: Sequence[torch.Generator]):
    """The states a random op will draw from: the default CPU generator (always: ops on
    other devices may still draw on it), each accelerator's, and explicit generators."""
    cuda = [(d, torch.cuda.get_rng_state(d)) for d in devices if d.type == "cuda"]
    return (torch.random.get_rng_state(), cuda, [(g, g.get_state()) for g in generators])


def _set_rng(rng: tuple) -> None:
    """Put the generators back in the states ``capture_rng`` took."""
    cpu, cuda, gens = rng
    torch.random.set_rng_state(cpu)
    for d, s in cuda:
        torch.cuda.set_rng_state(s, d)
    for g, s in gens:
        g.set_state(s)


class RestoredRng:
    """Run with the captured generator states, then put the current ones back."""

    def __init__(self, rng: tuple) -> None:
        self.rng = rng

    def __enter__(self) -> None:
        _, cuda, gens = self.rng
        self.saved = capture_rng([d for d, _ in cuda], [g for g, _ in gens])
        _set_rng(self.rng)

    def __exit__(self, *exc: object) -> None:
        _set_rng(self.saved)


OpTimer = Callable[[Any, tuple, dict, Any], float]
_FIRST = (0,)  # the outputs of an op that returns one tensor


class TorchExecutor(Executor):
    """Runs :class:`OpCall` paths on real (or fake) tensors; ``values`` maps engine tensor ids
    to them. An op's cost is its measured time, or with ``cost`` the seconds that function
    predicts from the op and its arguments and result (a cost model of another device)."""

    def __init__(self, cost: OpTimer | None = None) -> None:
        self.values: dict[int, torch.Tensor] = {}
        self.cost = cost

    def _cost(self, call: OpCall, args: tuple, kwargs: dict, out: Any, t0: int) -> float:
        """The cost of an op's first run in ns: measured since ``t0``, or predicted."""
        if self.cost is None:
            return float(perf_counter_ns() - t0)
        return self.cost(call.func, tuple(args), kwargs, out) * 1e9

    def probe(self, path: ComputePath) -> tuple[list[int], list[int] | None, float]:
        call: OpCall = path.op
        values = self.values
        # loops, not comprehensions: on every op, and a comprehension is a call in Python 3.11
        real = []
        for t in path.inputs:
            real.append(values[t.id])
        leaves = []
        for x in call.leaves:
            leaves.append(real[x.index] if type(x) is Slot else x)
        if call.random:
            call.rng = capture_rng(_devices(real), _generators(call.leaves))
        op = call.func._op  # what OpOverload.__call__ calls, without its Python frame
        if call.spec is None:
            t0 = perf_counter_ns()
            out = op(*leaves)
            args, kwargs = leaves, NO_KWARGS
        else:
            args, kwargs = unflatten(leaves, call.spec)
            t0 = perf_counter_ns()
            out = op(*args, **kwargs)
        if self.cost is None:
            cost = call.cost = float(perf_counter_ns() - t0)
        else:
            cost = call.cost = self._cost(call, args, kwargs, out, t0)
        if type(out) is not torch.Tensor:
            flat, call.returned_kind = flatten_result(out)
            call.outputs = [k for k, o in enumerate(flat) if isinstance(o, torch.Tensor)]
            result = call.result = [flat[k] for k in call.outputs]
            call.returned = flat
            out_bytes, out_alias = _layout(result, real)
            return out_bytes, out_alias, cost
        # most ops: the result is its one output (_layout for it, inlined)
        call.returned_kind = None
        call.outputs = _FIRST
        call.result = call.returned = [out]  # run() takes it before it is wrapped
        st = out.untyped_storage()
        nbytes = st.nbytes()
        if nbytes:
            where = st._cdata
            for i, v in enumerate(real):
                if v.untyped_storage()._cdata == where:
                    return [0], [i], cost
        return [nbytes], None, cost

    def run(self, path: ComputePath, remat: bool) -> float:
        call: OpCall = path.op
        outputs = path.outputs
        if call.result is not None:  # the first run, done by the session
            results, call.result = call.result, None
        elif remat:
            results = self._rerun(path, call, remat)
        else:  # an in-place op's first run: it must see where the engine put its versions
            results = self._rerun(path, call, remat)
            path.cost = call.cost
        values = self.values
        for t, v in zip(outputs, results, strict=True):
            if t.storage.resident:
                values[t.id] = v
        return path.cost

    def _rerun(self, path: ComputePath, call: OpCall, remat: bool) -> list[torch.Tensor]:
        """Run the op on the inputs' current values (writing into copies of the inputs it
        mutates unless the engine handed the op their blocks); a recomputation draws from
        the RNG state of the first run and leaves the current one as it was, and a first run
        (an in-place op's) sets the op's cost."""
        values = self.values
        ins = [values[t.id] for t in path.inputs]
        if call.random and call.rng is None:
            call.rng = capture_rng(_devices(ins), _generators(call.leaves))
        mutated = path.mutated
        reused = path.reused
        for i, new in zip(mutated, path.versions, strict=True):
            if reused.get(new.storage) is None:
                ins[i] = copy_of(ins[i])
        given = call.rerun_leaves if remat and call.rerun_leaves is not None else call.leaves
        leaves = [ins[x.index] if type(x) is Slot else x for x in given]
        args, kwargs = unflatten(leaves, call.spec)
        with below_autograd(call.grad):
            if remat and call.rng is not None:
                with RestoredRng(call.rng):
                    out = call.func(*args, **kwargs)
            else:
                t0 = perf_counter_ns()
                out = call.func(*args, **kwargs)
                if not remat:
                    call.cost = self._cost(call, args, kwargs, out, t0)
        flat = flatten_result(out)[0]
        return [flat[k] for k in call.outputs] + [ins[i] for i in mutated]

    def drop(self, storage: Storage) -> None:
        values = self.values
        for t in storage.tensors:
            values.pop(t.id, None)

    def value(self, tensor: Tensor) -> torch.Tensor:
        return self.values[tensor.id]


_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU).add(
    torch._C.DispatchKey.AutocastCUDA)


@contextmanager
def below_autograd(grad: bool) -> Iterator[None]:
    """Run recorded aten ops as they first ran: below autograd (no graph on the values) and
    autocast (their dtypes are already decided), in the grad mode they saw."""
    with (torch._C._AutoDispatchBelowAutograd(), torch._C._ExcludeDispatchKeyGuard(_AUTOCAST),
          torch.set_grad_enabled(grad)):
        yield


def copy_of(v: torch.Tensor) -> torch.Tensor:
    """A copy of ``v`` with the same layout: the whole storage is copied and the view taken
    again, so a write through a view lands in the copy at the same place."""
    base = torch.empty(0, dtype=v.dtype, device=v.device).set_(
        v.untyped_storage().clone(), 0, (v.untyped_storage().nbytes() // v.element_size(),))
    return base.as_strided(v.size(), v.stride(), v.storage_offset())


def _layout(tensors: list[torch.Tensor], inputs: list[torch.Tensor]
            ) -> tuple[list[int], list[int] | None]:
    """Bytes and aliased input of each output (None: no output aliases an input): a view
    shares its input's storage. Storages are compared by identity, not data pointer, which
    fake and meta tensors do not have (an output of 0 bytes aliases nothing)."""
    out_bytes = []
    out_alias = None
    owners = None  # looked up only if some output has bytes
    for k, o in enumerate(tensors):
        st = o.untyped_storage()
        nbytes = st.nbytes()
        if nbytes:
            if owners is None:
                owners = []
                for v in inputs:  # a loop, not a comprehension (see probe)
                    owners.append(v.untyped_storage()._cdata)
            where = st._cdata
            if where in owners:
                if out_alias is None:
                    out_alias = [-1] * len(tensors)
                out_alias[k] = owners.index(where)
                nbytes = 0
        out_bytes.append(nbytes)
    return out_bytes, out_alias


def _devices(values: list[torch.Tensor]) -> list[torch.device]:
    return list({v.device for v in values if v.device.type != "cpu"})


def _generators(leaves: list[Any]) -> list[torch.Generator]:
    return [x for x in leaves if isinstance(x, torch.Generator)]
