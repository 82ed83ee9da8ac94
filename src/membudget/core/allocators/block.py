"""A block of an address-ordered pool: a storage's bytes or a free hole, with its neighbours."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from membudget.core.records import Storage


class Block:
    """``size`` bytes at ``addr`` in segment ``segment``, held by ``storage`` (None: free).

    Blocks of one segment tile it and are doubly linked in address order; ``prev``/``next``
    never cross a segment boundary, so only same-segment neighbours can coalesce.
    """

    __slots__ = ("addr", "next", "prev", "segment", "size", "storage")

    def __init__(self, addr: int, size: int, storage: Storage | None = None,
                 segment: int = 0, prev: Block | None = None, next: Block | None = None) -> None:
        self.addr = addr
        self.size = size
        self.storage = storage
        self.segment = segment
        self.prev = prev
        self.next = next

    @property
    def free(self) -> bool:
        return self.storage is None

    def __repr__(self) -> str:
        who = "free" if self.storage is None else f"storage {self.storage.id}"
        return f"Block({self.addr}+{self.size}, {who}, segment {self.segment})"


def link_after(b: Block, x: Block) -> None:
    """Insert ``b`` just after ``x``."""
    b.prev, b.next = x, x.next
    if x.next is not None:
        x.next.prev = b
    x.next = b


def unlink(b: Block) -> None:
    """Take ``b`` out of its list."""
    if b.prev is not None:
        b.prev.next = b.next
    if b.next is not None:
        b.next.prev = b.prev
    b.prev = b.next = None
