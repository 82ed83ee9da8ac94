"""The accelerator's own count of allocated bytes, to cross-check a session's peak.

On a CUDA (or any ``torch.accelerator``) device the caching allocator counts the bytes its
tensors hold. Over a session its peak should sit at or a little above the session's own
(``peak_bytes`` counts the storages the engine holds; the allocator also sees transient
results, workspaces and its 512-byte rounding), so a gap far beyond that means memory the
engine does not see.
"""

from __future__ import annotations

import torch


class DeviceMeter:
    """Peak bytes the accelerator's allocator held beyond what it held at the start; None on
    a machine without one, or when CUDA was never initialised (a session on the CPU)."""

    def __init__(self) -> None:
        self.base: int | None = None
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if acc is None or (acc.type == "cuda" and not torch.cuda.is_initialized()):
            return  # nothing of the session can live there: do not initialise a context for it
        torch.accelerator.reset_peak_memory_stats()
        self.base = torch.accelerator.memory_allocated()

    def peak(self) -> int | None:
        if self.base is None:
            return None
        return torch.accelerator.max_memory_allocated() - self.base
