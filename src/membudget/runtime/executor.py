"""The torch executor: runs aten ops for the engine and holds the real tensors it may drop.

Every engine tensor's value is a real ``torch.Tensor`` kept in ``values`` while its storage is
resident. Before a new op runs, ``probe`` tells the engine the bytes its outputs will take and
what it costs (``runtime.sizing``: predicted once per signature, then cached), so the engine
makes room first; ``run`` then runs it. A recomputation rebuilds the op's arguments from the
current values, restores the RNG state the op first ran with, and is checked against the
first run: each output's shape, strides, offset, dtype and device (PyTorch's checkpoint
``determinism_check``), and with ``check="checksum"`` its bytes too. In-place ops write their
new version into the old value's tensor when the engine lets them (it handed them its block,
or nothing can need the old value any more), and into a copy otherwise (copy-on-write).
A swap copies a storage's bytes to host memory (pinned where the device is not the CPU, a
plain copy on a CPU) and back, synchronously, and takes every view of it again.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from contextlib import nullcontext
from time import perf_counter_ns
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from membudget.core.executor import Executor
from membudget.core.records import ComputePath, Storage, Tensor
from membudget.errors import MembudgetError, RecomputationError
from membudget.runtime.bounds import data_dependent
from membudget.runtime.call import (
    OpCall,
    OpTimer,
    RestoredRng,
    Slot,
    below_autograd,
    capture_rng,
    devices_of,
    generators_in,
)
from membudget.runtime.classify import op_info
from membudget.runtime.flat import flatten_result, unflatten
from membudget.runtime.sizing import (
    FAKE,
    REAL,
    Layout,
    Recent,
    check_prediction,
    estimate,
    meta_of,
    observed,
    predict,
    signature,
)

# cost function -> signature -> its price in ns, kept for the process as the layouts are: a
# session per step would otherwise price every signature again (about 6 µs per op of GPT-2)
PRICES: weakref.WeakKeyDictionary[OpTimer, Recent[float]] = weakref.WeakKeyDictionary()

CHECKS = ("default", "checksum", "none")  # what a recomputation is checked against


class TorchExecutor(Executor):
    """Runs :class:`OpCall` paths on real (or fake: ``fake=True``) tensors; ``values`` maps
    engine tensor ids to them. An op's cost is known before it runs: the first measured run
    of its signature (an estimate until there is one), or with ``cost`` the seconds that
    function predicts from the op, its arguments and result (a cost model of another
    device). ``check`` says what a recomputation is checked against (:data:`CHECKS`);
    ``unsized`` counts the ops that had to run before they could be sized (or were sized
    wrongly); ``run_ns`` and ``remat_ns`` are the measured times of the ops' first runs
    and of their recomputations. A host copy is priced ``link = (ns per byte, ns per copy)``
    and a move ``move`` alike (the decisions then do not depend on timings); ``swap_ns`` is
    the copies' measured time."""

    def __init__(self, cost: OpTimer | None = None, *, check: str = "default",
                 fake: bool = False, link: tuple[float, float] = (0.0, 0.0),
                 move: tuple[float, float] = (0.0, 0.0)) -> None:
        self.check = check_name(check)
        self.values: dict[int, torch.Tensor] = {}
        self.cost = cost
        self.layouts = FAKE if fake else REAL
        self.unsized = 0
        self.run_ns = 0  # the measured time of the ops' first runs here
        self.remat_ns = 0  # and of their recomputations
        # outputs of a first run that a meta kernel sized wrongly, with their real bytes: the
        # session has the engine resize them
        self.misfits: list[tuple[Tensor, int]] = []
        self._priced = _prices(cost)  # signature -> what ``cost`` says, in ns
        self.mode: object | None = None  # the session's dispatch mode, which it sets
        self.link_ns_per_byte, self.link_launch = link
        self.copy_ns_per_byte, self.copy_launch = move
        # storage id -> its bytes in host memory (fake tensors, which hold none: the views)
        self.host: dict[int, Any] = {}
        # storage id -> (tensor id, dtype, offset, size, stride) of each view it had when
        # it was swapped out, and the device it goes back to
        self.parked: dict[int, tuple[torch.device, list[tuple]]] = {}
        self.swap_ns = 0

    def probe(self, path: ComputePath) -> tuple[list[int], list[int] | None, float]:
        call: OpCall = path.op
        key = signature(call, path.inputs)
        layout = self.layouts.get(key)
        if layout is None:
            predicted = predict(call, path)
            if predicted is None:  # only a real run can tell
                return self._run_first(path, call, key)
            layout, args, kwargs, out = predicted
            layout.key = key
            if self.cost is None:
                layout.cost = estimate(call.func, args, kwargs, out, _device_kind(path, call))
        call.layout = layout
        if self.cost is None:
            cost = call.cost = layout.cost
        else:
            cost = call.cost = self._price(key, path, call, layout)
        return layout.out_bytes, layout.out_alias, cost

    def _price(self, key: tuple, path: ComputePath, call: OpCall, layout: Layout) -> float:
        """What the ``cost`` function says of this signature (asked once in the process), in
        ns: its arguments' values and meta tensors of the outputs' layout."""
        cost = self._priced.get(key)
        if cost is None:
            args, kwargs = unflatten(self._leaves(path, call.leaves), call.spec)
            flat: list[Any] = [None] * (max(layout.outputs, default=-1) + 1)
            for k, (shape, stride, _, dtype, _) in zip(layout.outputs, layout.meta, strict=True):
                flat[k] = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            out = flat[0] if len(flat) == 1 else flat
            cost = self.cost(call.func, tuple(args), kwargs, out) * 1e9
            self._priced.keep(key, cost)
        return cost

    def _leaves(self, path: ComputePath, given: list[Any]) -> list[Any]:
        """A call's flattened arguments with the inputs' current values in their slots."""
        values = self.values
        real = []  # loops, not comprehensions: on every op, and in Python 3.11 a
        for t in path.inputs:  # comprehension is a call
            real.append(values[t.id])
        leaves = []
        for x in given:
            leaves.append(real[x.index] if type(x) is Slot else x)
        return leaves

    def _run_first(self, path: ComputePath, call: OpCall, key: tuple
                   ) -> tuple[list[int], list[int] | None, float]:
        """Run an op that could not be sized before it ran (the following ``run`` keeps its
        result), and keep its layout unless its output shapes depend on its data."""
        self.unsized += 1
        leaves = self._leaves(path, call.leaves)
        real = [self.values[t.id] for t in path.inputs]
        if call.random:
            call.rng = capture_rng(devices_of(real), generators_in(call.leaves))
        args, kwargs = unflatten(leaves, call.spec)
        t0 = perf_counter_ns()
        out = call.func._op(*args, **kwargs)
        measured = float(perf_counter_ns() - t0)
        self.run_ns += int(measured)
        flat, call.returned_kind = flatten_result(out)
        layout = observed(call, flat, real, measured)
        if self.cost is None:
            call.cost = measured
        else:
            call.cost = self.cost(call.func, tuple(args), kwargs, out) * 1e9
            layout.measured = False  # (a fake run's time says nothing of a real one)
        if not data_dependent(call.func, args, kwargs):
            self.layouts.keep(key, layout)
        call.layout = layout
        call.outputs = layout.outputs
        call.returned = flat
        call.result = [flat[k] for k in layout.outputs]
        return layout.out_bytes, layout.out_alias, call.cost

    def run(self, path: ComputePath, remat: bool) -> float:
        call: OpCall = path.op
        outputs = path.outputs
        if remat:
            t0 = perf_counter_ns()
            results = self._rerun(path, call, remat)
            self.remat_ns += perf_counter_ns() - t0
            if self.check != "none":
                self._check(path, call, results)
        else:
            if call.result is not None:  # it ran to be sized
                results, call.result = call.result, None
            elif not path.mutated:  # a new op, sized before it runs
                results = self._first_run(path, call)
            else:  # an in-place op: it must see where the engine put its versions
                results = self._rerun(path, call, remat)
                path.cost = call.cost
            if len(outputs) == 1 and not path.mutated:  # _describe, for the commonest op
                outputs[0].meta = call.layout.meta[0]
            else:
                self._describe(path, call, results)
            if self.check == "checksum":
                call.checksums = [_digest(r) for r in results]
        values = self.values
        for t, v in zip(outputs, results, strict=True):
            # an output whose value is still there keeps it: a recomputation's duplicate of
            # it is dropped (its views hold the kept one, which must stay the only copy)
            if t.storage.resident and not t.defined:
                values[t.id] = v
        return path.cost

    def _first_run(self, path: ComputePath, call: OpCall) -> list[torch.Tensor]:
        """Run a new op the engine has made room for; a signature's first real run reads
        its real layout (checking the prediction) and its time, kept for the next calls."""
        values = self.values
        real = []  # (_leaves, inlined: the hot path)
        for t in path.inputs:
            real.append(values[t.id])
        leaves = []
        for x in call.leaves:
            leaves.append(real[x.index] if type(x) is Slot else x)
        if call.random:
            call.rng = capture_rng(devices_of(real), generators_in(call.leaves))
        op = call.func._op  # what OpOverload.__call__ calls, without its Python frame
        if call.spec is None:
            t0 = perf_counter_ns()
            out = op(*leaves)
        else:
            args, kwargs = unflatten(leaves, call.spec)
            t0 = perf_counter_ns()
            out = op(*args, **kwargs)
        elapsed = perf_counter_ns() - t0
        self.run_ns += elapsed
        layout: Layout = call.layout
        if type(out) is torch.Tensor:  # most ops
            call.returned_kind = None
            flat = [out]
        else:
            flat, call.returned_kind = flatten_result(out)
        call.returned = flat
        if not layout.real:  # this signature's first run, or a call sized at its bound
            seen = observed(call, flat, real, float(elapsed))
            if layout.bound or check_prediction(call, layout, seen):
                self._misfit(path, layout, seen)
            if self.cost is not None:
                seen.measured = False
                seen.cost = layout.cost
            if not layout.bound:
                self.layouts.keep(layout.key, seen)  # type: ignore[arg-type]
            call.layout = layout = seen
        elif not layout.measured and self.cost is None:
            layout.cost = float(elapsed)  # (kept by a fake or priced run: now timed)
            layout.measured = True
        call.outputs = layout.outputs
        if type(out) is torch.Tensor:
            return flat
        return [flat[k] for k in layout.outputs]

    def _misfit(self, path: ComputePath, predicted: Layout, seen: Layout) -> None:
        """A run whose outputs were placed at other sizes than it made (a meta kernel's
        error, counted in ``unsized``, or a data-dependent op's bound): each fresh output
        the engine placed at the wrong size is resized by the session after the op."""
        if not predicted.bound:
            self.unsized += 1
        outputs = path.outputs
        assert outputs is not None
        if len(seen.outputs) != len(outputs):
            raise MembudgetError(f"{path.op}: its meta kernel returned {len(outputs)} tensors "
                                 f"but its real kernel {len(seen.outputs)}")
        for k, n in enumerate(seen.out_bytes):
            if (predicted.out_alias is None or predicted.out_alias[k] < 0) \
                    and n != predicted.out_bytes[k]:
                self.misfits.append((outputs[k], n))

    def _describe(self, path: ComputePath, call: OpCall, results: list[torch.Tensor]) -> None:
        """Give each output of a first run its :func:`meta_of` (the signature of the ops
        that read it, and what its recomputation must reproduce); a new version has its
        input's, unless the op changed its shape, strides or offset."""
        outputs = path.outputs
        assert outputs is not None
        n = len(outputs) - len(path.mutated)
        if n:
            for t, m in zip(outputs, call.layout.meta, strict=True):  # (no versions here)
                t.meta = m
        inputs = path.inputs
        restrides = op_info(call.func).restrides
        for k, i in enumerate(path.mutated):
            v = outputs[n + k]
            v.meta = meta_of(results[n + k]) if restrides else inputs[i].meta

    def _check(self, path: ComputePath, call: OpCall, results: list[torch.Tensor]) -> None:
        """A recomputation must reproduce the first run's outputs (their metadata, and
        their bytes when checking checksums)."""
        outputs = path.outputs
        assert outputs is not None
        for k, (t, r) in enumerate(zip(outputs, results, strict=True)):
            got = meta_of(r)
            if got != t.meta:
                raise RecomputationError(call, k, _describe_meta(t.meta), _describe_meta(got))
        sums = call.checksums
        if sums is not None:
            for k, r in enumerate(results):
                again = _digest(r)
                if again != sums[k]:
                    raise RecomputationError(call, k, f"bytes of digest {sums[k].hex()}",
                                             f"bytes of digest {again.hex()}")

    def _rerun(self, path: ComputePath, call: OpCall, remat: bool) -> list[torch.Tensor]:
        """Run the op on the inputs' current values (writing into copies of the inputs it
        mutates unless the engine handed the op their blocks); a recomputation draws from
        the RNG state of the first run and leaves the current one as it was, and a first run
        (an in-place op's) sets the op's cost."""
        values = self.values
        ins = [values[t.id] for t in path.inputs]
        if call.random and call.rng is None:
            call.rng = capture_rng(devices_of(ins), generators_in(call.leaves))
        mutated = path.mutated
        reused = path.reused
        restrides = op_info(call.func).restrides
        for i, new in zip(mutated, path.versions, strict=True):
            if restrides:  # it changes the metadata of what it gets: give it an alias
                ins[i] = ins[i].view_as(ins[i])
            elif reused.get(new.storage) is None:
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
                    elapsed = perf_counter_ns() - t0
                    self.run_ns += elapsed
                    call.cost = (float(elapsed) if self.cost is None
                                 else self.cost(call.func, tuple(args), kwargs, out) * 1e9)
        flat = flatten_result(out)[0]
        return [flat[k] for k in call.outputs] + [ins[i] for i in mutated]

    def drop(self, storage: Storage) -> None:
        values = self.values
        for t in storage.tensors:
            values.pop(t.id, None)

    def value(self, tensor: Tensor) -> torch.Tensor:
        return self.values[tensor.id]

    def move(self, storage: Storage, batched: bool = False) -> float:
        """Copy the storage once to new memory and take every view of it again there (the
        device's allocator picks the address); return the measured ns (``batched`` or not:
        each copy is its own, timed). The copy is an ordinary op for the modes outside the
        session (a memory meter sees it), but not for the session itself, which is ``mode``
        while it runs."""
        values = self.values
        views = [(t.id, values[t.id]) for t in storage.tensors if t.id in values]
        if not views or self.layouts is FAKE:  # fake tensors hold no memory to move
            return 0.0
        t0 = perf_counter_ns()
        with self._outside():
            data = views[0][1].untyped_storage().clone()
            for tid, v in views:
                values[tid] = torch.empty(0, dtype=v.dtype, device=v.device).set_(
                    data, v.storage_offset(), v.size(), v.stride())
        return float(perf_counter_ns() - t0)

    def transfer(self, storage: Storage) -> float:
        return self.link_launch + storage.nbytes * self.link_ns_per_byte

    def swap_out(self, storage: Storage, now: float) -> float:
        """Copy the storage's bytes to host memory unless a copy is there already, and note
        its views; the engine then drops the device's. Returns the priced copy time."""
        values = self.values
        views = [(t.id, values[t.id]) for t in storage.tensors if t.id in values]
        if not views:
            raise MembudgetError(f"{storage} has no value to swap out")
        first = views[0][1]
        self.parked[storage.id] = (first.device, [
            (tid, v.dtype, v.storage_offset(), v.size(), v.stride()) for tid, v in views])
        price = self.out_wait(storage, now)
        if self.layouts is FAKE:  # fake tensors hold no bytes: keep the views themselves
            self.host[storage.id] = views
            return price
        if storage.host_ready != math.inf:  # its host copy is there already
            return price
        t0 = perf_counter_ns()
        with self._outside():
            src = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
                first.untyped_storage())
            host = torch.empty(src.shape, dtype=torch.uint8, device="cpu",
                               pin_memory=src.device.type != "cpu")
            host.copy_(src)
            self.host[storage.id] = host
        self.swap_ns += perf_counter_ns() - t0
        return price

    def swap_in(self, storage: Storage, now: float) -> float:
        """Copy the host bytes back into new device memory and take every view again."""
        device, views = self.parked.pop(storage.id)
        host = self.host[storage.id]
        values = self.values
        if self.layouts is FAKE:  # the views themselves were kept
            values.update(host)
            return self.transfer(storage)
        t0 = perf_counter_ns()
        with self._outside():
            data = torch.empty(host.shape, dtype=torch.uint8, device=device)
            data.copy_(host)
            data = data.untyped_storage()
            for tid, dtype, offset, size, stride in views:
                values[tid] = torch.empty(0, dtype=dtype, device=device).set_(
                    data, offset, size, stride)
        self.swap_ns += perf_counter_ns() - t0
        return self.transfer(storage)

    def drop_host(self, storage: Storage) -> None:
        self.host.pop(storage.id, None)
        self.parked.pop(storage.id, None)

    def _outside(self) -> Any:
        """Run copies as ordinary ops for the modes outside the session (a memory meter sees
        them) but not for the session itself, which is ``mode`` while it runs."""
        inside = _get_current_dispatch_mode() is self.mode
        return _pop_mode_temporarily() if inside else nullcontext()


def _prices(cost: OpTimer | None) -> Recent[float]:
    """The process's prices from ``cost``; a function that cannot be weakly referenced (a
    builtin) gets a table of its own."""
    if cost is None:
        return Recent()
    try:
        return PRICES.setdefault(cost, Recent())
    except TypeError:
        return Recent()


def check_name(check: str) -> str:
    """``check`` if it names a check of :data:`CHECKS`; else a clear error."""
    if check not in CHECKS:
        raise MembudgetError(f"unknown determinism_check {check!r}; known: {', '.join(CHECKS)}")
    return check


def copy_of(v: torch.Tensor) -> torch.Tensor:
    """A copy of ``v`` with the same layout: the whole storage is copied and the view taken
    again, so a write through a view lands in the copy at the same place."""
    base = torch.empty(0, dtype=v.dtype, device=v.device).set_(
        v.untyped_storage().clone(), 0, (v.untyped_storage().nbytes() // v.element_size(),))
    return base.as_strided(v.size(), v.stride(), v.storage_offset())


def _device_kind(path: ComputePath, call: OpCall) -> str:
    """The device an op runs on: its first input's, or a factory op's ``device`` argument."""
    if path.inputs:
        return path.inputs[0].meta[4].type
    for x in call.leaves:
        if type(x) is torch.device:
            return x.type
    return "cpu"


def _digest(x: torch.Tensor) -> bytes:
    """A digest of a tensor's elements (``check="checksum"``: a debugging aid, not cheap)."""
    data = x.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).digest()


def _describe_meta(m: tuple) -> str:
    shape, stride, offset, dtype, device = m
    return (f"shape {tuple(shape)}, strides {stride}, offset {offset}, {dtype} on {device}")
