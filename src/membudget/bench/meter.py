"""An independent meter of real memory: the peak bytes of live storages, seen from dispatch.

It is a dispatch mode that owns no tensors and knows nothing of the engine: every storage an
aten op reads or makes is counted from the first op that touches it until the storage is
freed (a weak reference's callback; torch keeps one Python object per storage while it
lives). Entered *outside* a ``membudget.budget`` session, it sees the real ops the session
runs (first runs and recomputations alike), so its peak is the evidence that a budget held.
It does not see memory that no aten op returns (a kernel's own workspace, RNG states).
It stops counting when it exits; entered again, it counts afresh and keeps its peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_iter


class StorageMeter(TorchDispatchMode):
    """``with StorageMeter() as m: ...`` then ``m.peak_bytes``: the most bytes of storages
    alive at once, over the storages the ops inside touched (on ``device``, or all)."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.device = None if device is None else torch.device(device).type
        self.live_bytes = 0
        self.peak_bytes = 0
        # id(storage) -> a weak reference whose callback uncounts it
        self._live: dict[int, weakref.ref] = {}

    def __exit__(self, *exc: object) -> None:
        """Stop counting: let the weak references go now, not with the meter. Their callbacks
        hold the meter, so it lives in a reference cycle until a collection frees it, and on
        Python 3.11 a collection that frees a weak reference while its referent is being
        destroyed crashes the interpreter (the referent's ``PyObject_ClearWeakRefs``
        allocates a tuple, which can run the collection, while it walks the referent's weak
        references): the test suite crashed so, on a storage five meters had watched."""
        super().__exit__(*exc)
        self._live.clear()
        self.live_bytes = 0  # (entered again, it counts what is alive afresh)

    def count(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` as alive from now on, whether an op touches them or not: what the
        program holds through the steps metered (an optimizer's moments, say)."""
        for x in tensors:
            self._count(x)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for x in (*tree_iter(args), *tree_iter(kwargs or {}), *tree_iter(out)):
            if isinstance(x, torch.Tensor):
                self._count(x)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return out

    def _count(self, x: torch.Tensor) -> None:
        if (is_traceable_wrapper_subclass(x) or x.device.type == "meta"
                or (self.device and x.device.type != self.device)):
            return  # a wrapper has no storage of its own (its data is a plain tensor we see),
            # and a meta tensor (made to price an op, say) has no memory at all
        st = x.untyped_storage()
        key = id(st)
        if key in self._live:
            return
        nbytes = st.nbytes()

        def freed(_: object, key: int = key, nbytes: int = nbytes) -> None:
            if self._live.pop(key, None) is not None:
                self.live_bytes -= nbytes

        self._live[key] = weakref.ref(st, freed)
        self.live_bytes += nbytes
