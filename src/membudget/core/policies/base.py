"""The eviction-policy interface: given the candidates, pick the storage to evict."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from mypy_extensions import mypyc_attr

from membudget.core.pool import CandidatePool
from membudget.core.records import Storage

if TYPE_CHECKING:
    from membudget.core.allocators.block import Block
    from membudget.core.engine import Engine


@mypyc_attr(allow_interpreted_subclasses=True)  # (compiled: see setup.py)
class Policy(ABC):
    """Chooses victims; may keep its own caches up to date through the ``on_*`` hooks."""

    name: ClassVar[str]
    engine: Engine
    needs_layout: ClassVar[bool] = False  # reads the allocator's address layout
    relocates: ClassVar[bool] = False  # may move storages (``relocations``) before evicting
    # scores the free bytes beside a candidate (the pool's ``free_adj`` column), which the
    # allocator then keeps current on every placement and free
    reads_free_adj: ClassVar[bool] = False
    # knows when each storage is next read: only a replay of a recorded step can tell it
    # (the simulator does; a live session refuses such a policy)
    needs_future: ClassVar[bool] = False
    # what the method was published with: the engine's defaults under this policy
    default_allocator: ClassVar[str] = "fungible"
    default_inplace: ClassVar[str] = "cow"

    def __init__(self) -> None:
        """Most policies take no options: one given by mistake is then a TypeError (a
        compiled class without its own ``__init__`` would accept and ignore it)."""

    def attach(self, engine: Engine) -> None:
        """Called once by the engine that will consult this policy."""
        self.engine = engine

    @abstractmethod
    def choose(self, pool: CandidatePool, clock: float) -> Storage:
        """Return one storage of the (non-empty) pool to evict."""

    def victims(self, pool: CandidatePool, clock: float, request: Storage) -> list[Storage]:
        """Storages of the (non-empty) pool to evict at once so that ``request`` may fit;
        the engine evicts them, retries, and asks again while it still does not fit.
        Most policies evict one at a time; layout-aware ones return a whole window."""
        return [self.choose(pool, clock)]

    def relocations(self, pool: CandidatePool, clock: float,
                    request: Storage) -> list[tuple[Storage, Block | None]]:
        """Asked before ``victims`` when the policy ``relocates``: storages to move so that
        ``request`` fits without an eviction, each into a free block (``(storage, hole)``,
        for the allocator's ``relocate``) or down into the free block before it
        (``(storage, None)``, for its ``slide``); empty to leave it to ``victims``."""
        return []

    def on_evict(self, s: Storage) -> None:
        """``s`` was evicted (by the policy or eagerly on release)."""

    def on_remat(self, s: Storage) -> None:
        """``s``, evicted before, holds its bytes again."""

    def on_forget(self, s: Storage) -> None:
        """``s``, evicted before, was freed for good and left the graph."""
