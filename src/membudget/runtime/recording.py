"""The trace of a live session: the engine commands it issued, in our trace format.

Replaying it in the simulator with the same policy, allocator and budget repeats the run's
decisions (same evictions, same recomputations), since the engine sees the same commands
with the same sizes and costs. Tensor ids are the engine's, except that a new version made
by an in-place op keeps the id of the tensor it replaced (the format rebinds that handle).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from membudget.core.records import Tensor
from membudget.trace.format import (
    CALL,
    GET,
    PHASE,
    PIN,
    PUT,
    RELEASE,
    Event,
    Trace,
    write_trace,
)

_RAW_CALL = object()  # a call not yet turned into a trace event


class Recording:
    """Events of one session, appended as the session issues engine commands (kept raw,
    with the engine's records, and turned into trace events only when written)."""

    active = True

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ops: list[Any] = []  # the op of each call event, in order (an OpCall, live)
        self._tid: dict[int, int] = {}
        self._implicit: set[int] = set()  # old versions the format releases by itself

    def tid(self, h: Tensor) -> int:
        return self._tid.get(h.id, h.id)

    def put(self, h: Tensor, kind: str) -> None:
        self.events.append((PUT, None, h.id, h.storage.nbytes, kind))

    def call(self, op: object, inputs: Sequence[Tensor], outputs: Sequence[Tensor],
             cost: float) -> None:
        self.events.append((_RAW_CALL, op, inputs, outputs, cost))
        self.ops.append(op)

    def _call_event(self, op: object, inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                    cost: float) -> Event:
        out_bytes, out_alias = [], []
        for h in outputs:
            k = next((k for k, t in enumerate(inputs) if t.storage is h.storage), -1) \
                if h.alias else -1
            out_alias.append(k)
            out_bytes.append(0 if k >= 0 else h.storage.nbytes)
        return (CALL, None, str(op), tuple(self.tid(t) for t in inputs),
                tuple(h.id for h in outputs), tuple(out_bytes), tuple(out_alias), cost, ())

    def mutation(self, op: object, inputs: Sequence[Tensor], mutated: Sequence[int],
                 versions: Sequence[Tensor], cost: float) -> None:
        """An op that wrote ``inputs[i]`` for each i in ``mutated``, making ``versions``."""
        self.events.append((CALL, None, str(op), tuple(self.tid(t) for t in inputs), (), (), (),
                            cost, tuple(mutated)))
        self.ops.append(op)
        for i, new in zip(mutated, versions, strict=True):
            old = inputs[i]
            self._tid[new.id] = self.tid(old)
            self._implicit.add(old.id)

    def release(self, h: Tensor) -> None:
        i = h.id
        if i in self._implicit:
            self._implicit.discard(i)
            return
        self.events.append((RELEASE, None, self._tid.get(i, i)))

    def get(self, h: Tensor) -> None:
        self.events.append((GET, None, self.tid(h)))

    def pin(self, h: Tensor, overwrite: bool = False) -> None:
        self.events.append((PIN, None, self.tid(h), overwrite))

    def phase(self, name: str) -> None:
        self.events.append((PHASE, None, name))

    def trace(self, header: dict[str, Any]) -> Trace:
        """The recording as an in-memory trace (its i-th call event ran ``ops[i]``)."""
        return Trace(dict(header), list(self._events()))

    def write(self, path: str | Path, header: dict[str, Any]) -> Path:
        write_trace(path, header, self._events())
        return Path(path)

    def _events(self) -> Iterator[Event]:
        return (self._call_event(*ev[1:]) if ev[0] is _RAW_CALL else ev for ev in self.events)


class NotRecording:
    """The recording of a session that does not record: every event is dropped."""

    active = False

    def put(self, h: Tensor, kind: str) -> None:
        pass

    def call(self, op: object, inputs: Sequence[Tensor], outputs: Sequence[Tensor],
             cost: float) -> None:
        pass

    def mutation(self, op: object, inputs: Sequence[Tensor], mutated: Sequence[int],
                 versions: Sequence[Tensor], cost: float) -> None:
        pass

    def release(self, h: Tensor) -> None:
        pass

    def get(self, h: Tensor) -> None:
        pass

    def pin(self, h: Tensor, overwrite: bool = False) -> None:
        pass

    def phase(self, name: str) -> None:
        pass
