"""Values made by the backward pass are pinned, never recomputed (``runtime.gradients``).

Recomputing one would replay the backward up to it; the engine evicts forward values only.
The ops are told apart by what autograd is doing when they first run (a backward node, with
gradient mode off), independently of the runtime.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import membudget
from membudget.runtime.executor import TorchExecutor


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                    intermediate_size=128, image_size=32, patch_size=8, num_labels=5,
                    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ViTForImageClassification(cfg)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 5, (16,))
    return model, lambda m: m(pixel_values=x, labels=y).loss


class Checkpointed(nn.Module):
    """Blocks under ``torch.utils.checkpoint``: their forward runs again inside backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(),
                                                  nn.Linear(128, 64)) for _ in range(12))

    def forward(self, x):
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=False)
        return x.square().mean()


def checkpointed():
    x = torch.randn(2048, 64)
    return Checkpointed(), lambda m: m(x)


@pytest.fixture
def runs(monkeypatch):
    """Which ops each session made in a backward node (new storages, not views of what
    they read), which it made there with gradient mode on (a checkpointed forward run again),
    and which it recomputed."""
    made_in_backward: set[int] = set()
    rerun: set[int] = set()  # made in a backward node with gradient mode on
    recomputed: set[int] = set()
    probe, run = TorchExecutor.probe, TorchExecutor.run

    def probing(self, path):
        sizes, aliases, cost = probe(self, path)
        fresh = aliases is None or all(a < 0 for a in aliases)  # not a view of its input
        if fresh and torch._C._current_autograd_node() is not None:
            (made_in_backward if not torch.is_grad_enabled() else rerun).add(path.id)
        return sizes, aliases, cost

    def running(self, path, remat):
        if remat:
            recomputed.add(path.id)
        return run(self, path, remat)

    monkeypatch.setattr(TorchExecutor, "probe", probing)
    monkeypatch.setattr(TorchExecutor, "run", running)
    return made_in_backward, rerun, recomputed


def by_elements(func, args, kwargs, out) -> float:
    """A price that depends on the op's outputs alone: 1 µs plus 1 ns per element."""
    outs = out if isinstance(out, (list, tuple)) else [out]
    return 1e-6 + 1e-9 * sum(t.numel() for t in outs if isinstance(t, torch.Tensor))


def grads(model, loss_fn, budget=None, policy="dtr-eq", cost="model"):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    if budget is None:
        loss_fn(model).backward()
        session = None
    else:
        with membudget.budget(budget, policy, cost=cost) as session:
            loss_fn(model).backward()
    return [p.grad.clone() for p in model.parameters()], session


@pytest.mark.parametrize("policy", ["dtr-eq", "coop"])
def test_no_value_of_the_backward_pass_is_recomputed(runs, policy):
    model, loss_fn = vit()
    ref, _ = grads(copy.deepcopy(model), loss_fn)
    _, free = grads(model, loss_fn, 10**10)
    made_in_backward, _, recomputed = runs
    made_in_backward.clear()
    got, session = grads(model, loss_fn, int(free.stats.peak_bytes * 0.5), policy)
    assert session.stats.remat_ops > 0 and made_in_backward and recomputed
    assert not made_in_backward & recomputed
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_a_forward_that_checkpoint_reruns_in_backward_stays_evictable(runs):
    """torch.utils.checkpoint reruns its blocks' forward inside backward with gradient mode
    on: those values are forward values, evicted and recomputed like any other. Ops are
    priced by their output elements, the same on every machine: with the measured cpu spec,
    which of them DTR recomputes depends on how fast this machine's matmuls ran (a clean
    CI measured 43 GFLOP/s beside other jobs, and recomputed no rerun value at 0.6)."""
    model, loss_fn = checkpointed()
    ref, _ = grads(copy.deepcopy(model), loss_fn)
    _, free = grads(model, loss_fn, 10**10)
    made_in_backward, rerun, recomputed = runs
    rerun.clear()
    recomputed.clear()
    got, _ = grads(model, loss_fn, int(free.stats.peak_bytes * 0.6), cost=by_elements)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert not made_in_backward & recomputed and rerun & recomputed
