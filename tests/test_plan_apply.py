"""Applying a static plan: a real step run in the planned order gives the eager step's loss
and gradients bitwise, and its measured peak is that of the order it ran."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from membudget.plan.apply import apply_plan


def mlp():
    layers: list[nn.Module] = [nn.Linear(32, 128)]
    for _ in range(4):
        layers += [nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128)]
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    return nn.Sequential(*layers, nn.Linear(128, 10)), (x, y)


def cnn():
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Dropout(0.2), nn.Flatten(), nn.Linear(16 * 8 * 8, 10))
    return model, (torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32, vocab_size=128)
    ids = torch.randint(0, 128, (2, 32))
    return GPT2LMHeadModel(config), (ids, ids)


def gpt2_loss(model, batch):
    return model(input_ids=batch[0], labels=batch[1]).loss


def reading_loss(model, batch):
    """A loss whose program reads a value midway (a get event: a plan node with no op)."""
    out = model(batch[0])
    assert len(out.detach().tolist()) == len(batch[1])
    return F.cross_entropy(out, batch[1])


@pytest.mark.parametrize("make", [mlp, cnn, gpt2], ids=["mlp", "cnn-batchnorm", "gpt2"])
def test_a_step_run_in_the_planned_order_equals_the_eager_step(make):
    torch.manual_seed(0)
    model, batch = make()
    model.train()
    loss_fn = gpt2_loss if make is gpt2 else reading_loss
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    ref_loss = loss_fn(eager, batch)
    ref_loss.backward()
    torch.manual_seed(1)
    applied = apply_plan(model, batch, loss_fn, time_limit=5)
    assert torch.equal(applied.loss, ref_loss.detach())
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for a, b in zip(model.buffers(), eager.buffers(), strict=True):  # BatchNorm statistics
        torch.testing.assert_close(a, b)
    plan = applied.plan
    assert plan.max_live <= plan.recorded_peak
    # what the step held in each order, measured, follows what the plan predicted
    assert applied.planned_peak <= applied.recorded_peak
    assert abs(applied.planned_peak - plan.max_live) <= 0.02 * plan.max_live
