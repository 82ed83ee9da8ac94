"""The program's references to engine tensors: which wrappers it holds, and their releases.

Each engine tensor an op hands the program has one wrapper (a :class:`RematTensor`); while
the wrapper lives the tensor holds one program reference, and when it dies its :class:`Ref`
releases it. Engine work is never re-entered: a wrapper that dies while the engine is busy
(the garbage collector can free one in the middle of an op) joins a queue that is released
as soon as that work ends.
"""

from __future__ import annotations

import weakref

from membudget.core.engine import Engine
from membudget.core.records import Tensor
from membudget.runtime.recording import NotRecording, Recording
from membudget.runtime.tensor import RematTensor


class References:
    """``held`` maps each engine tensor the program holds to (a weak reference to) its
    wrapper; ``busy`` is set while engine work is under way, and ``pending`` holds the
    releases that wait for it to end."""

    def __init__(self, engine: Engine, recording: Recording | NotRecording) -> None:
        self.engine = engine
        self.recording = recording
        self.held: dict[Tensor, weakref.ref[RematTensor]] = {}
        self.pending: list[Tensor] = []
        self.busy = False

    def release(self, handle: Tensor) -> None:
        """A wrapper died: drop its reference (after the engine work under way, if any)."""
        try:
            del self.held[handle]
        except KeyError:  # already released: handed out as the session ended (or failed)
            return
        if self.busy:
            self.pending.append(handle)
            return
        self.busy = True
        try:
            rec = self.recording
            if rec.active:
                rec.release(handle)
            self.engine.release(handle)
        finally:
            self.busy = False
        if self.pending:
            self.drain()

    def drain(self) -> None:
        """Release what is pending (unless engine work is under way: it drains after)."""
        if self.busy:
            return
        pending, eng = self.pending, self.engine
        self.busy = True
        try:
            while pending:
                h = pending.pop()
                self.recording.release(h)
                eng.release(h)
        finally:
            self.busy = False

    def move(self, old: Tensor, new: Tensor) -> None:
        """The wrapper of ``old`` now stands for ``new`` (a write made a new version of it),
        and ``old`` loses that reference at once, before anything queued meanwhile (as the
        trace format's rebinding does)."""
        self.rebind(old, new)
        self.recording.release(old)
        self.engine.release(old)

    def rebind(self, old: Tensor, new: Tensor) -> None:
        """The wrapper of ``old`` (whose reference was released already) stands for ``new``."""
        wrapper_of = self.held.pop(old)
        wrapper = wrapper_of()
        if wrapper is not None:
            wrapper._ref.handle = new
        self.held[new] = wrapper_of

    def swap(self, a: RematTensor, b: RematTensor) -> None:
        """Wrappers ``a`` and ``b`` exchange the engine tensors they stand for (and the
        references that release them when they die)."""
        a._ref, b._ref = b._ref, a._ref
        for w in (a, b):
            h = w._ref.handle
            if h is not None and h in self.held:
                self.held[h] = weakref.ref(w)

    def wrappers(self) -> list[tuple[Tensor, RematTensor]]:
        """Every held tensor whose wrapper is alive, with that wrapper."""
        alive = []
        for h, wrapper_of in list(self.held.items()):
            w = wrapper_of()
            if w is not None:
                alive.append((h, w))
        return alive
