"""Trace format v1: a header line, then one JSON object per command (see docs/trace-format.md).

In memory an event is a tuple whose first two fields are its kind and its source line, so the
replay loop dispatches on ``ev[0]`` and any error can name the line it came from.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from membudget.errors import TraceError
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


ZIP_SEP = "::"
# What reading a truncated or corrupt gzip stream raises.
_CORRUPT = (EOFError, OSError, zlib.error, UnicodeDecodeError)
INT64_MAX = (1 << 63) - 1  # sizes and ids beyond it cannot be counted or replayed


def _check_utf8(raw: str, path: object, line: int) -> None:
    """A line read with ``surrogateescape`` holds lone surrogates where its bytes were not
    UTF-8: name the line (an ASCII line, nearly every one, costs one check)."""
    if not raw.isascii():
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TraceError(path, line, f"not UTF-8 text (at character {e.start})") from None


def _json_error(e: Exception) -> str:
    """What ``json.loads`` objected to, in a few words."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return getattr(e, "msg", None) or _excerpt(str(e))


def _excerpt(v: object, limit: int = 60) -> str:
    """``repr(v)``, cut to ``limit`` characters: a message quotes a field, never all of it."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r):,} characters)"


def split_source(path: str | Path) -> tuple[Path, str | None]:
    """Split ``archive.zip::member`` into the archive and the member (None for a plain file)."""
    text = str(path)
    if ZIP_SEP in text:
        archive, member = text.split(ZIP_SEP, 1)
        return Path(archive), member
    return Path(text), None


def zip_members(archive: str | Path, suffix: str = "") -> list[str]:
    """Names of the files in a zip archive that end with ``suffix``."""
    with zipfile.ZipFile(archive) as z:
        return [n for n in z.namelist() if not n.endswith("/") and n.endswith(suffix)]


def resolve_member(archive: Path, member: str) -> str:
    """The archive member called ``member``, or the one file whose base name starts with it."""
    names = zip_members(archive)
    if member in names:
        return member
    hits = [n for n in names if n.rsplit("/", 1)[-1].startswith(member)]
    if len(hits) != 1:
        raise TraceError(f"{archive}{ZIP_SEP}{member}", None,
                         f"{'no' if not hits else 'several'} archive members match; members: "
                         f"{', '.join(n.rsplit('/', 1)[-1] for n in names)}")
    return hits[0]


def _open_text(path: str | Path, mode: str, errors: str = "strict") -> IO[str]:
    """Open a trace file for text: plain or gzip, or (to read) a member of a zip archive;
    ``errors`` as for :func:`open` (the trace reader checks each line itself)."""
    archive, member = split_source(path)
    if member is not None:
        if mode != "r":
            raise ValueError("cannot write into a zip archive")
        if not archive.is_file():
            raise TraceError(archive, None, "no such file")
        z = zipfile.ZipFile(archive)
        raw = z.open(resolve_member(archive, member))
        if raw.peek(2)[:2] == b"\x1f\x8b":
            raw = gzip.GzipFile(fileobj=raw)
        return io.TextIOWrapper(raw, encoding="utf-8", errors=errors)
    if mode == "r":
        if archive.is_dir():
            raise TraceError(archive, None, "is a directory, not a trace file")
        if not archive.is_file():
            raise TraceError(archive, None, "no such file")
        with open(archive, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        if gz:
            return io.TextIOWrapper(gzip.open(archive, "rb"), encoding="utf-8", errors=errors)
        return open(archive, encoding="utf-8", errors=errors)
    if archive.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(archive, "wb"), encoding="utf-8")
    return open(archive, "w", encoding="utf-8")


def first_record(path: str | Path) -> dict[str, Any] | None:
    """The first JSON object of a file (plain or gzip), or None if it has none or is not JSON."""
    with _open_text(path, "r", errors="surrogateescape") as f:  # (the reader names bad bytes)
        try:
            line = next((raw for raw in f if raw.strip()), None)
        except _CORRUPT as e:
            raise TraceError(path, 1, f"truncated or corrupt file: {e}") from None
    if line is None:
        return None
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


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
    with replacing(path) as tmp, _open_text(tmp, "w") as f:
        f.write(json.dumps(head) + "\n")
        for ev in events:
            f.write(json.dumps(event_to_json(ev), separators=(",", ":")) + "\n")
            n += 1
    return n


# ---------------------------------------------------------------------------------- reading
def _ids(obj: dict, key: str, path: object, line: int, required: bool = True) -> tuple:
    v = obj.get(key)
    if v is None and not required:
        return ()
    if not isinstance(v, list) or not all(type(x) is int and abs(x) <= INT64_MAX for x in v):
        raise TraceError(path, line, f"field {key!r} must be a list of integers within "
                                     f"int64, got {_excerpt(v)}")
    return tuple(v)


def _int(obj: dict, key: str, path: object, line: int) -> int:
    v = obj.get(key)
    if type(v) is not int or abs(v) > INT64_MAX:
        raise TraceError(path, line, f"field {key!r} must be an integer within int64, got "
                                     f"{_excerpt(v)}")
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
                                         f"{_excerpt(cost)}")
        op = obj.get("op")
        if not isinstance(op, str):
            raise TraceError(path, line, f"field 'op' must be a string, got {_excerpt(op)}")
        return (CALL, line, op, ins, outs, nbytes, alias, float(cost), mut)
    if kind in (RELEASE, GET):
        return (kind, line, _int(obj, "t", path, line))
    if kind == PIN:
        overwrite = obj.get("overwrite", False)
        if not isinstance(overwrite, bool):
            raise TraceError(path, line, f"field 'overwrite' must be true or false, got "
                                         f"{_excerpt(overwrite)}")
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
    raise TraceError(path, line, f"unknown event {_excerpt(kind)}; expected one of "
                                 f"{[PUT, CALL, COPY, COPY_FROM, RELEASE, GET, PIN, PHASE]}")


def iter_trace(path: str | Path) -> tuple[dict[str, Any], Iterator[Event]]:
    """Open a v1 trace for streaming: its header, and an iterator over its events."""
    f = _open_text(path, "r", errors="surrogateescape")  # bad bytes: named with their line
    line_no = 0
    try:
        try:
            for raw in f:
                line_no += 1
                if raw.strip():
                    _check_utf8(raw, path, line_no)
                    break
            else:
                raise TraceError(path, None, "empty file: no trace header")
        except _CORRUPT as e:
            raise TraceError(path, line_no + 1, f"truncated or corrupt file: {e}") from None
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as e:  # (too deep, or a 5,000-digit number)
            raise TraceError(path, line_no, f"header is not JSON: {_json_error(e)}") from None
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
                    _check_utf8(raw, path, line)
                    try:
                        obj = json.loads(raw)
                    except (ValueError, RecursionError) as e:
                        raise TraceError(path, line,
                                         f"malformed JSON ({_json_error(e)})") from None
                    yield parse_event(obj, path, line)
            except _CORRUPT as e:
                raise TraceError(path, line + 1, f"truncated or corrupt file: {e}") from None

    return header, events()


def read_trace(path: str | Path) -> Trace:
    """Load a v1 trace into memory."""
    header, events = iter_trace(path)
    return Trace(header, list(events), str(path))
