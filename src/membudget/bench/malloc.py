"""Make glibc's malloc keep freed memory, as a device's caching allocator does.

By default glibc unmaps every freed block over 32 MiB (and trims the heap), so a training
step faults its large tensors in afresh each time, and that kernel time swings with the
machine's load; benchmarks that time steps turn this off for eager and session alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's malloc.h


def keep_freed_memory() -> bool:
    """No mmap for large blocks and no trimming, for the rest of the process; True if
    ``mallopt`` took both (False elsewhere than glibc)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return False
    return bool(mallopt and mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
