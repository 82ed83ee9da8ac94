"""The engine's records: storages (units of memory), tensors (values) and compute paths.

These are plain slotted objects because the simulator touches them millions of times; every
field is documented here once and read directly by the engine and the policies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from membudget.core.allocators.block import Block


class Storage:
    """One buffer of memory and every tensor that lives in it (a base and its views).

    A storage is *resident* (its bytes are held), *evicted* (dropped, but recomputable from its
    compute history), *swapped* (its bytes copied to host memory, copied back when needed) or
    *dead* (freed for good: nothing that may still be needed depends on it).
    """

    __slots__ = (
        "block",  # the layout-aware allocator's Block holding its bytes (None otherwise)
        "children",  # storages computed from this one that are not dead (an ordered set)
        "cost",  # summed cost of the distinct paths producing its tensors (views included)
        "dead",
        "ev_children",  # how many children are evicted (kept by the engine for policies)
        "ev_parents",  # how many parents are evicted
        "evicted",
        "ext_refs",  # references held by the program over all its tensors
        "host_ready",  # when its copy in host memory is complete (inf: it has none)
        "id",
        "kind",  # free-form label: "leaf", "activation", ...
        "last_access",  # logical clock of the last read or write
        "locks",  # > 0 while it is an input of an op being run
        "nbytes",
        "parents",  # storages whose tensors are inputs of its producers (an ordered set)
        "pinned",  # never evicted (leaves, constants, unsafe-to-recompute outputs)
        "remats",  # how many times it was rematerialized
        "resident",
        "seq",  # when it last entered the candidate pool (the pool's entry counter)
        "slot",  # index in the candidate pool, or -1
        "swapped",
        "tensors",  # the tensors that live in it; tensors[0] is the base
        "uf",  # scratch field for policies (union-find node of dtr-eq)
    )

    def __init__(self, sid: int, nbytes: int, kind: str = "activation") -> None:
        self.id = sid
        self.nbytes = nbytes
        self.kind = kind
        self.resident = False
        self.evicted = False
        self.swapped = False
        self.dead = False
        self.host_ready = math.inf
        self.pinned = False
        self.locks = 0
        self.ext_refs = 0
        self.cost = 0.0
        self.last_access = 0.0
        self.tensors: list[Tensor] = []
        # dicts used as insertion-ordered sets: walks over them (and float sums along them)
        # then happen in the same order in a live run and in its replay
        self.parents: dict[Storage, None] = {}
        self.children: dict[Storage, None] = {}
        self.ev_parents = 0
        self.ev_children = 0
        self.slot = -1
        self.seq = 0
        self.block: Block | None = None
        self.remats = 0
        self.uf: object | None = None

    @property
    def free_adj(self) -> int:
        """Free bytes directly before and after its block (0 without one): read from the
        layout when the candidate pool syncs, so allocators only mark the rows that change."""
        b = self.block
        if b is None:
            return 0
        p, n = b.prev, b.next
        return (p.size if p is not None and p.storage is None else 0) + (
            n.size if n is not None and n.storage is None else 0)

    @property
    def movable(self) -> bool:
        """Can its bytes move to another block? If the engine computed it, pinned or not,
        locked by the running op or not (an op reads its inputs when it runs, after room is
        made); a leaf's memory is the program's (a parameter, a batch), and the bare
        duplicate that a recomputation holds for a resident output has no tensors."""
        return bool(self.tensors) and self.tensors[0].producer is not None

    def __repr__(self) -> str:
        state = "dead" if self.dead else "evicted" if self.evicted else (
            "swapped" if self.swapped else "resident" if self.resident else "new")
        return f"Storage(id={self.id}, {self.nbytes} B, {state})"


class Tensor:
    """A value the program holds a handle to; it lives in one storage (as its base or a view).

    ``meta`` is the executor's own description of the value (the torch executor's: shape,
    strides, offset, dtype and device), opaque to the engine."""

    __slots__ = ("alias", "defined", "ext_refs", "id", "meta", "producer", "storage")

    def __init__(self, tid: int, storage: Storage, producer: ComputePath | None,
                 alias: bool) -> None:
        self.id = tid
        self.storage = storage
        self.producer = producer
        self.alias = alias
        self.defined = False
        self.ext_refs = 0
        self.meta: object = None

    def __repr__(self) -> str:
        return f"Tensor(id={self.id}, storage={self.storage.id}, defined={self.defined})"


NOTHING_REUSED: dict[Storage, Storage] = {}  # shared, never written: no block handed over


class ComputePath:
    """How some tensors were computed: the op, its input tensors, its outputs and its cost.

    ``mutated`` lists the inputs the op writes; their new versions are the last outputs.
    ``reused`` maps, while the op runs, each new version whose write may overwrite its old
    value to that old value's storage (the executor then writes in place): on its first run,
    or on a recomputation that writes into the old value recomputed for it.
    """

    __slots__ = ("cost", "id", "inputs", "mutated", "op", "outputs", "pending", "reused")

    def __init__(self, pid: int, op: object, inputs: Sequence[Tensor], cost: float,
                 mutated: tuple[int, ...] = (), pending: tuple | None = None) -> None:
        self.id = pid
        self.op = op
        self.inputs = tuple(inputs)
        self.outputs: list[Tensor] | None = None  # made when it first runs
        self.cost = cost
        self.mutated = mutated
        self.reused: dict[Storage, Storage] = NOTHING_REUSED
        self.pending = pending  # output sizes and aliases until it first runs

    @property
    def versions(self) -> list[Tensor]:
        """The new versions of the inputs it writes (``mutated`` in order): the last outputs."""
        outputs = self.outputs
        assert outputs is not None, "the versions are made when the path first runs"
        return outputs[len(outputs) - len(self.mutated):]

    def __repr__(self) -> str:
        return f"ComputePath(id={self.id}, op={self.op!r}, cost={self.cost})"
