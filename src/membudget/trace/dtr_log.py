"""Import the DTR paper's simulator logs (JSON lines written by its PyTorch prototype).

Follows simrd's parser: everything up to the first ``ANNOTATE START`` is skipped; ``CONSTANT``
+ ``MEMORY`` is a pinned leaf; ``CALL`` is followed by ``MEMORY``/``ALIAS`` per result (an
alias result has no bytes of its own); ``MUTATE`` is an in-place op, replayed copy-on-write
(a new version the size of the whole mutated storage); ``COPY`` adds a handle; ``COPY_FROM``
rebinds one; ``RELEASE`` of a name never defined is ignored; ``TIME`` (ns) is the op's cost.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from membudget.errors import TraceError, excerpt
from membudget.inputs import (
    CORRUPT,
    check_utf8,
    int64,
    open_text,
    resolve_member,
    split_source,
)
from membudget.trace.format import (
    CALL,
    COPY,
    COPY_FROM,
    PHASE,
    PUT,
    RELEASE,
    Event,
    Trace,
    checked,
    json_error,
)

_INSTRUCTIONS = {"CONSTANT", "MEMORY", "CALL", "MUTATE", "COPY", "COPY_FROM", "RELEASE",
                 "ANNOTATE", "ALIAS"}


def is_dtr_log(first: dict[str, Any] | None) -> bool:
    """Whether a file's first JSON object looks like a DTR log record."""
    return bool(first) and first.get("INSTRUCTION") in _INSTRUCTIONS


class _Lines:
    """The log's records with their line numbers, one record of lookahead."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self.f = open_text(path)
        self.line = 0

    def next(self) -> tuple[int, dict[str, Any]] | None:
        try:
            for raw in self.f:
                self.line += 1
                if not raw.strip():
                    continue
                check_utf8(raw, self.path, self.line)
                try:
                    obj = json.loads(raw)
                except (ValueError, RecursionError) as e:
                    raise TraceError(self.path, self.line,
                                     f"malformed JSON ({json_error(e)})") from None
                if not isinstance(obj, dict) or obj.get("INSTRUCTION") not in _INSTRUCTIONS:
                    raise TraceError(self.path, self.line,
                                     f"not a DTR log record: {excerpt(raw.strip(), 80)}")
                return self.line, obj
        except CORRUPT as e:
            raise TraceError(self.path, self.line + 1, f"truncated or corrupt file: {e}") from None
        return None

    def expect(self, instruction: str, name: str) -> dict[str, Any]:
        rec = self.next()
        if rec is None:
            raise TraceError(self.path, self.line + 1,
                             f"log ends where {instruction} for {excerpt(name)} was "
                             "expected")
        line, obj = rec
        if obj["INSTRUCTION"] != instruction or obj.get("NAME") != name:
            raise TraceError(self.path, line, f"expected {instruction} for {excerpt(name)}, "
                                              f"got {obj['INSTRUCTION']} for "
                                              f"{excerpt(obj.get('NAME'))}")
        return obj


def _field(obj: dict, key: str, path: object, line: int, kind: type = object) -> Any:
    """``obj[key]``, which must be a ``kind``; else an error naming the record's line."""
    try:
        v = obj[key]
    except KeyError:
        raise TraceError(path, line, f"{obj['INSTRUCTION']} record lacks {key!r}") from None
    if not isinstance(v, kind):
        raise TraceError(path, line, f"{obj['INSTRUCTION']} record's {key!r} must be a "
                                     f"{kind.__name__}, got {excerpt(v)}")
    return v


def _name(obj: dict, path: object, line: int) -> str:
    return _field(obj, "NAME", path, line, str)


def iter_dtr_log(path: str | Path) -> Iterator[Event]:
    """Stream a DTR log as membudget trace events."""
    lines = _Lines(path)
    ids: dict[str, int] = {}
    known: set[str] = set()

    def tid(name: object, line: int, new: bool = False) -> int:
        if not isinstance(name, str):
            raise TraceError(path, line, f"tensor name must be a string, got {excerpt(name)}")
        if not new and name not in known:
            raise TraceError(path, line, f"tensor {excerpt(name)} is used before it is "
                                         "defined")
        known.add(name)
        i = ids.get(name)
        if i is None:
            i = ids[name] = len(ids) + 1
        return i

    def number(value: object, what: str, line: int) -> int:
        n = int64(value, signs="")  # the logs store sizes and times as strings of digits
        if n is not None and n >= 0:
            return n
        raise TraceError(path, line, f"{what} must be an integer >= 0 within int64, got "
                                     f"{excerpt(value)}")

    with lines.f:
        while True:  # skip everything up to and including ANNOTATE START
            rec = lines.next()
            if rec is None:
                raise TraceError(path, lines.line, "no ANNOTATE START record: not a DTR log "
                                                   "with a timed iteration")
            if rec[1]["INSTRUCTION"] == "ANNOTATE" and rec[1].get("ANNOTATION") == "START":
                break
        while (rec := lines.next()) is not None:
            line, o = rec
            ins = o["INSTRUCTION"]
            if ins == "CALL":
                args = [tid(a, line) for a in _field(o, "ARGS", path, line, list)]
                results = _field(o, "RESULT", path, line, list)
                outs, nbytes, alias = [], [], []
                for r in results:
                    mem = number(lines.expect("MEMORY", r)["MEMORY"], "MEMORY", lines.line)
                    a = _alias(lines.expect("ALIAS", r)["ALIAS"], path, lines.line)
                    if a >= len(args):
                        raise TraceError(path, lines.line, f"ALIAS {a} of {excerpt(r)} is not "
                                                           f"an argument index "
                                                           f"(< {len(args)})")
                    outs.append(tid(r, line, new=True))
                    nbytes.append(0 if a >= 0 else mem)
                    alias.append(a)
                cost = number(_field(o, "TIME", path, line), "TIME", line)
                yield (CALL, line, _name(o, path, line), tuple(args), tuple(outs),
                       tuple(nbytes), tuple(alias), float(cost), ())
            elif ins == "MUTATE":
                args = [tid(a, line) for a in _field(o, "ARGS", path, line, list)]
                mut = tuple(number(m, "MUTATE index", line) for m in _field(o, "MUTATE", path,
                                                                            line, list))
                if any(m >= len(args) for m in mut):
                    raise TraceError(path, line, f"MUTATE index out of range in {list(mut)}")
                cost = number(_field(o, "TIME", path, line), "TIME", line)
                yield (CALL, line, _name(o, path, line), tuple(args), (), (), (), float(cost),
                       mut)
            elif ins == "CONSTANT":
                name = _field(o, "NAME", path, line)
                mem = number(lines.expect("MEMORY", name)["MEMORY"], "MEMORY", lines.line)
                yield (PUT, line, tid(name, line, new=True), mem, "constant")
            elif ins == "COPY":
                src = tid(_field(o, "SRC", path, line), line)
                yield (COPY, line, src, tid(_field(o, "DST", path, line), line, new=True))
            elif ins == "COPY_FROM":
                src = tid(_field(o, "SRC", path, line), line)
                yield (COPY_FROM, line, src, tid(_field(o, "DST", path, line), line))
            elif ins == "RELEASE":
                name = _name(o, path, line)
                if name in known:
                    yield (RELEASE, line, tid(name, line))
            elif ins == "ANNOTATE":
                if o.get("ANNOTATION") == "BACKWARD":
                    yield (PHASE, line, "backward")
            else:  # a MEMORY or ALIAS record out of place
                raise TraceError(path, line, f"unexpected {ins} record (it must follow its "
                                             "CALL or CONSTANT)")


def read_dtr_log(path: str | Path) -> Trace:
    """Load a DTR log as an in-memory trace."""
    archive, member = split_source(path)
    name = Path(resolve_member(archive, member) if member else archive).name
    header = {"model": name.split("-")[0], "batch": _batch(name), "device": "cuda (Titan V)",
              "device_spec": "titan-v", "cost_unit": "ns", "cost_source": "measured (DTR log TIME)",
              "source": f"dtr-log:{name}"}
    return Trace(header, list(checked(iter_dtr_log(path), path)), str(path))


def _batch(name: str) -> int | None:
    parts = name.split("-")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def _alias(value: object, path: object, line: int) -> int:
    """An ALIAS field: -1 (a result of its own) or the index of the argument it views."""
    a = int64(value, signs="-")
    if a is not None and a >= -1:
        return a
    raise TraceError(path, line, f"ALIAS must be -1 or an argument index, got "
                                 f"{excerpt(value)}")
