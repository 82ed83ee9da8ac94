"""MiniMalloc's CSV format: header ``id,lower,upper,size`` (+ ``offset`` in solutions).

Each row is a buffer live on the half-open interval ``[lower, upper)``; a solution adds the
buffer's ``offset`` in the arena. Errors name the file and line.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from membudget.errors import TraceError, excerpt
from membudget.inputs import CORRUPT, check_utf8, int64, open_text
from membudget.outputs import replacing
from membudget.plan.problem import Buffer, PlanError, Problem

REQUIRED = ("id", "lower", "upper", "size")
OPTIONAL = ("offset",)


def read_csv(path: str | Path) -> Problem:
    """Read a problem (or a solution, when it has an ``offset`` column) from a CSV file.

    An empty ``offset`` cell leaves that buffer without an offset.
    """
    with open_text(path, encoding="utf-8-sig") as f:
        lines = _Lines(f, path)
        try:
            return _read(csv.reader(lines), path)
        except csv.Error as e:
            raise TraceError(path, lines.line, f"malformed CSV: {e}") from None
        except CORRUPT as e:
            raise TraceError(path, lines.line + 1, f"cannot read: {e}") from None


class _Lines:
    """A text file's lines, each checked to be UTF-8; ``line`` counts those read."""

    def __init__(self, f: Iterator[str], path: object) -> None:
        self.f, self.path, self.line = f, path, 0

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        raw = next(self.f)
        self.line += 1
        check_utf8(raw, self.path, self.line)
        return raw


def _read(rows: Any, path: object) -> Problem:
    header = [h.strip() for h in next(rows, [])]
    if not any(header):
        raise TraceError(path, 1, "empty file; expected the header id,lower,upper,size")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise TraceError(path, 1, f"missing column(s) {', '.join(missing)}; the header must "
                                  "contain id,lower,upper,size (and optionally offset)")
    unknown = [c for c in header if c not in REQUIRED + OPTIONAL]
    if unknown:
        raise TraceError(path, 1, f"unsupported column(s) {excerpt(', '.join(unknown))}")
    if len(set(header)) != len(header):
        raise TraceError(path, 1, "a column appears twice in the header")
    col = {name: i for i, name in enumerate(header)}
    buffers: list[Buffer] = []
    first_line: dict[str, int] = {}
    for row in rows:
        line = rows.line_num
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise TraceError(path, line, f"malformed row: {len(row)} fields, expected "
                                         f"{len(header)} ({','.join(header)})")
        cells = {name: row[i].strip() for name, i in col.items()}
        bid = cells["id"]
        if not bid:
            raise TraceError(path, line, "malformed row: empty id")
        lower, upper, size = (_int(cells[c], c, path, line) for c in ("lower", "upper", "size"))
        offset = _int(cells["offset"], "offset", path, line) if cells.get("offset") else None
        if size <= 0:
            raise TraceError(path, line, f"buffer {excerpt(bid)} has size {size}; sizes must "
                                         "be positive (drop buffers of size 0: they take no "
                                         "memory)")
        if lower >= upper:
            raise TraceError(path, line, f"buffer {excerpt(bid)} has an empty lifetime: lower "
                                         f"{lower} >= upper {upper} (lifetimes are [lower, "
                                         "upper))")
        if bid in first_line:
            raise TraceError(path, line, f"duplicate buffer id {excerpt(bid)} (first on line "
                                         f"{first_line[bid]})")
        first_line[bid] = line
        buffers.append(Buffer(bid, lower, upper, size, offset))
    return Problem(tuple(buffers))


def _int(cell: str, column: str, path: object, line: int) -> int:
    """A cell holding an integer within int64."""
    n = int64(cell)
    if n is not None:
        return n
    raise TraceError(path, line, f"column {column!r} is not an integer within int64: "
                                 f"{excerpt(cell)}")


def write_csv(path: str | Path, problem: Problem) -> None:
    """Write a problem; with an ``offset`` column when its buffers carry offsets (all must)."""
    placed = [b.offset is not None for b in problem.buffers]
    with_offsets = any(placed)
    if with_offsets and not all(placed):
        unplaced = [b.id for b in problem.buffers if b.offset is None]
        raise PlanError(f"{len(unplaced)} buffer(s) have no offset, e.g. {unplaced[0]!r}")
    with replacing(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(REQUIRED + OPTIONAL if with_offsets else REQUIRED)
        for b in problem.buffers:
            row = [b.id, b.lower, b.upper, b.size]
            w.writerow([*row, b.offset] if with_offsets else row)
