"""Trace format v1: a header line, then one JSON object per command (see docs/trace-format.md).

In memory an event is a tuple whose first two fields are its kind and its source line, so the
replay loop dispatches on ``ev[0]`` and any error can name the line it came from.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from membudget.errors import TraceError, excerpt
from membudget.inputs import (
    CORRUPT,
    INT64_MAX,
    check_utf8,
    open_text,
    split_source,
)
from membudget.outputs import replacing

FORMAT_KEY = "membudget_trace"
VERSION = 1

# Event kinds. Layouts (after kind and line):
PUT = "put"  # tid, nbytes, kind
CALL = "call"  # op, inputs, outputs, out_bytes, out_alias, cost, mutated
COPY = "copy"  # src, dst: dst is a new handle to src's tensor
COPY_FROM = "copy_from"  # src, dst: dst now refers to src's tensor (its old value is released)
RELEASE = "release"  # tid
GET = "get"  # tid: the program reads the value
PIN = "pin"  # tid, overwrite: never evict its storage from now on (see docs/trace-format.md)
PHASE = "phase"  # name: a marker such as "backward"

Event = tuple


@dataclass
class Trace:
    """A whole trace in memory: its header and its events."""

    header: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    path: str = "<memory>"

    @property
    def name(self) -> str:
        return str(self.header.get("model") or Path(split_source(self.path)[1] or self.path).name)


def first_record(path: str | Path) -> dict[str, Any] | None:
    """The first JSON object of a file (plain or gzip), or None if it has none or is not JSON."""
    with open_text(path) as f:  # (the reader names bad bytes)
        try:
            line = next((raw for raw in f if raw.strip()), None)
        except CORRUPT as e:
            raise TraceError(path, 1, f"truncated or corrupt file: {e}") from None
    if line is None:
        return None
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def json_error(e: Exception) -> str:
    """What ``json.loads`` objected to, in a few words."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return getattr(e, "msg", None) or excerpt(str(e))


# ---------------------------------------------------------------------------------- writing
def event_to_json(ev: Event) -> dict[str, Any]:
    """The JSON object of one in-memory event."""
    kind = ev[0]
    if kind == CALL:
        _, _, op, ins, outs, nbytes, alias, cost, mut = ev
        obj: dict[str, Any] = {"ev": CALL, "op": op, "in": list(ins), "out": list(outs),
                               "bytes": list(nbytes), "cost": cost}
        if any(a >= 0 for a in alias):
            obj["alias"] = list(alias)
        if mut:
            obj["mut"] = list(mut)
        return obj
    if kind == PUT:
        return {"ev": PUT, "t": ev[2], "bytes": ev[3], "kind": ev[4]}
    if kind in (COPY, COPY_FROM):
        return {"ev": kind, "src": ev[2], "t": ev[3]}
    if kind in (RELEASE, GET):
        return {"ev": kind, "t": ev[2]}
    if kind == PIN:
        return {"ev": PIN, "t": ev[2], "overwrite": True} if ev[3] else {"ev": PIN, "t": ev[2]}
    if kind == PHASE:
        return {"ev": PHASE, "name": ev[2]}
    raise ValueError(f"unknown event kind {kind!r}")


def write_trace(path: str | Path, header: dict[str, Any], events: Iterable[Event]) -> int:
    """Write a trace (gzip if ``path`` ends in .gz), whole or not at all (``replacing``);
    return the number of events written."""
    head = {FORMAT_KEY: VERSION, **{k: v for k, v in header.items() if k != FORMAT_KEY}}
    n = 0
    with replacing(path) as tmp, _open_write(tmp, gz=Path(path).suffix == ".gz") as f:
        f.write(json.dumps(head) + "\n")
        for ev in events:
            f.write(json.dumps(event_to_json(ev), separators=(",", ":")) + "\n")
            n += 1
    return n


def _open_write(path: Path, gz: bool) -> IO[str]:
    if gz:
        return io.TextIOWrapper(gzip.open(path, "wb"), encoding="utf-8")
    return open(path, "w", encoding="utf-8")


# ---------------------------------------------------------------------------------- reading
def _ids(obj: dict, key: str, path: object, line: int, required: bool = True) -> tuple:
    v = obj.get(key)
    if v is None and not required:
        return ()
    if not isinstance(v, list) or not all(type(x) is int and abs(x) <= INT64_MAX for x in v):
        raise TraceError(path, line, f"field {key!r} must be a list of integers within "
                                     f"int64, got {excerpt(v)}")
    return tuple(v)


def _int(obj: dict, key: str, path: object, line: int) -> int:
    v = obj.get(key)
    if type(v) is not int or abs(v) > INT64_MAX:
        raise TraceError(path, line, f"field {key!r} must be an integer within int64, got "
                                     f"{excerpt(v)}")
    return v


def parse_event(obj: Any, path: object, line: int) -> Event:
    """Validate one JSON object of a v1 trace and turn it into an event tuple."""
    if not isinstance(obj, dict):
        raise TraceError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    kind = obj.get("ev")
    if kind == CALL:
        ins = _ids(obj, "in", path, line)
        outs = _ids(obj, "out", path, line)
        nbytes = _ids(obj, "bytes", path, line)
        alias = _ids(obj, "alias", path, line, required=False) or (-1,) * len(outs)
        mut = _ids(obj, "mut", path, line, required=False)
        if not (len(outs) == len(nbytes) == len(alias)):
            raise TraceError(path, line, "'out', 'bytes' and 'alias' must have equal lengths")
        if any(b < 0 for b in nbytes):
            raise TraceError(path, line, f"negative byte size in {list(nbytes)}")
        if any(not -1 <= a < len(ins) for a in alias) or any(not 0 <= m < len(ins) for m in mut):
            raise TraceError(path, line, "'alias'/'mut' index out of range of 'in'")
        cost = obj.get("cost")
        if (not isinstance(cost, (int, float)) or isinstance(cost, bool)
                or not 0 <= cost < math.inf):
            raise TraceError(path, line, f"field 'cost' must be a finite number >= 0, got "
                                         f"{excerpt(cost)}")
        op = obj.get("op")
        if not isinstance(op, str):
            raise TraceError(path, line, f"field 'op' must be a string, got {excerpt(op)}")
        return (CALL, line, op, ins, outs, nbytes, alias, float(cost), mut)
    if kind in (RELEASE, GET):
        return (kind, line, _int(obj, "t", path, line))
    if kind == PIN:
        overwrite = obj.get("overwrite", False)
        if not isinstance(overwrite, bool):
            raise TraceError(path, line, f"field 'overwrite' must be true or false, got "
                                         f"{excerpt(overwrite)}")
        return (PIN, line, _int(obj, "t", path, line), overwrite)
    if kind in (COPY, COPY_FROM):
        return (kind, line, _int(obj, "src", path, line), _int(obj, "t", path, line))
    if kind == PUT:
        nbytes = _int(obj, "bytes", path, line)
        if nbytes < 0:
            raise TraceError(path, line, f"negative byte size {nbytes}")
        return (PUT, line, _int(obj, "t", path, line), nbytes, str(obj.get("kind", "leaf")))
    if kind == PHASE:
        return (PHASE, line, str(obj.get("name", "")))
    raise TraceError(path, line, f"unknown event {excerpt(kind)}; expected one of "
                                 f"{[PUT, CALL, COPY, COPY_FROM, RELEASE, GET, PIN, PHASE]}")


def checked(events: Iterable[Event], path: object) -> Iterator[Event]:
    """``events``, checked to use and bind ids as every consumer reads them: an id used must
    be live, and an event may bind only an id that is not (``copy_from`` alone rebinds one,
    releasing its old value). A rebound live id would leave its old value held in a replay
    but dropped in a plan's graph, so such a trace is refused with its line."""
    live: dict[int, int] = {}  # id -> the line that bound it

    def use(t: int, line: int) -> None:
        if t not in live:
            raise TraceError(path, line, f"tensor {t} is not live here (never defined, or "
                                         "already released)")

    def bind(t: int, line: int) -> None:
        if t in live:
            where = "on this line" if live[t] == line else f"on line {live[t]}"
            raise TraceError(path, line, f"tensor {t} is bound again while live (bound "
                                         f"{where}); release it first, or rebind it with "
                                         "copy_from")
        live[t] = line

    for ev in events:
        kind, line = ev[0], ev[1]
        if kind == CALL:
            for t in ev[3]:
                use(t, line)
            for t in ev[4]:
                bind(t, line)
        elif kind == PUT:
            bind(ev[2], line)
        elif kind == COPY:
            use(ev[2], line)
            bind(ev[3], line)
        elif kind == COPY_FROM:
            use(ev[2], line)
            live[ev[3]] = line
        elif kind == RELEASE:
            use(ev[2], line)
            del live[ev[2]]
        elif kind in (GET, PIN):
            use(ev[2], line)
        yield ev


def iter_trace(path: str | Path) -> tuple[dict[str, Any], Iterator[Event]]:
    """Open a v1 trace for streaming: its header, and an iterator over its events."""
    f = open_text(path)  # bad bytes: named with their line
    line_no = 0
    try:
        try:
            for raw in f:
                line_no += 1
                if raw.strip():
                    check_utf8(raw, path, line_no)
                    break
            else:
                raise TraceError(path, None, "empty file: no trace header")
        except CORRUPT as e:
            raise TraceError(path, line_no + 1, f"truncated or corrupt file: {e}") from None
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as e:  # (too deep, or a 5,000-digit number)
            raise TraceError(path, line_no, f"header is not JSON: {json_error(e)}") from None
        if not isinstance(header, dict) or header.get(FORMAT_KEY) != VERSION:
            raise TraceError(path, line_no, f"not a membudget trace v{VERSION} header "
                                            f"(expected {{\"{FORMAT_KEY}\": {VERSION}, ...}})")
    except BaseException:
        f.close()
        raise

    def events(start: int = line_no) -> Iterator[Event]:
        line = start
        with f:
            try:
                for raw in f:
                    line += 1
                    if not raw.strip():
                        continue
                    check_utf8(raw, path, line)
                    try:
                        obj = json.loads(raw)
                    except (ValueError, RecursionError) as e:
                        raise TraceError(path, line,
                                         f"malformed JSON ({json_error(e)})") from None
                    yield parse_event(obj, path, line)
            except CORRUPT as e:
                raise TraceError(path, line + 1, f"truncated or corrupt file: {e}") from None

    return header, checked(events(), path)


def read_trace(path: str | Path) -> Trace:
    """Load a v1 trace into memory."""
    header, events = iter_trace(path)
    return Trace(header, list(events), str(path))
