"""The framework-free engine: records, allocators, policies, executors and stats. No torch.

Its modules are compiled with mypyc when the package is built (setup.py), as is the packing
search (``membudget.plan.packing.canonical``); ``COMPILED`` says whether this process runs
them compiled.
"""

import warnings
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from membudget.core import engine as _engine
from membudget.core.engine import Engine
from membudget.core.executor import Executor, SimulatedExecutor
from membudget.core.records import ComputePath, Storage, Tensor
from membudget.errors import StaleBuildWarning

COMPILED = not _engine.__file__.endswith(".py")


def _stale_sources(package: Path) -> list[str]:
    """Sources under ``package`` changed after they were compiled (an editable install keeps
    running the compiled modules beside them until it is rebuilt). Each module beside its
    source is a shim into one group library that holds all the compiled code; a rebuild may
    leave a shim untouched, so a source counts as built when either is newer."""
    root = next(p for p in package.parents if p.name == "membudget").parent
    group = max((p.stat().st_mtime for s in EXTENSION_SUFFIXES
                 for p in root.glob("membudget_core__mypyc" + s)), default=0.0)
    stale = []
    for built in {p for s in EXTENSION_SUFFIXES for p in package.rglob("*" + s)}:
        source = built.with_name(built.name.split(".")[0] + ".py")
        if source.exists() and source.stat().st_mtime > max(built.stat().st_mtime, group) + 1:
            stale.append(str(source.relative_to(root)))
    return sorted(stale)


def warn_if_stale(package: Path) -> None:
    """Warn (StaleBuildWarning) if compiled modules under ``package`` are older than their
    sources: the old code would run."""
    if stale := _stale_sources(package):
        warnings.warn(f"membudget's compiled modules are older than {', '.join(stale)}: the "
                      "old code runs. Rebuild them with `pip install -e .`, or install with "
                      "MEMBUDGET_PURE_PYTHON=1 to run the sources uncompiled.",
                      StaleBuildWarning, stacklevel=2)


if COMPILED:
    warn_if_stale(Path(__file__).parent)

__all__ = ["COMPILED", "ComputePath", "Engine", "Executor", "SimulatedExecutor", "Storage",
           "Tensor"]
