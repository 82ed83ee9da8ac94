"""Build membudget: the engine's core (``membudget.core``) and the packing search's inner loop
(``membudget.plan.packing.canonical``) are compiled with mypyc.

The core runs on every aten op of a live session and on every event of a simulated replay;
compiled, the runtime's own work per op drops by a fifth to a quarter (figures in
docs/results/live-overhead.md); the canonical search visits 2.8-3.9x as many nodes a second
on MiniMalloc's D and J. The same sources run uncompiled when the package is installed
with ``MEMBUDGET_PURE_PYTHON=1`` (say, to edit the core without rebuilding after each change).
"""

import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from setuptools import setup

CORE = Path("src/membudget/core")
#: the canonical packing search's inner loop (membudget pack), compiled like the core
SEARCH = [Path("src/membudget/plan/packing/canonical.py")]
ext_modules = []
if os.environ.get("MEMBUDGET_PURE_PYTHON", "") in ("", "0"):
    from mypyc.build import mypycify

    sources = sorted(str(p) for p in CORE.rglob("*.py")
                     if p.name != "__init__.py")  # (the packages' registries stay interpreted)
    sources += [str(p) for p in SEARCH]
    ext_modules = mypycify(sources, group_name="membudget_core")
else:  # an earlier editable build left compiled modules beside the sources: they would win
    for built in {p for s in EXTENSION_SUFFIXES
                  for p in [*CORE.rglob("*" + s), *CORE.parent.parent.glob("membudget_core*" + s),
                            *(src.with_suffix(s) for src in SEARCH)] if p.exists()}:
        built.unlink()

setup(ext_modules=ext_modules)
