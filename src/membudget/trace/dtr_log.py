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

from membudget.errors import TraceError
from membudget.trace.format import (
    CALL,
    COPY,
    COPY_FROM,
    PHASE,
    PUT,
    RELEASE,
    Event,
    Trace,
    _open_text,
    resolve_member,
    split_source,
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
        self.f = _open_text(path, "r")
        self.line = 0

    def next(self) -> tuple[int, dict[str, Any]] | None:
        for raw in self.f:
            self.line += 1
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise TraceError(self.path, self.line, f"malformed JSON ({e.msg})") from None
            if not isinstance(obj, dict) or obj.get("INSTRUCTION") not in _INSTRUCTIONS:
                raise TraceError(self.path, self.line,
                                 f"not a DTR log record: {raw.strip()[:80]!r}")
            return self.line, obj
        return None

    def expect(self, instruction: str, name: str) -> dict[str, Any]:
        rec = self.next()
        if rec is None:
            raise TraceError(self.path, self.line + 1,
                             f"log ends where {instruction} for {name!r} was expected")
        line, obj = rec
        if obj["INSTRUCTION"] != instruction or obj.get("NAME") != name:
            raise TraceError(self.path, line, f"expected {instruction} for {name!r}, got "
                                              f"{obj['INSTRUCTION']} for {obj.get('NAME')!r}")
        return obj


def _field(obj: dict, key: str, path: object, line: int) -> Any:
    try:
        return obj[key]
    except KeyError:
        raise TraceError(path, line, f"{obj['INSTRUCTION']} record lacks {key!r}") from None


def iter_dtr_log(path: str | Path) -> Iterator[Event]:
    """Stream a DTR log as membudget trace events."""
    lines = _Lines(path)
    ids: dict[str, int] = {}
    known: set[str] = set()

    def tid(name: object, line: int, new: bool = False) -> int:
        if not isinstance(name, str):
            raise TraceError(path, line, f"tensor name must be a string, got {name!r}")
        if not new and name not in known:
            raise TraceError(path, line, f"tensor {name!r} is used before it is defined")
        known.add(name)
        i = ids.get(name)
        if i is None:
            i = ids[name] = len(ids) + 1
        return i

    def number(value: object, what: str, line: int) -> int:
        try:
            n = int(value)  # the logs store sizes and times as strings of digits
        except (TypeError, ValueError):
            raise TraceError(path, line, f"{what} must be an integer, got {value!r}") from None
        if n < 0:
            raise TraceError(path, line, f"{what} must be >= 0, got {n}")
        return n

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
                args = [tid(a, line) for a in _field(o, "ARGS", path, line)]
                results = _field(o, "RESULT", path, line)
                outs, nbytes, alias = [], [], []
                for r in results:
                    mem = number(lines.expect("MEMORY", r)["MEMORY"], "MEMORY", lines.line)
                    a = _alias(lines.expect("ALIAS", r)["ALIAS"], path, lines.line)
                    if a >= len(args):
                        raise TraceError(path, lines.line, f"ALIAS {a} of {r!r} is not an "
                                                           f"argument index (< {len(args)})")
                    outs.append(tid(r, line, new=True))
                    nbytes.append(0 if a >= 0 else mem)
                    alias.append(a)
                cost = number(_field(o, "TIME", path, line), "TIME", line)
                yield (CALL, line, o["NAME"], tuple(args), tuple(outs), tuple(nbytes),
                       tuple(alias), float(cost), ())
            elif ins == "MUTATE":
                args = [tid(a, line) for a in _field(o, "ARGS", path, line)]
                mut = tuple(number(m, "MUTATE index", line) for m in _field(o, "MUTATE", path,
                                                                            line))
                if any(m >= len(args) for m in mut):
                    raise TraceError(path, line, f"MUTATE index out of range in {list(mut)}")
                cost = number(_field(o, "TIME", path, line), "TIME", line)
                yield (CALL, line, o["NAME"], tuple(args), (), (), (), float(cost), mut)
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
                name = _field(o, "NAME", path, line)
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
    return Trace(header, list(iter_dtr_log(path)), str(path))


def _batch(name: str) -> int | None:
    parts = name.split("-")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def _alias(value: object, path: object, line: int) -> int:
    try:
        a = int(value)
    except (TypeError, ValueError):
        raise TraceError(path, line, f"ALIAS must be an integer, got {value!r}") from None
    if a < -1:
        raise TraceError(path, line, f"ALIAS must be -1 or an argument index, got {a}")
    return a
