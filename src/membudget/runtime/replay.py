"""Replay: a settled planned step run as eager PyTorch runs it, its saved activations dropped.

Once a planned session's steps follow one plan to the end, the engine's work at every op
(sizing, wrapping, accounting) decides nothing new, and it is most of what a session costs
beyond eager PyTorch. A *replay* runs such a step's ops as they are, with no engine, and
saves memory the way checkpointing does: autograd's saved tensors pass through saved-tensor
hooks, and a *dropped* one is let go in the forward pass and recomputed when the backward
first unpacks it, by the recorded ops from the values kept (its *closure*). What makes that
as safe as the engine:

* **The ops are checked against the record.** Every op must be the recorded one, with the
  same input shapes and the same producers of its inputs (parameters by identity, the
  step's values by the op that made them); the ops a recomputation may run must also have
  the same non-tensor arguments (a generator may be another, on the same device: one
  made anew each step). A recomputation reads this step's inputs (the batch) and
  parameters only if they were not written since; it draws the random numbers the first
  run drew, from this step's generators (their states are kept); it runs a write again
  only on memory it made itself (an in-place ReLU on a recomputed batch norm), and batch
  norm without its running statistics (``runtime.classify.UNDECLARED_WRITES``).
* **Memory is forecast, then metered.** The recorded step notes when each value died and
  each saved tensor was unpacked, as eager PyTorch had it; from that, :class:`ReplayPlan`
  forecasts the replay's memory for any set of drops, and :meth:`ReplayPlan.choose` picks
  storages to drop, cheapest to recompute per byte first, until the forecast peak is under
  the budget (less a margin). The replay then counts every storage the step's ops make or
  touch until it is freed (weak references, as :class:`~membudget.bench.meter.StorageMeter`
  does), and the optimizers' state of its parameters from its start, touched or not, as
  the engine counts it (both forecast and meter); a metered peak above the forecast widens
  the margin (:class:`Tuning`).

Before the first op that differs from the record, or whose outputs would take the metered
bytes over the budget, the replay *hands the step over* to the engine: it drops every kept
value a recomputation can make (:meth:`Replay.shed`), every storage still live enters the
session as a pinned leaf, and the rest of the step runs dynamically, within the budget.
"""

from __future__ import annotations

import heapq
import math
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from membudget.errors import MembudgetError
from membudget.runtime.call import (
    RestoredRng,
    below_autograd,
    capture_rng,
    devices_of,
    generators_in,
)
from membudget.runtime.classify import op_info
from membudget.runtime.flat import NO_KWARGS, SEQUENCES, flatten, flatten_result, unflatten
from membudget.runtime.leaves import optimizer_state
from membudget.runtime.tensor import RematTensor, wrap

if TYPE_CHECKING:
    from membudget.runtime.session import Session

_detach = torch.ops.aten.detach.default
# ops that hold no data: the profiler's markers (their arguments are new objects every
# step), prim's metadata queries
_UNRECORDED = frozenset(("profiler", "prim"))
HANDED_OVER_OPS = "the step's ops differ"
HANDED_OVER_FIT = "the plan does not fit"
HANDED_OVER_PARAMS = "the step's parameters are other tensors (another model)"
MAX_CLOSURE = 256  # ops one recomputation may run; a value needing more is kept

Key = tuple[int, int]  # (op index in the step, tensor output index)
Layout = tuple[torch.dtype, torch.Size, tuple[int, ...], int]  # dtype, size, stride, offset


class Src:
    """A tensor argument of a recorded op: a value of the step (``key``), a parameter (by
    identity), or an input of the step, such as the batch, which is another tensor in every
    step (``key`` and ``param`` None); ``shape`` as recorded, and an input's ``stride``
    (the layout of the values made from it follows)."""

    __slots__ = ("key", "param", "shape", "stride")

    def __init__(self, key: Key | None, param: torch.Tensor | None, shape: torch.Size,
                 stride: tuple[int, ...] | None = None) -> None:
        self.key, self.param, self.shape, self.stride = key, param, shape, stride


class Node:
    """One recorded op: its flattened arguments (tensors as :class:`Src`), where its tensor
    outputs sit in its flattened result, whether it can run again, its cost (ns) and the
    bytes of new storage it makes."""

    __slots__ = ("cost", "func", "grad", "leaves", "new_bytes", "outs", "random", "redo",
                 "rerun", "spec", "wrote")

    def __init__(self, func: Any, leaves: list[Any], spec: Any, outs: tuple[int, ...],
                 redo: bool, random: bool, cost: float, new_bytes: int,
                 rerun: list[Any] | None = None, wrote: tuple[int, ...] = ()) -> None:
        self.func, self.leaves, self.spec, self.outs = func, leaves, spec, outs
        self.redo, self.random, self.cost, self.new_bytes = redo, random, cost, new_bytes
        self.rerun = rerun  # the arguments of a recomputation, if not ``leaves``: see
        # runtime.classify.UNDECLARED_WRITES (batch norm's running statistics: None)
        self.wrote = wrote  # the arguments it writes (indices in ``leaves``)
        self.grad = torch.is_grad_enabled()


def _is_param(x: torch.Tensor) -> bool:
    return isinstance(x, torch.nn.Parameter)


# events of a recorded step, in the order they happened (their index is their time): a value
# is LET_GO when the program holds it no more (autograd may), and DIEs when nothing does
OP, DIE, UNPACK, LET_GO = 0, 1, 2, 3


class StepRecorder(TorchDispatchMode):
    """Entered on top of a session for a step being recorded: the ops as the program issues
    them (the session's wrappers for its values), which value each saved tensor is, and when
    each value dies and each saved tensor is unpacked, as eager PyTorch would have it."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[Node] = []
        self.packs: list[Key | None] = []  # the value of each saved tensor, in order
        self.nbytes: dict[Key, int] = {}  # bytes of a value's storage (0: a view)
        self.storage: dict[Key, int] = {}  # an id of the storage each value lives in
        self.layout: dict[Key, Layout] = {}  # each strided value's place in its storage
        self.writes: list[tuple[int, int]] = []  # (op, storage) of each write
        self.events: list[tuple[int, Any]] = []  # (OP, n), (DIE, key), (UNPACK, pack index),
        # (LET_GO, key)
        self.outside: dict[int, tuple[int, int]] = {}  # storage id -> (first event, bytes)
        self.params: list[torch.Tensor] = []  # the parameters its ops read (__exit__)
        self.held: dict[int, int] = {}  # their optimizers' state at the step's end
        self.state_read: set[int] = set()  # those of ``outside`` in it
        self._ids: dict[int, tuple[Key, weakref.ref]] = {}
        self._saved: set[int] = set()  # ids of the objects of values autograd saved
        self._objects: dict[Key, int] = {}  # a value's tensor objects still alive
        self._program: dict[Key, int] = {}  # those of them autograd did not save
        self._rekeyed: list[weakref.ref] = []

    def close(self) -> None:
        """Its record has been read (or will not be): let its weak references go now rather
        than with the recorder (see ``StorageMeter.__exit__``: a crash on Python 3.11)."""
        self._ids.clear()
        self._rekeyed.clear()

    def __exit__(self, *exc: object) -> None:
        """The step ends: note the optimizers' state of its parameters, and which storages
        it read from outside are in it (now, while they are all alive: the id of one that
        dies may become another's), in this thread, which the optimizers run in."""
        super().__exit__(*exc)
        self.params = list({id(s.param): s.param for node in self.nodes for s in node.leaves
                            if type(s) is Src and s.param is not None}.values())
        self.held = held_state(self.params)
        self.state_read = set(self.held).intersection(self.outside)

    def find(self, x: torch.Tensor) -> Key | None:
        hit = self._ids.get(id(x))
        return hit[0] if hit is not None and hit[1]() is x else None

    def _track(self, x: torch.Tensor, key: Key, saved: bool = False) -> None:
        """``x`` holds ``key``: the value dies (an event) when its last such object does, and
        is let go when its last one not ``saved`` for autograd does."""
        objects, program = self._objects, self._program

        def gone(_: object, key: Key = key, saved: bool = saved, i: int = id(x)) -> None:
            if saved:
                self._saved.discard(i)
            else:
                program[key] -= 1
                if program[key] == 0:
                    self.events.append((LET_GO, key))
            left = objects[key] = objects[key] - 1
            if left == 0:
                self.events.append((DIE, key))

        old = self._ids.get(id(x))
        if old is not None and old[1]() is x:  # (written in place: one object, two values)
            self._rekeyed.append(old[1])  # (so that its callback still comes)
        self._ids[id(x)] = (key, weakref.ref(x, gone))
        objects[key] = objects.get(key, 0) + 1
        if saved:
            self._saved.add(id(x))
        else:
            program[key] = program.get(key, 0) + 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or NO_KWARGS
        out = func(*args, **kwargs)
        if func.namespace in _UNRECORDED:
            return out
        if func is _detach:  # (autograd adds some of its own: the same value)
            key = self.find(args[0])
            if key is not None and isinstance(out, torch.Tensor):  # (unpacking, autograd
                # detaches what it saved)
                self._track(out, key, saved=id(args[0]) in self._saved)
            return out
        n = len(self.nodes)
        events = self.events
        events.append((OP, n))
        leaves, spec = flatten(args, kwargs)
        template: list[Any] = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                key = self.find(x)
                if key is None:
                    st = x.untyped_storage()
                    if id(st) not in self.outside:
                        self.outside[id(st)] = (len(events) - 1, st.nbytes())
                param = x if key is None and _is_param(x) else None
                outer = key is None and param is None and x.layout is torch.strided
                template.append(Src(key, param, x.shape, x.stride() if outer else None))
            else:
                template.append(x)
        info = op_info(func)
        written = [t for x in info.written(args, kwargs)
                   for t in (x if isinstance(x, (list, tuple)) else (x,))
                   if isinstance(t, torch.Tensor)]
        targets = {}  # id of each tensor written -> its storage
        for t in written:
            key = self.find(t)
            g = self.storage[key] if key is not None else -id(t.untyped_storage())
            targets[id(t)] = g
            self.writes.append((n, g))
        flat, _ = flatten_result(out)
        outs, new_bytes, cost = [], 0, 0.0
        for j, o in enumerate(flat):
            if not isinstance(o, torch.Tensor):
                continue
            key = (n, len(outs))
            outs.append(j)
            self._track(o, key)
            if o.layout is torch.strided:
                self.layout[key] = (o.dtype, o.shape, o.stride(), o.storage_offset())
            if id(o) in targets:  # (written in place: the memory it had)
                self.storage[key] = targets[id(o)]
                nbytes = 0
            elif type(o) is RematTensor:
                h = o._ref.handle
                nbytes = 0 if h.alias else h.storage.nbytes
                self.storage[key] = h.storage.id
                if h.producer is not None:
                    cost = h.producer.cost
            else:
                nbytes = o.untyped_storage().nbytes()
                self.storage[key] = -id(o.untyped_storage())
            self.nbytes[key] = nbytes
            new_bytes += nbytes
        wrote = tuple(i for i, x in enumerate(leaves) if id(x) in targets)
        rerun = None
        if info.side_effects_only(args, kwargs):
            rerun = [None if i in wrote else s for i, s in enumerate(template)]
            wrote = ()
        # (an op that writes may run again on memory its recomputation makes, save one
        # whose schema hides a write it does now: batch norm in eval mode)
        redo = info.side_effects is None or rerun is not None
        self.nodes.append(Node(func, template, spec, tuple(outs), redo, info.random, cost,
                               new_bytes, rerun, wrote))
        return out

    def pack(self, x: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Autograd saves another wrapper of the value (the same program reference), so
        that the program's letting go of it shows (see :data:`LET_GO`)."""
        key = self.find(x)
        self.packs.append(key)
        if key is not None and type(x) is RematTensor:
            x = wrap(x, x._ref)
            self._track(x, key, saved=True)
        return len(self.packs) - 1, x

    def unpack(self, saved: tuple[int, torch.Tensor]) -> torch.Tensor:
        self.events.append((UNPACK, saved[0]))
        return saved[1]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class Closure:
    """How a dropped value is recomputed: the recorded ops to run (in order), the kept
    values they read, the bytes their outputs take, and the values they read that are
    views again of kept memory (``views``: value -> the kept value in its storage)."""

    __slots__ = ("frontier", "new_bytes", "ops", "views")

    def __init__(self, ops: list[int], frontier: set[Key], new_bytes: int,
                 views: dict[Key, Key]) -> None:
        self.ops, self.frontier, self.new_bytes, self.views = ops, frontier, new_bytes, views


class ReplayPlan:
    """What a replay needs from one recorded step: its ops, the value of each saved tensor,
    the values that could be dropped, and a forecast of the replay's memory (:meth:`peak`)
    from when each value died and each saved tensor was unpacked in the recorded step."""

    def __init__(self, rec: StepRecorder) -> None:
        self.nodes = rec.nodes
        self.packs = rec.packs
        self.nbytes = rec.nbytes
        self.saved = {k for k in rec.packs if k is not None}
        self.params = rec.params
        # values not dropped: their storage is written after they are made
        self.writers: dict[int, list[int]] = {}  # the ops writing each storage
        for n, g in rec.writes:
            self.writers.setdefault(g, []).append(n)
        self.writes = {g: ns[-1] for g, ns in self.writers.items()}  # the last of them
        self.tainted = {k for k, g in rec.storage.items() if self.writes.get(g, -1) > k[0]}
        self.layout = rec.layout
        self.saved_in: dict[int, list[Key]] = {}  # the saved values in each storage
        for k in sorted(self.saved):
            self.saved_in.setdefault(rec.storage[k], []).append(k)
        self.unpacks: dict[Key, int] = {}
        for k in rec.packs:
            if k is not None:
                self.unpacks[k] = self.unpacks.get(k, 0) + 1
        self._timeline(rec)
        self.candidates = [k for k in self.saved if self._droppable(k)]
        # the ops a recomputation may run (those the candidates come from): a replay checks
        # their constants too, and keeps what they need to run again
        self.checked: set[int] = set()
        stack = [k[0] for k in self.candidates]
        while stack:
            n = stack.pop()
            if n not in self.checked:
                self.checked.add(n)
                stack.extend(s.key[0] for s in self.nodes[n].leaves
                             if type(s) is Src and s.key is not None)
        # what a replay checks of each op, found once (it is the replay's hot path): its
        # tensor arguments, each with whether a recomputation reads the step's input there;
        # the constants of the ops in ``checked`` (None elsewhere); its outputs (place in
        # the result, value)
        self.tensors: list[tuple[tuple[int, Src, bool], ...]] = []
        self.constants: list[tuple[tuple[int, Any], ...] | None] = []
        self.outputs: list[tuple[tuple[int, Key], ...]] = []
        # the ops whose arguments are their leaves, one each: no keywords, and lists only
        # of ints (shapes, dims), which the same op's schema cannot fill with tensors, so a
        # replay need not flatten them to find their tensors
        self.positional = [node.spec is None or (
            not node.spec[1] and not any(node.spec[0])
            and all(not x or type(x[0]) is int for x in node.leaves if type(x) in SEQUENCES))
            for node in self.nodes]
        for n, node in enumerate(self.nodes):
            full = n in self.checked
            self.tensors.append(tuple(
                (i, s, full and s.key is None and s.param is None
                 and (node.rerun is None or node.rerun[i] is not None))
                for i, s in enumerate(node.leaves) if type(s) is Src))
            self.constants.append(tuple((i, s) for i, s in enumerate(node.leaves)
                                        if type(s) is not Src) if full else None)
            self.outputs.append(tuple((j, (n, i)) for i, j in enumerate(node.outs)))

    def _timeline(self, rec: StepRecorder) -> None:
        """When, in the recorded step's events, each value was made, read, died, unpacked."""
        events = rec.events[:]  # (the step's: values the program keeps die later)
        self.end = end = len(events) + 1
        op_at = [0] * len(self.nodes)
        self.died: dict[Key, int] = {}
        self.let_go: dict[Key, int] = {}
        self.unpacked: list[tuple[int, Key]] = []  # (event, value), in order
        reads: dict[Key, list[int]] = {}
        # for each event, the first unpack after it with an op between (the next node's)
        after: list[int] = [end] * len(events)
        ahead, op_between = -1, False  # the nearest unpack ahead, and whether an op precedes it
        for t in range(len(events) - 1, -1, -1):
            if ahead >= 0:
                after[t] = ahead if op_between else after[ahead]
            kind = events[t][0]
            if kind == OP:
                op_between = True
            elif kind == UNPACK:
                ahead, op_between = t, False
        for t, (kind, x) in enumerate(events):
            if kind == OP:
                op_at[x] = t
                for s in self.nodes[x].leaves:
                    if type(s) is Src and s.key is not None:
                        reads.setdefault(s.key, []).append(t)
            elif kind == DIE:
                self.died[x] = t
            elif kind == LET_GO:
                self.let_go[x] = t
            else:
                key = self.packs[x]
                if key is not None:
                    self.unpacked.append((t, key))
        self.after = after  # an unpacked tensor is let go by autograd at its node's end
        self.made = {k: op_at[k[0]] for k in rec.nbytes}
        first: dict[Key, int] = {}
        last: dict[Key, int] = {}
        for t, k in self.unpacked:
            first.setdefault(k, t)
            last[k] = t
        self.first_unpack, self.last_unpack = first, last
        # a dropped value goes when the forward pass last reads it, once the program has let
        # it go (a module may hold its output longer: a list of every layer's)
        let_go = self.let_go
        self.forward_end = {k: max(max([t for t in reads.get(k, ()) if t < first.get(k, end)],
                                       default=self.made[k]) + 1, let_go.get(k, end))
                            for k in rec.nbytes}
        # storages: the values in each (a value and its views), its bytes, the op that made
        # it; outside tensors live throughout
        self.group = rec.storage
        self.members: dict[int, list[Key]] = {}
        for k, s in rec.storage.items():
            self.members.setdefault(s, []).append(k)
        self.size = {g: sum(self.nbytes[k] for k in keys) for g, keys in self.members.items()}
        self.maker = {g: min(k[0] for k in keys) for g, keys in self.members.items()}
        # when a storage's saved values were first unpacked, and let go at the latest: its
        # other values made before that and dead by then were held by those (a view holds
        # its base), and those made after it are made from them
        self.window: dict[int, tuple[int, int]] = {}
        for g, keys in self.members.items():
            saved = [k for k in keys if k in first]
            if saved:
                self.window[g] = (min(first[k] for k in saved),
                                  max(self.after[last[k]] for k in saved))
        self.outside, self.state_read = dict(rec.outside), rec.state_read
        self.hold({})
        self.cuts = self._cuts(reads)

    def hold(self, held: dict[int, int]) -> None:
        """Forecast ``held`` (storage id -> bytes: the optimizers' state, see
        :func:`held_state`) as alive from the step's start, as a replay meters it, whether
        an op of the step reads it or not; tensors the step reads count from then on."""
        self.held = held
        read = self.state_read
        self.outside_bytes = [(t, b) for k, (t, b) in self.outside.items()
                              if k not in held or k not in read]
        self.outside_bytes += [(0, b) for b in held.values()]

    def _cuts(self, reads: dict[Key, list[int]]) -> set[int]:
        """The storages that alone hold, at some point between two ops of the forward pass
        (before the first unpack), every value it reads on: each block's output in a chain
        of blocks, where per-block checkpointing keeps its checkpoints."""
        backward = min((t for t, _ in self.unpacked), default=self.end)
        spans: dict[int, tuple[int, int]] = {}  # storage -> (made, last read in forward)
        for k, ts in reads.items():
            made, last = self.made[k], max((t for t in ts if t < backward), default=-1)
            if last > made:
                g = self.group[k]
                a, b = spans.get(g, (made, last))
                spans[g] = (min(a, made), max(b, last))
        changes: dict[int, list[tuple[int, bool]]] = {}  # event -> (storage, made)
        for g, (a, b) in spans.items():
            changes.setdefault(a, []).append((g, True))
            changes.setdefault(b, []).append((g, False))
        cuts: set[int] = set()
        live: set[int] = set()
        for t in sorted(changes):
            for g, made in changes[t]:
                if made:
                    live.add(g)
                else:
                    live.discard(g)
            if len(live) == 1:
                cuts |= live
        return cuts

    def _droppable(self, k: Key) -> bool:
        """Dropping ``k`` (a value or a view of one) can free memory only if autograd alone
        held it until the backward: the program let it go before its first unpack, and it
        died when the node that last unpacked it ended."""
        if self.size[self.group[k]] <= 0 or k in self.tainted or k not in self.first_unpack:
            return False
        died, first = self.died.get(k, self.end), self.first_unpack[k]
        return self.let_go.get(k, self.end) < first < died <= self.after[self.last_unpack[k]]

    def closure(self, key: Key, dropped: set[Key]) -> Closure | None:
        """How ``key`` is recomputed when the values in ``dropped`` are gone; None if it
        cannot be: an op that may not run again, a write to memory the recomputation does
        not make, or a read of memory that is written after the read. A value it reads
        whose memory a kept value holds is viewed again there (no op made it twice)."""
        nodes, saved, group, writes = self.nodes, self.saved, self.group, self.writes
        ops: set[int] = set()
        frontier: set[Key] = set()
        views: dict[Key, Key] = {}
        reads: list[tuple[Key, int]] = []  # recomputed values, and the op reading each
        stack = [key[0]]
        while stack:
            n = stack.pop()
            if n in ops:
                continue
            node = nodes[n]
            if not node.redo or len(ops) >= MAX_CLOSURE:
                return None
            ops.add(n)
            for i, s in enumerate(node.leaves if node.rerun is None else node.rerun):
                if type(s) is not Src:
                    continue
                k = s.key
                if k is None:  # (an input of the step is the replayed step's own)
                    if i in node.wrote:
                        return None
                elif k in saved and k not in dropped:
                    # kept memory is read as it is then: no write after this read
                    if i in node.wrote or writes.get(group[k], -1) > n:
                        return None
                    frontier.add(k)
                elif i not in node.wrote and (m := self._kept_alias(k, dropped, n)) is not None:
                    views[k] = m
                    frontier.add(m)
                else:
                    stack.append(k[0])
                    reads.append((k, n))
        # a recomputed value read after its memory was written: the write runs again first
        for k, n in reads:
            if any(k[0] < w < n and w not in ops for w in self.writers.get(group[k], ())):
                return None
        return Closure(sorted(ops), frontier, sum(nodes[n].new_bytes for n in ops), views)

    def _kept_alias(self, key: Key, dropped: set[Key], n: int) -> Key | None:
        """A kept saved value of ``key``'s dtype in ``key``'s storage, unwritten since op
        ``n`` read ``key``: ``key`` is then a view of its memory (see :meth:`Replay._view`)."""
        layout = self.layout.get(key)
        g = self.group[key]
        if layout is None or self.writes.get(g, -1) > n:
            return None
        for m in self.saved_in.get(g, ()):
            if m not in dropped and (lm := self.layout.get(m)) is not None and lm[0] == layout[0]:
                return m
        return None

    def peak(self, closures: dict[Key, Closure]) -> int:
        """The forecast peak of a replay that drops the keys of ``closures`` (see
        :meth:`forecast`)."""
        return int(self.forecast(closures)[0].max())

    def excess(self, closures: dict[Key, Closure], target: int) -> tuple[int, int, float]:
        """The forecast peak, the bytes × events spent above ``target``, and the cost of
        what the replay recomputes (see :meth:`forecast`)."""
        mem, cost = self.forecast(closures)
        return int(mem.max()), int(np.maximum(mem - target, 0).sum()), cost

    def recompute_cost(self, closures: dict[Key, Closure]) -> float:
        """The cost (ns) of what a replay dropping the keys of ``closures`` recomputes (see
        :meth:`forecast`)."""
        return self.forecast(closures)[1]

    def forecast(self, closures: dict[Key, Closure]) -> tuple[np.ndarray, float]:
        """The forecast memory, event by event, of a replay that drops the keys of
        ``closures``, and the cost (ns) of what it recomputes, as :class:`Replay` does: the
        recorded step's memory, with each dropped value gone after the forward pass last
        reads it and recomputed at its first unpack unless an earlier recomputation made it
        and kept it for its unpacks still to come (a closure's outputs live while it runs;
        the dropped values it makes stay until their last unpack), and each kept value a
        recomputation reads held until the last such recomputation."""
        end = self.end
        delta = np.zeros(end + 1, dtype=np.int64)
        extra = np.zeros(end + 1, dtype=np.int64)
        nodes, after = self.nodes, self.after
        pending = dict(self.unpacks)
        uses: dict[Key, int] = {}
        for c in closures.values():
            for f in c.frontier:
                uses[f] = uses.get(f, 0) + 1
        held = dict.fromkeys(uses, end)  # kept values held for recomputations, until
        group, size, maker = self.group, self.size, self.maker
        table: dict[Key, tuple[int, int] | None] = {}  # -> the new storage it holds
        holders: dict[tuple[int, int], int] = {}  # (recomputation, storage) -> table values
        cost = 0.0
        for t, k in self.unpacked:
            c = closures.get(k)
            if c is None:
                continue
            if k not in table:
                cost += sum(nodes[n].cost for n in c.ops)
                stay = 0
                ops = set(c.ops)
                for n in c.ops:
                    for i in range(len(nodes[n].outs)):
                        m = (n, i)
                        cm = closures.get(m)
                        if cm is None or pending[m] <= 0 or m in table:
                            continue
                        g = group[m]
                        new = (t, g) if maker[g] in ops else None  # (not a kept one's view)
                        table[m] = new
                        if new is not None:
                            if new not in holders:
                                holders[new] = 0
                                stay += size[g]
                            holders[new] += 1
                        for f in cm.frontier:
                            left = uses[f] = uses[f] - 1
                            if left == 0:
                                held[f] = t + 1
                delta[t] += stay
                extra[t] += max(c.new_bytes - stay, 0)
            left = pending[k] = pending[k] - 1
            if left == 0 and k in table:
                new = table.pop(k)
                if new is not None:
                    left = holders[new] = holders[new] - 1
                    if left == 0:
                        delta[after[t]] -= size[new[1]]
        died, forward_end, made = self.died, self.forward_end, self.made
        window = self.window
        for g, keys in self.members.items():
            nb = size[g]
            if not nb:
                continue
            if any(k in closures for k in keys):  # (all its saved values: see units)
                first, last = window[g]
                gone = max((forward_end[k] if k in closures or first <= died.get(k, end) <= last
                            else died.get(k, end)) for k in keys if made[k] < first)
            else:
                gone = max(max(died.get(k, end), held.get(k, 0)) for k in keys)
            delta[min(made[k] for k in keys)] += nb
            delta[min(gone, end)] -= nb
        for t, nb in self.outside_bytes:
            delta[t] += nb
        return np.cumsum(delta) + extra, cost

    def units(self) -> list[tuple[Key, ...]]:
        """What can be dropped, storage by storage: the saved values (and views) in one
        storage, which free it only together; cheapest to recompute per byte first."""
        by_group: dict[int, list[Key]] = {}
        for k in self.saved:
            by_group.setdefault(self.group[k], []).append(k)
        units = []
        for g, keys in by_group.items():
            if not all(k in self.candidates for k in keys):
                continue  # (a saved value of it cannot be dropped: it stays)
            ops: set[int] = set()
            for k in keys:
                c = self.closure(k, set(keys))
                if c is None:
                    break
                ops.update(c.ops)
            else:
                cost = sum(self.nodes[n].cost for n in ops)
                units.append((cost / self.size[g], tuple(sorted(keys))))
        return [u for _, u in sorted(units)]

    def choose(self, target: int) -> tuple[dict[Key, Closure], int] | None:
        """Which values to drop so that the forecast peak is at most ``target``: of two
        greedy fills (:meth:`_fill_by_bytes`, :meth:`_fill_by_margin`), each pruned
        (:meth:`_prune`), and each with the values a node unpacks first recomputed together
        where that fits too (:meth:`_together`), and of the drops per-block checkpointing
        would make (:meth:`_fill_by_cuts`), the one whose recomputations cost least
        (:meth:`recompute_cost`). None if none fits."""
        units = self.units()
        fills = [self._prune(c, units, target) for c in
                 (self._fill_by_bytes(units, target), self._fill_by_margin(units, target))
                 if c is not None]
        candidates = fills + [self._together(c) for c in fills]
        cut = self._fill_by_cuts(units, target)
        if cut is not None:
            candidates.append(self._together(self._prune(cut, units, target, together=True)))
        best: tuple[dict[Key, Closure], int] | None = None
        least = math.inf
        for closures in candidates:  # (one forecast each: its peak and its cost)
            mem, cost = self.forecast(closures)
            peak = int(mem.max())
            if peak <= target and cost < least:
                best, least = (closures, peak), cost
        return best

    def _together(self, closures: dict[Key, Closure]) -> dict[Key, Closure]:
        """``closures`` with the values one backward node unpacks first recomputed together:
        one run of the union of their ops, at the first of those unpacks, which makes them
        all. Apart, the ops they share would run once for each (attention's query, key and
        value, split from one projection, would each run that projection again)."""
        after, first = self.after, self.first_unpack
        by_node: dict[int, list[Key]] = {}
        for k in closures:
            by_node.setdefault(after[first[k]], []).append(k)
        out = dict(closures)
        nodes = self.nodes
        for keys in by_node.values():
            if len(keys) < 2:
                continue
            ops = sorted({n for k in keys for n in closures[k].ops})
            if len(ops) > MAX_CLOSURE:
                continue
            views = {v: m for k in keys for v, m in closures[k].views.items()}
            frontier = {f for k in keys for f in closures[k].frontier}
            merged = Closure(ops, frontier, sum(nodes[n].new_bytes for n in ops), views)
            for k in keys:
                out[k] = merged
        return out

    def _fill_by_bytes(self, units: list[tuple[Key, ...]], target: int
                       ) -> dict[Key, Closure] | None:
        """Storages cheapest to recompute per byte first, each if it does not raise the
        peak and shortens the time spent above ``target`` (a drop can lower one of several
        equal peaks), in passes until it fits; None if it does not."""
        closures: dict[Key, Closure] = {}
        best = self.excess(closures, target)
        left = units
        for _ in range(3):
            rejected = []
            for unit in left:
                if best[0] <= target:
                    break
                trial = self._with(closures, unit)
                score = self.excess(trial, target) if trial is not None else best
                if score[0] <= best[0] and score[1] < best[1]:
                    closures, best = trial, score
                else:
                    rejected.append(unit)
            if best[0] <= target or len(rejected) == len(left):
                break
            left = rejected
        return closures if best[0] <= target else None

    def _fill_by_margin(self, units: list[tuple[Key, ...]], target: int
                        ) -> dict[Key, Closure] | None:
        """The storage whose drop adds least to what the replay recomputes per byte × event
        it removes above ``target`` next, as long as it does not raise the peak; None if no
        such order fits. Where recomputations share ops, the drops after the first cost
        little, which a per-byte order of each alone does not see. Scores go stale when a
        drop is taken and are found again lazily, the best first (a lazy greedy)."""
        closures: dict[Key, Closure] = {}
        best = self.excess(closures, target)
        taken = 0  # drops taken: a score made before the last one is stale
        # (score, tie-break, drops taken when scored, unit, closures with it, its excess)
        heap: list[tuple[float, int, int, tuple[Key, ...], Any, Any]] = [
            (0.0, i, -1, u, None, None) for i, u in enumerate(units)]
        for _ in range(3):
            rejected = []
            while heap and best[0] > target:
                _, i, when, unit, trial, score = heapq.heappop(heap)
                if unit[0] in closures:
                    continue
                if when != taken:  # (stale: score it again and put it back)
                    trial = self._with(closures, unit)
                    score = self.excess(trial, target) if trial is not None else best
                    gain = best[1] - score[1]
                    if score[0] > best[0] or gain <= 0:
                        rejected.append((0.0, i, -1, unit, None, None))
                    else:
                        rank = (score[2] - best[2]) / gain
                        heapq.heappush(heap, (rank, i, taken, unit, trial, score))
                    continue
                closures, best = trial, score
                taken += 1
            if best[0] <= target or not rejected:
                break
            heap = rejected + [h for h in heap if h[3][0] not in closures]
            heapq.heapify(heap)
        return closures if best[0] <= target else None

    def _fill_by_cuts(self, units: list[tuple[Key, ...]], target: int
                      ) -> dict[Key, Closure] | None:
        """Every storage dropped but the forward pass's cuts (:meth:`_cuts`), as per-block
        checkpointing drops them, if recomputed together (:meth:`_together`) they fit
        ``target``; None if not. One drop at a time, the greedy fills cannot reach this:
        dropped alone, a value whose recomputation runs back to a cut can raise the peak
        that dropping all of them together lowers (a CNN's convolutions and batch norms)."""
        closures: dict[Key, Closure] = {}
        for unit in units:
            if self.group[unit[0]] not in self.cuts:
                trial = self._with(closures, unit)
                if trial is not None:
                    closures = trial
        return closures if self.peak(self._together(closures)) <= target else None

    def _prune(self, closures: dict[Key, Closure], units: list[tuple[Key, ...]],
               target: int, together: bool = False) -> dict[Key, Closure]:
        """``closures`` less every drop the fit does not need, most expensive first (the
        fit forecast with the values a node unpacks first recomputed together, with
        ``together``)."""
        nodes = self.nodes
        chosen = [u for u in units if u[0] in closures]
        for unit in sorted(chosen, key=lambda u: -sum(nodes[n].cost for k in u
                                                       for n in closures[k].ops)):
            if unit[0] not in closures:
                continue
            trial = self._without(closures, unit)
            if trial is not None and self.peak(self._together(trial) if together
                                               else trial) <= target:
                closures = trial
        return closures

    def _with(self, closures: dict[Key, Closure], keys: tuple[Key, ...]
              ) -> dict[Key, Closure] | None:
        """``closures`` with ``keys`` dropped too (the closures that read them grow), or
        None if some recomputation would then be impossible or too long."""
        dropped = {*closures, *keys}
        out = dict(closures)
        grow = [k for k, c in closures.items() if not c.frontier.isdisjoint(keys)]
        for k in (*keys, *grow):
            c = self.closure(k, dropped)
            if c is None:
                return None
            out[k] = c
        return out

    def _without(self, closures: dict[Key, Closure], keys: tuple[Key, ...]
                 ) -> dict[Key, Closure] | None:
        """``closures`` with ``keys`` kept (the closures through them shrink)."""
        dropped = set(closures).difference(keys)
        ops = {k[0] for k in keys}
        out = {}
        for k, c in closures.items():
            if k in keys:
                continue
            if not ops.isdisjoint(c.ops):
                c2 = self.closure(k, dropped)
                if c2 is None:
                    return None
                c = c2
            out[k] = c
        return out


class Tuning:
    """Which values a replay of one plan drops: the fewest whose forecast peak leaves a
    margin under the budget (:meth:`ReplayPlan.choose`). A replayed step's metered peak
    corrects the forecast: the most it was above it widens the margin, once."""

    MARGIN = 0.01  # of the budget

    def __init__(self, plan: ReplayPlan, budget: int, held: dict[int, int] | None = None
                 ) -> None:
        self.plan, self.budget = plan, budget
        self.error = 0  # the most a metered peak was above its forecast
        self.failure = ""  # why choosing the drops again failed, if it raised
        self.closures: dict[Key, Closure] = {}
        self.forecast = 0
        self.hold(held or {})

    def target(self) -> int:
        return self.budget - int(self.MARGIN * self.budget) - self.error

    def hold(self, held: dict[int, int]) -> None:
        """Choose the drops with ``held`` alive from the start (see
        :meth:`ReplayPlan.hold`): as the plan is made, and again in the background
        (``Planning.replay_for_step``) if the optimizer made its state after the step was
        recorded. ``failed``: no drops fit, so it is not replayed."""
        self.plan.hold(held)
        chosen = self.plan.choose(self.target())
        self.failed = chosen is None
        if chosen is not None:
            self.closures, self.forecast = chosen

    def report(self, fitted: bool, peak: int) -> None:
        """A replayed step ended within the budget (``fitted``) or handed over to fit."""
        if not fitted:
            self.failed = True
            return
        if peak - self.forecast > self.error:
            self.error = peak - self.forecast
            chosen = self.plan.choose(self.target())
            if chosen is not None:
                self.closures, self.forecast = chosen


class Replay:
    """One step replayed: the session's dispatch hands every op to :meth:`dispatch` while
    ``session.replay`` is this, and autograd its saved tensors to :meth:`pack`/:meth:`unpack`."""

    def __init__(self, session: Session, plan: ReplayPlan, closures: dict[Key, Closure],
                 forecast: int) -> None:
        self.session = session
        self.plan = plan
        self.forecast = forecast  # the peak the plan's forecast expects
        self.budget = session.budget_bytes
        self.closures = closures  # the dropped values
        self.uses: dict[Key, int] = {}  # kept values' pending reads by recomputations
        for c in closures.values():
            for f in c.frontier:
                self.uses[f] = self.uses.get(f, 0) + 1
        # tensors recomputations read, at their versions then: parameters, and the inputs
        # of the step (the batch) as this step's ops read them (``outer``)
        self.versions = {id(p): p._version for p in plan.params}
        self.outer: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self.rng: dict[int, tuple] = {}  # generator states the random ops drew from
        # this step's generators where the recorded step passed another (one made anew
        # each step): a recomputation draws from this step's, at its captured state
        self.generators: dict[tuple[int, int], torch.Generator] = {}
        self.pending = dict(plan.unpacks)  # unpacks still to come, by value
        self.table: dict[Key, torch.Tensor] = {}  # kept values read by recomputations,
        # and recomputed values still to be unpacked
        self.held: dict[Key, list[weakref.ref]] = {}  # what autograd holds of kept values
        self.k = 0  # the next recorded op
        self.p = 0  # the next saved tensor
        self._ids: dict[int, tuple[Key, weakref.ref]] = {}
        self._live: dict[int, weakref.ref] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.handed_over_at: int | None = None
        self.reason = ""
        self.recomputed = 0
        self.redoing = False
        self.redo_bytes = 0
        # alive from the start, as the engine counts them (``Leaves._adopt_module``): the
        # optimizers' state, and gradients accumulated before the step
        for x in [*optimizer_state(plan.params),
                  *(p.grad for p in plan.params if p.grad is not None)]:
            self._count(x)
        self.peak_bytes = self.live_bytes

    def close(self) -> None:
        """The step ended: stop metering, letting the meter's weak references go now rather
        than with the replay (see ``StorageMeter.__exit__``: a crash on Python 3.11)."""
        self._live.clear()

    def made(self, x: torch.Tensor) -> bool:
        """Did this step's ops (or a recomputation of them) make ``x``?"""
        hit = self._ids.get(id(x))
        return hit is not None and hit[1]() is x

    # ------------------------------------------------------------------ the meter
    # (StorageMeter counts the same way; this is its own code, so that the meter that checks
    # a replay's memory shares nothing with it)
    def _count(self, x: torch.Tensor) -> None:
        st = x.untyped_storage()
        key = id(st)
        if key in self._live:
            return
        nbytes = st.nbytes()

        def freed(_: object, key: int = key, nbytes: int = nbytes) -> None:
            if self._live.pop(key, None) is not None:
                self.live_bytes -= nbytes

        self._live[key] = weakref.ref(st, freed)
        self.live_bytes += nbytes

    # ------------------------------------------------------------------ ops
    def dispatch(self, func: Any, types: Any, args: tuple, kwargs: dict | None) -> Any:
        kwargs = kwargs or NO_KWARGS
        if self.redoing:  # a recomputation's op: metered, not checked
            if self.live_bytes + self.redo_bytes > self.budget:
                return self.hand_over(func, types, args, kwargs, HANDED_OVER_FIT)
            out = func(*args, **kwargs)
            for o in flatten_result(out)[0]:
                if isinstance(o, torch.Tensor):
                    self._count(o)
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
            return out
        k = self.k
        plan = self.plan
        nodes = plan.nodes
        node = nodes[k] if k < len(nodes) else None
        if node is None or node.func is not func:  # (no recorded op is one of these:)
            if func.namespace in _UNRECORDED:
                return func(*args, **kwargs)
            if func is _detach:
                out = func(*args, **kwargs)
                hit = self._ids.get(id(args[0]))
                if hit is not None and hit[1]() is args[0]:
                    self._ids[id(out)] = (hit[0], weakref.ref(out))
                return out
            return self.hand_over(func, types, args, kwargs, HANDED_OVER_OPS)
        if kwargs or not plan.positional[k]:
            leaves, spec = flatten(args, kwargs)
            if spec != node.spec or len(leaves) != len(node.leaves):
                return self.hand_over(func, types, args, kwargs, HANDED_OVER_OPS)
        elif len(args) == len(node.leaves):
            leaves = args
        else:
            return self.hand_over(func, types, args, kwargs, HANDED_OVER_OPS)
        ids = self._ids
        for i, s, outer in plan.tensors[k]:
            x = leaves[i]
            if not isinstance(x, torch.Tensor) or x.shape != s.shape:
                return self.hand_over(func, types, args, kwargs, HANDED_OVER_OPS)
            key = s.key
            if key is not None:
                hit = ids.get(id(x))
                if hit is None or hit[0] != key or hit[1]() is not x:
                    return self.hand_over(func, types, args, kwargs, HANDED_OVER_OPS)
                continue
            if s.param is not None:
                if x is not s.param:
                    return self.hand_over(func, types, args, kwargs, HANDED_OVER_PARAMS)
            elif s.stride is not None and x.stride() != s.stride:  # (the layout of what is
                # made from it: see ReplayPlan._kept_alias)
                return self.hand_over(func, types, args, kwargs, HANDED_OVER_OPS)
            elif outer:  # (this step's input, as it is now: recomputations read it)
                self.outer[(k, i)] = (x, x._version)
            self._count(x)
        constants = plan.constants[k]  # (elsewhere a constant may change: a learning rate)
        if constants is not None:
            for i, c in constants:
                x = leaves[i]
                if x is not c and (type(x) is not type(c) or x != c):
                    if (type(c) is torch.Generator and type(x) is torch.Generator
                            and x.device == c.device):
                        self.generators[(k, i)] = x
                        continue
                    return self.hand_over(func, types, args, kwargs, HANDED_OVER_OPS)
        if self.live_bytes + node.new_bytes > self.budget:
            return self.hand_over(func, types, args, kwargs, HANDED_OVER_FIT)
        if constants is not None and node.random:  # (a recomputation draws the same
            # numbers)
            self.rng[k] = capture_rng(
                devices_of([x for x in leaves if isinstance(x, torch.Tensor)]),
                generators_in(leaves))
        out = func(*args, **kwargs)
        self.k = k + 1
        flat, _ = flatten_result(out)
        new = node.new_bytes  # (0: its outputs are views of, or writes to, storage counted)
        for j, key in plan.outputs[k]:
            o = flat[j]
            ids[id(o)] = (key, weakref.ref(o))
            if new:
                self._count(o)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return out

    def hand_over(self, func: Any, types: Any, args: tuple, kwargs: dict, reason: str) -> Any:
        """Give the rest of the step to the engine: first drop every kept value that can be
        recomputed (:meth:`shed`), then what is still live enters the engine as pinned
        leaves, the optimizers' state first in one run of blocks (as a session adopts it),
        the rest one per storage, and this op and every later one go the session's dynamic
        way (recomputations included)."""
        session = self.session
        self.handed_over_at, self.reason = self.k, reason
        self.shed()
        state = optimizer_state(self.plan.params)
        apart = {id(x.untyped_storage()) for x in state}
        if reason == HANDED_OVER_PARAMS:  # (the recorded parameters' state and gradients
            # are another model's: the session adopts this one's as its modules run)
            apart |= {id(p.grad.untyped_storage()) for p in self.plan.params
                      if p.grad is not None}
            state = []
        holders = [torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
                   for key, ref in self._live.items()
                   if key not in apart and (st := ref()) is not None]
        session.replay = None
        if state:
            session.leaves.adopt_together(state, "the optimizers' state")
        session.adopt(holders)
        return session.__torch_dispatch__(func, types, args, kwargs)

    def shed(self) -> None:
        """Drop, as the plan would have if the budget had asked, every kept value autograd
        still holds that a recomputation can make from what stays: the engine then pins
        only what cannot be recomputed."""
        plan, table, pending = self.plan, self.table, self.pending
        kept = {}
        for k, refs in self.held.items():
            xs = [h for r in refs if (h := r()) is not None and h.x is not None]
            if xs and pending.get(k, 0) > 0:
                kept[k] = xs
        todo = {k for k in self.closures if pending.get(k, 0) > 0 and k not in table}
        dropped = todo | {k for k in kept if k in plan.candidates}
        while True:  # (a value whose closure cannot be made stays, and others read it)
            closures = {k: plan.closure(k, dropped) for k in dropped}
            bad = {k for k, c in closures.items()
                   if c is None or not all(f in table or f in kept for f in c.frontier)}
            if not bad:
                break
            dropped -= bad
        uses: dict[Key, int] = {}
        for c in closures.values():
            for f in c.frontier:
                uses[f] = uses.get(f, 0) + 1
                if f not in table:
                    table[f] = kept[f][0].x
        for k in dropped.difference(self.closures):
            table.pop(k, None)
            for h in kept[k]:
                h.x = None
        self.closures = {**self.closures, **closures}
        self.uses = uses
        for f in [f for f in table if f not in uses and f not in self.closures]:
            del table[f]  # (a kept value no recomputation reads any more)

    # ------------------------------------------------------------------ saved tensors
    def pack(self, x: torch.Tensor) -> Any:
        i = self.p
        self.p = i + 1
        packs = self.plan.packs
        key = packs[i] if i < len(packs) else None
        if key is None or self.handed_over_at is not None:
            return x
        hit = self._ids.get(id(x))
        if hit is None or hit[0] != key or hit[1]() is not x:
            return x  # (not the recorded value: kept as it is)
        if key in self.uses:
            self.table[key] = x
        if key in self.closures:
            return _Saved(key, None)
        h = _Saved(key, x)
        self.held.setdefault(key, []).append(weakref.ref(h))
        return h

    def unpack(self, h: Any) -> torch.Tensor:
        if type(h) is not _Saved:
            return h
        key, x = h.key, h.x
        if x is not None:
            self.pending[key] -= 1
            return x
        table = self.table  # dropped: recomputed, or made by an earlier recomputation
        x = table.get(key)
        if x is None:
            x = self._recompute(key)
        left = self.pending[key] = self.pending[key] - 1
        if left <= 0:
            table.pop(key, None)
        return x

    def _recompute(self, key: Key) -> torch.Tensor:
        """``key`` again, by its closure's ops from the values kept; recomputed values with
        unpacks still to come stay in the table (their closures' reads are then done)."""
        plan, table, outer, versions = self.plan, self.table, self.outer, self.versions
        closure = self.closures[key]
        ops = closure.ops
        memo: dict[Key, torch.Tensor] = {}
        self.redoing = True
        grad = torch.is_grad_enabled()
        try:
            self.redo_bytes = 0
            for k, m in closure.views.items():
                memo[k] = self._view(k, m, table[m])
            with below_autograd(grad):  # (entered once: it costs more than a small op)
                for n in ops:
                    node = plan.nodes[n]
                    flat = []
                    for i, s in enumerate(node.leaves if node.rerun is None else node.rerun):
                        if type(s) is not Src:
                            flat.append(self.generators.get((n, i), s)
                                        if type(s) is torch.Generator else s)
                        elif s.key is not None:
                            flat.append(table[s.key] if s.key in table else memo[s.key])
                        elif s.param is not None:
                            if s.param._version != versions[id(s.param)]:
                                raise _written()
                            flat.append(s.param)
                        else:
                            x, version = outer[(n, i)]
                            if x._version != version:
                                raise _written()
                            flat.append(x)
                    args, kwargs = unflatten(flat, node.spec)
                    self.redo_bytes = node.new_bytes
                    if node.grad != grad:  # (the grad mode it first ran in; left on exit)
                        grad = node.grad
                        torch.set_grad_enabled(grad)
                    if node.random:
                        with RestoredRng(self.rng[n]):
                            out = node.func(*args, **kwargs)
                    else:
                        out = node.func(*args, **kwargs)
                    res, _ = flatten_result(out)
                    for i, j in enumerate(node.outs):
                        memo[(n, i)] = res[j]
                    self.recomputed += 1
        finally:
            self.redoing = False
        ids = self._ids
        for k, v in memo.items():
            ids[id(v)] = (k, weakref.ref(v))
            if k in self.closures and self.pending.get(k, 0) > 0 and k not in table:
                table[k] = v
                self._release(k)
        return memo[key]

    def _view(self, key: Key, kept: Key, x: torch.Tensor) -> torch.Tensor:
        """``key`` as a view of ``x``, the kept value ``kept`` in its storage: at the place
        the record had it relative to ``kept``."""
        _, size, stride, offset = self.plan.layout[key]
        _, kept_size, kept_stride, kept_offset = self.plan.layout[kept]
        if x.shape != kept_size or x.stride() != kept_stride:
            raise MembudgetError(
                f"a kept activation ({x.shape}, strides {x.stride()}) is laid out otherwise "
                f"than when the step was recorded ({kept_size}, strides {kept_stride}); a "
                "replayed step cannot view it again. Make the session with replay=False")
        with below_autograd(False):
            return x.as_strided(size, stride, x.storage_offset() + offset - kept_offset)

    def _release(self, key: Key) -> None:
        """``key`` will not be recomputed again: its closure's kept values are read once less."""
        frontier = self.closures[key].frontier
        uses, table = self.uses, self.table
        for f in frontier:  # (autograd holds its own reference for its unpacks)
            left = uses[f] = uses[f] - 1
            if left <= 0:
                table.pop(f, None)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def held_state(params: list[torch.Tensor]) -> dict[int, int]:
    """The storages of the state of the optimizers that update ``params``, by id, with their
    bytes: alive through the step, read by it or not."""
    out = {}
    for v in optimizer_state(params):
        st = v.untyped_storage()
        out[id(st)] = st.nbytes()
    return out


def _written() -> MembudgetError:
    return MembudgetError(
        "a parameter or an input of the step was written after the forward pass read it "
        "and before the backward needed what was computed from it; a replayed step cannot "
        "recompute that. Make the session with replay=False")


class _Saved:
    """What autograd holds for a saved tensor of the record: the tensor (``x``), or None
    once it is dropped."""

    __slots__ = ("__weakref__", "key", "x")

    def __init__(self, key: Key, x: torch.Tensor | None) -> None:
        self.key, self.x = key, x


__all__ = ["Replay", "ReplayPlan", "StepRecorder", "Tuning", "held_state"]
