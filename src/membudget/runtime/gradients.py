"""Values made by the backward pass are pinned, never recomputed.

Recomputing one would replay the backward pass up to it: its inputs are gradients the
program has released, whose own recomputation needs the gradients before them and the
forward values each consumed. A DTR policy prices such a value by its own op (or its evicted
neighbours at that moment) and evicts it, and the chain of recomputations that brings it back
then holds a forward value or gradient at each of its frames. So what autograd computes for a
backward node (gradient mode off, as PyTorch's engine runs it) stays resident until the
program releases it, and the engine evicts forward values only; those recompute through the
forward alone. A forward recomputed during backward (``torch.utils.checkpoint``, with
gradient mode on) and a double backward (``create_graph=True``) are left evictable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from membudget.core.records import Tensor

if TYPE_CHECKING:
    from membudget.runtime.session import Session

autograd_node = torch._C._current_autograd_node
grad_enabled = torch._C.is_grad_enabled


def in_backward() -> bool:
    """Autograd's engine is running a node's backward, without recording a graph."""
    return autograd_node() is not None and not grad_enabled()


def pin_made(session: Session, handles: Sequence[Tensor]) -> None:
    """Pin the new storages among ``handles``, outputs of an op of the backward pass (a view
    shares its base's storage, which is pinned already or is a forward value)."""
    for h in handles:
        if not h.alias and not h.storage.pinned and h.storage.nbytes:
            session.pin(h)
