"""Capture one training step of a zoo model as a trace: forward, backward and an AdamW step.

The step runs inside a ``membudget.budget`` session with no limit, so the trace comes from the
same recorder as any live run. Live, op costs are measured times (or predicted by a device
spec); with ``fake`` the model is built and run under ``FakeTensorMode``, so nothing is
allocated and a model of any size is captured in minutes, with costs from the device spec.
Parameters, buffers, optimizer state and the batch enter the trace first, as the pinned leaves
they are for the whole step; the optimizer state exists already (a steady-state step).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from membudget import models
from membudget.errors import MembudgetError, UnknownNameError, excerpt
from membudget.runtime.call import OpTimer
from membudget.runtime.session import Session
from membudget.units import format_bytes

UNLIMITED = 2**62
CAPTURE_VERSION = 4  # bump when what a capture records changes, to invalidate the cache
FAKE_SPEC = "a100-80gb"  # the default cost model of a fake capture
Progress = Callable[[str, Session | None], None]


@dataclass
class Capture:
    """What a capture produced: the trace (if written), its size and what it took."""

    model: str
    batch: int
    fake: bool
    spec: str | None  # the device spec that priced the ops; None: measured times
    path: Path | None
    ops: int
    peak_bytes: int
    param_count: int
    seconds: float
    max_rss_bytes: int


class LiveStepTooLarge(MembudgetError, MemoryError):
    """A live capture would need more memory than the device has."""


def capture_step(name: str, batch: int | None = None, *, fake: bool = False,
                 spec: str | None = None, path: str | Path | None = None,
                 device: str | torch.device | None = None, check_fits: bool = True,
                 optimizer: str = "adamw", progress: Progress | None = None) -> Capture:
    """Record one training step of zoo model ``name`` at ``batch`` (its paper batch by
    default) and write it to ``path``. ``spec`` prices each op on a named device
    (``membudget.cost``); a fake capture defaults to ``a100-80gb``, a live one to measured
    times. A live capture first checks, with a fake one, that the step fits the device.
    ``optimizer``: ``adamw`` (fused: one update of all parameters, after every gradient) or
    ``sgd`` (OLLA's benchmarks: plain SGD, one update per parameter, which a static plan
    may run as soon as that gradient exists)."""
    if optimizer not in OPTIMIZERS:
        raise UnknownNameError("optimizer", optimizer, OPTIMIZERS)
    entry = models.get(name)
    batch = entry.batch if batch is None else batch
    if batch < 1:
        raise MembudgetError(f"a batch size must be >= 1, got {batch}")
    if fake and device is not None:
        raise MembudgetError("a fake capture allocates nothing on any device, so --device "
                             "has no effect with --fake; price its ops with --device-spec")
    if device is not None:
        _check_device(device)
    if fake and spec is None:
        spec = FAKE_SPEC
    if not fake and check_fits:
        _check_fits(name, batch, device, optimizer)
    timer: OpTimer | str = "measured"  # a live capture keeps the times it measured
    prices: dict[str, Any] = {}  # a live capture keeps its session's move price
    if spec is not None:
        from membudget.cost import CostModel, get_spec

        timer = CostModel(get_spec(spec)).op_seconds
        # moves are priced on the spec that prices the ops, not on the capturing machine
        ns_per_byte, launch_ns = get_spec(spec).move_ns()
        prices["move_price"] = {"ns_per_byte": ns_per_byte, "launch_ns": launch_ns}
    tell = progress or (lambda phase, session: None)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with _building(fake, device), _sizes_fit(name, batch):
        tell("build", None)
        workload = entry.build(batch)
        model = workload.model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = OPTIMIZERS[optimizer](params)
        with Session(UNLIMITED, "dtr", record=path is not None, cost=timer) as session:
            session.adopt(params)
            session.adopt(model.buffers())
            session.adopt(tree_leaves([opt.state[p] for p in params]))
            session.adopt(t for t in tree_leaves(workload.batch) if isinstance(t, torch.Tensor))
            tell("forward", session)
            session.phase("forward")
            blocks: list[list[int]] = []
            with _noting_blocks(model, session, blocks):
                loss = workload.loss(model, workload.batch)
            tell("backward", session)
            session.phase("backward")
            loss.backward()
            tell("optimizer", session)
            session.phase("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
    result = Capture(name, batch, fake, spec, None, session.stats.ops, session.stats.peak_bytes,
                     sum(p.numel() for p in model.parameters()), time.perf_counter() - t0,
                     resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if path is not None:
        tell("write", None)
        result.path = session.trace(
            path, model=name, batch=batch, fake=fake, device_spec=spec,
            cost_source=f"predicted:{spec}" if spec else "measured",
            source="membudget trace", params=result.param_count, torch=torch.__version__,
            optimizer=optimizer,
            policy=None, allocator=None, budget_bytes=None,
            dtype=str(torch.get_default_dtype()).removeprefix("torch."), **prices,
            **({"blocks": sorted(blocks)} if blocks else {}))
    return result


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the children of an ``nn.ModuleList`` or ``nn.Sequential``
    that has at least two children of one type, each with at least three submodules holding
    parameters (a transformer layer, a ResNet bottleneck; not a conv + norm pair); where
    such blocks nest (ResNet stages of bottlenecks), the innermost."""
    def weighty(m: torch.nn.Module) -> bool:
        return sum(next(s.parameters(recurse=False), None) is not None
                   for s in m.modules()) >= 3

    found: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            by_type: dict[type, list[torch.nn.Module]] = {}
            for c in m.children():
                by_type.setdefault(type(c), []).append(c)
            found += [c for cs in by_type.values() if len(cs) >= 2 and all(map(weighty, cs))
                      for c in cs]
    ids = {id(b) for b in found}
    return [b for b in found if not any(id(s) in ids for s in b.modules() if s is not b)]


@contextlib.contextmanager
def _noting_blocks(model: torch.nn.Module, session: Session,
                   into: list[list[int]]) -> Iterator[None]:
    """Note where each forward of a repeated block (:func:`repeated_blocks`) runs, by module
    forward hooks, as the trace header's ``blocks``: ``[begin, end]`` pairs of call indices
    (the block's calls are ``begin`` … ``end - 1``); nothing if the session does not
    record."""
    ops = getattr(session.recording, "ops", None)
    if ops is None:
        yield
        return
    open_: dict[int, list[int]] = {}

    def pre(module: torch.nn.Module, args: object) -> None:
        open_.setdefault(id(module), []).append(len(ops))

    def post(module: torch.nn.Module, args: object, out: object) -> None:
        into.append([open_[id(module)].pop(), len(ops)])

    handles = [h for b in repeated_blocks(model)
               for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW (fused: one update op over all parameters) with its state already made, as in
    every step after the first; zero gradients make the state without changing the model
    beyond AdamW's weight decay."""
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Plain SGD as OLLA's benchmarks ran it: no state, one update op per parameter."""
    return torch.optim.SGD(params, lr=0.1, foreach=False)


OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": _adamw, "sgd": _sgd}


@contextlib.contextmanager
def _building(fake: bool, device: str | torch.device | None) -> Iterator[None]:
    """Where the zoo builder creates its tensors: fake ones, or real ones on ``device``."""
    if fake:
        with FakeTensorMode():
            yield
    elif device is not None:
        with torch.device(device):
            yield
    else:
        yield


def _check_device(device: str | torch.device) -> None:
    """Refuse a device torch cannot name or cannot allocate on here, before any work."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MembudgetError(f"cannot capture on device {excerpt(str(device))}: "
                             f"{excerpt(first, 200)}; give a device this machine has, such "
                             "as cpu or cuda:0") from None
    if torch.device(device).type == "meta":
        raise MembudgetError("a live capture runs the step, and meta tensors hold no values; "
                             "use --fake to capture without allocating")


@contextlib.contextmanager
def _sizes_fit(name: str, batch: int) -> Iterator[None]:
    """Say plainly when a batch is so large that torch's element counts overflow int64."""
    try:
        yield
    except RuntimeError as e:
        if "overflow" not in str(e):
            raise
        raise MembudgetError(f"{name} at batch {batch:,} has tensors of more elements than "
                             f"int64 counts ({excerpt(str(e), 80)}); give a smaller "
                             "--batch") from None


def _check_fits(name: str, batch: int, device: str | torch.device | None,
                optimizer: str) -> None:
    """Refuse a live capture whose step (from a fake capture) exceeds the device's free
    memory, before anything is built."""
    need = capture_step(name, batch, fake=True, optimizer=optimizer).peak_bytes
    dev = torch.device(device) if device is not None else torch.device("cpu")
    free = _free_bytes(dev)
    if free is not None and need > free:
        raise LiveStepTooLarge(
            f"a live step of {name} at batch {batch} needs about {format_bytes(need)} "
            f"(parameters, gradients, optimizer state and activations, from a fake capture) "
            f"but {dev} has {format_bytes(free)} free; capture it with --fake (nothing is "
            f"allocated) or a smaller --batch")


def _free_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``: CUDA's, or the host's available memory (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------------- cache
def cache_dir() -> Path:
    """Where captured traces are kept: ``$MEMBUDGET_CACHE/traces`` or ~/.cache/membudget."""
    root = os.environ.get("MEMBUDGET_CACHE") or Path.home() / ".cache" / "membudget"
    return Path(root) / "traces"


def cached_trace(name: str, batch: int | None = None, *, spec: str = FAKE_SPEC,
                 optimizer: str = "adamw", progress: Progress | None = None) -> Path:
    """The fake-captured trace of zoo model ``name``, captured now unless a capture with the
    same model, batch, spec, optimizer and software versions is cached on disk."""
    import transformers

    from membudget import __version__

    entry = models.get(name)
    batch = entry.batch if batch is None else batch
    key = hashlib.sha256(repr((__version__, torch.__version__, transformers.__version__,
                               CAPTURE_VERSION)).encode()).hexdigest()[:12]
    path = cache_dir() / f"{name}-b{batch}-{spec}-{optimizer}-{key}.jsonl.gz"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.gz")
        capture_step(name, batch, fake=True, spec=spec, path=tmp, optimizer=optimizer,
                     progress=progress)
        tmp.replace(path)  # atomic: concurrent sweeps never read half a trace
    return path


def zoo_sources(items: list[str], batch: int | None = None, spec: str = FAKE_SPEC,
                progress: Progress | None = None, optimizer: str = "adamw") -> list[str]:
    """Trace sources with every zoo model name replaced by its cached fake capture; anything
    that exists as a file, or names a member of an archive, is kept as it is."""
    out = []
    for item in items:
        if Path(item).exists() or "::" in item:
            out.append(item)
        elif item in models.names():
            out.append(str(cached_trace(item, batch, spec=spec, optimizer=optimizer,
                                        progress=progress)))
        else:
            raise MembudgetError(f"{item!r} is neither a trace file nor a zoo model; zoo "
                                 f"models: {', '.join(models.names())}")
    return out
