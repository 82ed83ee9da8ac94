"""Build membudget: the engine's core (``membudget.core``) is compiled with mypyc.

The core runs on every aten op of a live session and on every event of a simulated replay;
compiled, the runtime's own work per op drops by a fifth to a quarter (figures in
docs/results/live-overhead.md). The same sources run uncompiled when the package is installed
with ``MEMBUDGET_PURE_PYTHON=1`` (say, to edit the core without rebuilding after each change).
"""

import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from setuptools import setup

CORE = Path("src/membudget/core")
ext_modules = []
if os.environ.get("MEMBUDGET_PURE_PYTHON", "") in ("", "0"):
    from mypyc.build import mypycify

    sources = sorted(str(p) for p in CORE.rglob("*.py")
                     if p.name != "__init__.py")  # (the packages' registries stay interpreted)
    ext_modules = mypycify(sources, group_name="membudget_core")
else:  # an earlier editable build left compiled modules beside the sources: they would win
    for built in {p for s in EXTENSION_SUFFIXES
                  for p in [*CORE.rglob("*" + s), *CORE.parent.parent.glob("membudget_core*" + s)]}:
        built.unlink()

setup(ext_modules=ext_modules)
