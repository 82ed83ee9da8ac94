"""One recorded aten call: enough to run it again, as it first ran.

The session flattens each op's arguments, puts a :class:`Slot` where an engine input goes,
and keeps the result in an :class:`OpCall`, the op record the engine stores in a compute
path. Running it again needs the grad mode and autocast state it first saw
(:func:`below_autograd`) and, for a random op, the generator states it drew from
(:func:`capture_rng`, :class:`RestoredRng`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from membudget.runtime.flat import Spec


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
    mkldnn's RNN keeps its workspace only with grad on). ``cost`` is what the engine charges
    for it (ns), known before it runs (``runtime.sizing``), and ``layout`` its outputs as
    they were known then. After the first run, ``outputs`` are the positions of the recorded
    tensors in the flattened result, ``result`` those tensors until the engine takes them
    (when the op had to run before the engine could size it), ``returned`` the whole
    flattened result (with its ``returned_kind``) until the session has wrapped it, and
    ``checksums`` the digests of its outputs when the session checks recomputations by them.
    """

    __slots__ = ("checksums", "cost", "func", "grad", "layout", "leaves", "outputs", "random",
                 "rerun_leaves", "result", "returned", "returned_kind", "rng", "spec")

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
        self.cost = 0.0
        self.layout: Any = None
        self.checksums: list[bytes] | None = None
        # the arguments of a recomputation, when they differ from the first run's (side
        # effects dropped: see runtime.classify.UNDECLARED_WRITES)
        self.rerun_leaves: list[Any] | None = None

    def __repr__(self) -> str:
        return str(self.func)


OpTimer = Callable[[Any, tuple, dict, Any], float]


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


_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU).add(
    torch._C.DispatchKey.AutocastCUDA)


@contextmanager
def below_autograd(grad: bool) -> Iterator[None]:
    """Run recorded aten ops as they first ran: below autograd (no graph on the values) and
    autocast (their dtypes are already decided), in the grad mode they saw."""
    with (torch._C._AutoDispatchBelowAutograd(), torch._C._ExcludeDispatchKeyGuard(_AUTOCAST),
          torch.set_grad_enabled(grad)):
        yield


def devices_of(values: list[torch.Tensor]) -> list[torch.device]:
    """The accelerators among the devices of ``values`` (whose generators a random op may
    draw from)."""
    return list({v.device for v in values if v.device.type != "cpu"})


def generators_in(leaves: list[Any]) -> list[torch.Generator]:
    """The explicit generators among a call's arguments."""
    return [x for x in leaves if isinstance(x, torch.Generator)]
