"""MiniMalloc's CSV format: header ``id,lower,upper,size`` (+ ``offset`` in solutions).

Each row is a buffer live on the half-open interval ``[lower, upper)``; a solution adds the
buffer's ``offset`` in the arena. Errors name the file and line.
"""

from __future__ import annotations

import csv
from pathlib import Path

from membudget.errors import TraceError
from membudget.outputs import replacing
from membudget.plan.problem import Buffer, PlanError, Problem

REQUIRED = ("id", "lower", "upper", "size")
OPTIONAL = ("offset",)


def read_csv(path: str | Path) -> Problem:
    """Read a problem (or a solution, when it has an ``offset`` column) from a CSV file.

    An empty ``offset`` cell leaves that buffer without an offset.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise TraceError(path, None, f"cannot read: {e.strerror}") from None
    rows = csv.reader(text.splitlines())
    header = [h.strip() for h in next(rows, [])]
    if not any(header):
        raise TraceError(path, 1, "empty file; expected the header id,lower,upper,size")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise TraceError(path, 1, f"missing column(s) {', '.join(missing)}; the header must "
                                  "contain id,lower,upper,size (and optionally offset)")
    unknown = [c for c in header if c not in REQUIRED + OPTIONAL]
    if unknown:
        raise TraceError(path, 1, f"unsupported column(s) {', '.join(unknown)}")
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
        try:
            lower, upper, size = (int(cells[c]) for c in ("lower", "upper", "size"))
            offset = int(cells["offset"]) if cells.get("offset") else None
        except ValueError:
            raise TraceError(path, line, f"malformed row: {','.join(row)!r} has a field that "
                                         "is not an integer") from None
        if size <= 0:
            raise TraceError(path, line, f"buffer {bid!r} has size {size}; sizes must be "
                                         "positive (drop buffers of size 0: they take no "
                                         "memory)")
        if lower >= upper:
            raise TraceError(path, line, f"buffer {bid!r} has an empty lifetime: lower "
                                         f"{lower} >= upper {upper} (lifetimes are [lower, "
                                         "upper))")
        if bid in first_line:
            raise TraceError(path, line, f"duplicate buffer id {bid!r} (first on line "
                                         f"{first_line[bid]})")
        first_line[bid] = line
        buffers.append(Buffer(bid, lower, upper, size, offset))
    return Problem(tuple(buffers))


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
