"""DistributedDataParallel inside a session: the reducer's bucket rebuild runs outside it.

``install`` also installs FSDP2's counterpart (``runtime.fsdp``): the session installs both
through it.

On its second forward, DDP's C++ reducer rebuilds its gradient buckets: it allocates new flat
buckets and a tensor of bucket indices and writes them through raw pointers. Inside a session
those allocations would come back as wrappers with no data of their own, so the rebuild runs
with the session's dispatch mode suspended. The buckets are DDP's own state, like the
parameters: they enter the session as pinned leaves when an op first touches them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from membudget.runtime import fsdp

_installed = False


def install(mode_type: type) -> None:
    """Make DDP's bucket rebuild step outside any active ``mode_type``, and FSDP2's buffer
    work (``fsdp.install``) (once per process)."""
    global _installed
    fsdp.install(mode_type)
    if _installed or not torch.distributed.is_available():
        return
    from torch._C._distributed_c10d import Reducer

    original = Reducer._rebuild_buckets

    def _rebuild_buckets(self: Any) -> bool:
        if not any(isinstance(m, mode_type) for m in _get_current_dispatch_mode_stack()):
            return original(self)
        with _disable_current_modes():
            return original(self)

    Reducer._rebuild_buckets = _rebuild_buckets
    _installed = True
