"""The compiled core's guard: sources edited after the build are named, so that an editable
install never silently runs (or tests) old compiled code."""

from __future__ import annotations

import os
from importlib.machinery import EXTENSION_SUFFIXES

from membudget.core import _stale_sources


def test_sources_newer_than_their_compiled_modules_are_named(tmp_path):
    package = tmp_path / "src" / "membudget" / "core"
    (package / "policies").mkdir(parents=True)
    suffix = EXTENSION_SUFFIXES[0]
    for name in ("engine", "policies/dtr", "records"):
        (package / f"{name}.py").write_text("")
        (package / f"{name}{suffix}").write_bytes(b"")
    (package / "__init__.py").write_text("")  # not compiled: never stale
    built = (package / f"engine{suffix}").stat().st_mtime
    for name in ("engine", "policies/dtr"):  # edited after the build
        os.utime(package / f"{name}.py", (built + 10, built + 10))
    os.utime(package / "records.py", (built - 10, built - 10))
    assert _stale_sources(package) == ["membudget/core/engine.py",
                                       "membudget/core/policies/dtr.py"]


def test_a_stale_packing_search_is_named(tmp_path):
    """The packing search is compiled with the core, and guarded alike."""
    package = tmp_path / "src" / "membudget" / "plan" / "packing"
    package.mkdir(parents=True)
    (package / f"canonical{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    (package / "canonical.py").write_text("")
    built = (package / f"canonical{EXTENSION_SUFFIXES[0]}").stat().st_mtime
    os.utime(package / "canonical.py", (built + 10, built + 10))
    assert _stale_sources(package) == ["membudget/plan/packing/canonical.py"]


def test_a_fresh_build_is_not_stale(tmp_path):
    package = tmp_path / "membudget" / "core"
    package.mkdir(parents=True)
    (package / "pool.py").write_text("")
    (package / f"pool{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    assert _stale_sources(package) == []


def test_a_rebuild_that_left_a_modules_shim_untouched_is_not_stale(tmp_path):
    """The group library holds the compiled code; the shim beside a source may be older."""
    package = tmp_path / "membudget" / "core"
    package.mkdir(parents=True)
    suffix = EXTENSION_SUFFIXES[0]
    shim, source = package / f"pool{suffix}", package / "pool.py"
    shim.write_bytes(b"")
    source.write_text("")
    built = shim.stat().st_mtime
    os.utime(source, (built + 10, built + 10))
    assert _stale_sources(package) == ["membudget/core/pool.py"]
    group = tmp_path / f"membudget_core__mypyc{suffix}"
    group.write_bytes(b"")
    os.utime(group, (built + 20, built + 20))
    assert _stale_sources(package) == []
