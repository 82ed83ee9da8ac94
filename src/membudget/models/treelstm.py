"""Child-sum TreeLSTM (Tai et al. 2015) over random binary trees: the graph of ops follows the
tree, which is Python data drawn from a seeded ``random.Random``, never from tensor values."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

# A tree is a leaf (its index into the leaf tensors, left to right) or a tuple of subtrees.
Tree = int | tuple["Tree", ...]


def random_tree(rng: random.Random, leaves: int, first: int = 0) -> Tree:
    """A random binary tree over leaves ``first`` … ``first + leaves - 1``, split points
    drawn uniformly from ``rng``."""
    if leaves == 1:
        return first
    left = rng.randint(1, leaves - 1)
    return (random_tree(rng, left, first), random_tree(rng, leaves - left, first + left))


@dataclass
class TreeBatch:
    """``batch`` sentences sharing one parse tree: a (batch, features) embedding per leaf and
    one class label per sentence."""

    tree: Tree
    leaves: list[torch.Tensor]
    labels: torch.Tensor


class ChildSumTreeLSTM(nn.Module):
    """Leaves read their embedding; an inner node reads the sum of its children's hidden states
    and gives each child its own forget gate. The root's hidden state is classified."""

    def __init__(self, in_dim: int = 100, mem_dim: int = 300, classes: int = 5) -> None:
        super().__init__()
        self.leaf_iou = nn.Linear(in_dim, 3 * mem_dim)
        self.node_iou = nn.Linear(mem_dim, 3 * mem_dim)
        self.node_forget = nn.Linear(mem_dim, mem_dim)
        self.classifier = nn.Linear(mem_dim, classes)

    def forward(self, tree: Tree, leaves: list[torch.Tensor]) -> torch.Tensor:
        """Class logits (batch, classes) of the root of ``tree``."""
        _, h = self._state(tree, leaves)
        return self.classifier(h)

    def _state(self, tree: Tree, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The (memory, hidden) state of ``tree``'s root, computed bottom-up."""
        if isinstance(tree, int):
            i, o, u = self.leaf_iou(leaves[tree]).chunk(3, 1)
            c = torch.sigmoid(i) * torch.tanh(u)
            return c, torch.sigmoid(o) * torch.tanh(c)
        cs, hs = zip(*(self._state(child, leaves) for child in tree), strict=True)
        child_c, child_h = torch.stack(cs), torch.stack(hs)
        i, o, u = self.node_iou(child_h.sum(0)).chunk(3, 1)
        forget = torch.sigmoid(self.node_forget(child_h))
        c = torch.sigmoid(i) * torch.tanh(u) + (forget * child_c).sum(0)
        return c, torch.sigmoid(o) * torch.tanh(c)
