"""``dtr-eq``: h_DTR^eq, the evicted neighbourhood approximated by union-find classes.

On eviction a storage's class is merged with the classes of its evicted neighbours (the value
of a class is the summed cost of its members); on rematerialization the storage's cost is
subtracted from its class, which is not split (the paper's and MegEngine's approximation).
"""

from __future__ import annotations

from itertools import chain
from typing import cast

from membudget.core.policies.cost import CostPolicy
from membudget.core.records import Storage


class _Node:
    __slots__ = ("own", "parent", "rank", "val")

    def __init__(self, val: float) -> None:
        self.parent = self
        self.val = val
        self.own = val
        self.rank = 0


def _find(n: _Node) -> _Node:
    root = n
    while root.parent is not root:
        root = root.parent
    while n.parent is not root:
        n.parent, n = root, n.parent
    return root


class DTREq(CostPolicy):
    name = "dtr-eq"
    use_parents = True
    use_children = True

    def neighbour_cost(self, s: Storage) -> float:
        roots = dict.fromkeys(_find(cast(_Node, n.uf))
                              for n in chain(s.parents, s.children) if n.evicted)
        return sum(r.val for r in roots)

    def on_evict(self, s: Storage) -> None:
        root = s.uf = _Node(s.cost)
        for neighbours in (s.parents, s.children):  # (on every eviction: no chain object)
            for n in neighbours:
                if not n.evicted:
                    continue
                other = cast(_Node, n.uf).parent  # n's class root is its parent's (most often that)
                if other.parent is not other:
                    other = _find(other)
                if other is root:
                    continue
                if other.rank > root.rank:
                    root, other = other, root
                other.parent = root
                root.val += other.val
                if other.rank == root.rank:
                    root.rank += 1

    def on_remat(self, s: Storage) -> None:
        node = cast(_Node, s.uf)
        _find(node).val -= node.own
        s.uf = None
        self.epoch += 1

    def on_forget(self, s: Storage) -> None:
        """Freed for good while evicted: it leaves its class as on rematerialization."""
        self.on_remat(s)
