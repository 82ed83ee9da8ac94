"""Byte quantities as people write them: ``1.5 GiB``, ``512MB``, ``1e9``."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# a number (digits may be grouped by thousands with "," or "_", as this package prints
# them), then an optional unit
_PATTERN = re.compile(r"^\s*([0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]{1,3}(?:_[0-9]{3})+"
                      r"(?:\.[0-9]+)?|[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$",
                      re.IGNORECASE)


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string with an optional unit (B, kB, MB, GB, KiB, MiB, GiB...);
    thousands may be grouped as the package's messages print them (``18,737,792 B``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n: float = value  # exact, however large
    elif isinstance(value, float):
        n = value
    else:
        m = _PATTERN.match(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a byte size; write e.g. 1500000000, "
                             "'1,500,000,000 B', '1.5 GB' or '1.5 GiB' (units: B, kB, MB, GB, "
                             "TB, KiB, MiB, GiB, TiB)")
        n = float(m.group(1).replace(",", "").replace("_", "")) * _UNITS[unit]
    if not n < math.inf:  # (NaN fails too)
        raise ValueError(f"a byte size must be a finite number, got {value!r}")
    if n < 0:
        raise ValueError(f"a byte size cannot be negative: {value!r}")
    return int(n)


def format_bytes(n: float) -> str:
    """A short human form: 1.50 GiB, 12.0 MiB, 512 B."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
