"""Traces: the v1 format, its reader and writer, importers, and generated example traces."""

from __future__ import annotations

from pathlib import Path

from membudget.errors import TraceError
from membudget.inputs import ZIP_SEP, split_source, zip_members
from membudget.trace.dtr_log import is_dtr_log, read_dtr_log
from membudget.trace.format import Trace, first_record, read_trace, write_trace


def load_trace(path: str | Path) -> Trace:
    """Load a membudget trace or a DTR log (``archive.zip::member`` reads inside a zip),
    telling them apart by their first record."""
    if is_dtr_log(first_record(path)):
        return read_dtr_log(path)
    return read_trace(path)


def expand_sources(paths: list[str]) -> list[str]:
    """Expand each zip archive given without a member into its ``.log``, ``.jsonl`` and
    ``.jsonl.gz`` members; other paths are kept as they are."""
    out: list[str] = []
    for p in paths:
        archive, member = split_source(p)
        if member is None and archive.suffix == ".zip":
            names = [n for n in zip_members(archive)
                     if n.endswith((".log", ".jsonl", ".jsonl.gz"))]
            if not names:
                raise TraceError(archive, None, "holds no trace (no .log, .jsonl or "
                                                ".jsonl.gz member)")
            out += [f"{archive}{ZIP_SEP}{n}" for n in sorted(names)]
        else:
            out.append(p)
    return out


__all__ = ["Trace", "expand_sources", "load_trace", "read_dtr_log", "read_trace",
           "write_trace"]
