"""The zoo models built from our own modules (``membudget.models.custom``): published parameter
counts, real training steps at small batches, allocation-free steps at paper batches under
``FakeTensorMode``, and the dynamic-graph models' control flow (SPOS paths, TreeLSTM trees)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from membudget.models import custom
from membudget.models.recurrent import UnrolledLSTM
from membudget.models.zoo import ZOO, Workload

# Output shape of one forward at the paper batch.
PAPER_OUTPUT = {
    "inception-v3": (96, 1000),
    "unet": (5, 2, 460, 608),
    "bilstm": (2048, 2),
    "spos-supernet": (64, 1000),
    "resnet-1202": (64, 10),
    "densenet-121": (70, 1000),
    "transformer": (10, 128, 32000),
    "lstm-lm": (256, 128, 10000),
    "treelstm": (9, 5),
    "alexnet": (32, 1000),
    "vgg-16": (32, 1000),
    "googlenet": (32, 1000),
    "resnet3d-18": (32, 400),
}
NAMES = list(PAPER_OUTPUT)

# Published parameter counts (torchvision's model tables; He et al. 2016 for ResNet-1202;
# Ronneberger et al.'s U-Net with 2 classes).
PUBLISHED_PARAMS = {
    "inception-v3": 23.8e6,  # 27.2M with the aux classifier, which we leave out
    "unet": 31.0e6,
    "resnet-1202": 19.4e6,
    "densenet-121": 8.0e6,
    "alexnet": 61.1e6,
    "vgg-16": 138.4e6,
    "googlenet": 6.6e6,
    "resnet3d-18": 33.4e6,
}

# Models whose live step at small_batch takes over ~3 s on 2 cores; each also has a reduced
# live step in REDUCED below.
SLOW_LIVE = {"unet", "lstm-lm", "resnet3d-18"}
# Models whose allocation-free step at the paper batch takes over ~5 s (thousands of small ops).
SLOW_FAKE = {"resnet-1202"}


def _marked(names: list[str], slow: set[str]) -> list:
    """``names`` as pytest params, the ones in ``slow`` marked slow."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in names]


def _capture_outputs(model: nn.Module) -> list[torch.Tensor]:
    """A list that receives the model's output at every forward."""
    outputs: list[torch.Tensor] = []
    model.register_forward_hook(lambda _m, _i, out: outputs.append(out))
    return outputs


def _trained_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters one step should give a gradient: the sampled path for SPOS, else all."""
    path = getattr(model, "path_parameters", None)
    return list(path()) if path is not None else list(model.parameters())


def _tensors(batch: object) -> list[torch.Tensor]:
    """Every tensor in a batch (tuples, lists and TreeBatch fields)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, tuple | list):
        return [t for item in batch for t in _tensors(item)]
    return _tensors(list(vars(batch).values())) if hasattr(batch, "__dict__") else []


def _step(wl: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward; returns the loss and the model output."""
    outputs = _capture_outputs(wl.model)
    loss = wl.loss(wl.model, wl.batch)
    loss.backward()
    assert len(outputs) == 1
    return loss, outputs[0]


def _assert_finite_gradients(model: nn.Module) -> None:
    """Every parameter the step used has a finite gradient; no other parameter has one."""
    trained = {id(p) for p in _trained_parameters(model)}
    for name, p in model.named_parameters():
        if id(p) in trained:
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all(), name
        else:
            assert p.grad is None, name


def test_custom_registers_exactly_these_models():
    ours = {name for name, entry in ZOO.items() if entry.build.__module__ == custom.__name__}
    assert ours == set(NAMES)
    for name in NAMES:
        entry = ZOO[name]
        assert entry.description and entry.paper
        assert 1 <= entry.small_batch <= entry.batch


@pytest.mark.parametrize("name", NAMES)
def test_meta_build_puts_everything_on_the_default_device(name):
    entry = ZOO[name]
    with torch.device("meta"):
        wl = entry.build(entry.batch)
    tensors = [*wl.model.parameters(), *wl.model.buffers(), *_tensors(wl.batch)]
    assert tensors and all(t.is_meta for t in tensors)
    assert all(t.dtype in (torch.float32, torch.int64) for t in tensors)
    if name in PUBLISHED_PARAMS:
        count = sum(p.numel() for p in wl.model.parameters())
        assert count == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)


@pytest.mark.parametrize("build", [
    lambda: custom.build_transformer(2, length=8),
    lambda: custom.build_lstm_lm(2, steps=3),
    lambda: custom.build_bilstm(2, steps=3),
])
def test_tensors_made_in_forward_follow_the_default_device(build):
    with torch.device("meta"):
        wl = build()
        loss, _ = _step(wl)
    assert loss.is_meta


@pytest.mark.parametrize("name", _marked(NAMES, SLOW_LIVE))
def test_live_step_at_small_batch_gives_finite_gradients(name):
    torch.manual_seed(0)
    entry = ZOO[name]
    wl = entry.build(entry.small_batch)
    loss, out = _step(wl)
    assert torch.isfinite(loss)
    assert out.shape == (entry.small_batch, *PAPER_OUTPUT[name][1:])
    _assert_finite_gradients(wl.model)


# Cheaper inputs for the SLOW_LIVE models, run by default: the same code paths at a glance.
REDUCED = {
    "unet, odd 37×53 input": (lambda: custom.build_unet(1, height=37, width=53), (1, 2, 37, 53)),
    "lstm-lm, 4 steps": (lambda: custom.build_lstm_lm(1, steps=4), (1, 4, 10000)),
    "resnet3d-18, 2 frames": (lambda: custom.build_resnet3d_18(1, frames=2), (1, 400)),
}


@pytest.mark.parametrize("case", list(REDUCED))
def test_live_step_on_reduced_inputs(case):
    build, shape = REDUCED[case]
    torch.manual_seed(0)
    wl = build()
    loss, out = _step(wl)
    assert torch.isfinite(loss) and out.shape == shape
    _assert_finite_gradients(wl.model)


@pytest.mark.parametrize("name", _marked(NAMES, SLOW_FAKE))
def test_paper_batch_step_runs_without_allocating(name):
    entry = ZOO[name]
    with FakeTensorMode():
        wl = entry.build(entry.batch)
        loss, out = _step(wl)
    state = [*wl.model.parameters(), *wl.model.buffers(), *_tensors(wl.batch)]
    assert all(isinstance(t, FakeTensor) for t in state)
    assert isinstance(loss, FakeTensor) and loss.shape == ()
    assert out.shape == PAPER_OUTPUT[name]
    for p in _trained_parameters(wl.model):
        assert isinstance(p.grad, FakeTensor) and p.grad.shape == p.shape


def test_builds_are_deterministic_given_the_torch_seed():
    for name in ("spos-supernet", "treelstm", "bilstm"):
        losses = []
        for _ in range(2):
            torch.manual_seed(3)
            wl = ZOO[name].build(1)
            losses.append(wl.loss(wl.model, wl.batch))
        assert torch.equal(losses[0], losses[1]), name


def test_unrolled_lstm_matches_torch_lstm():
    torch.manual_seed(0)
    reference = nn.LSTM(5, 7, batch_first=True, bidirectional=True)
    forward, backward = UnrolledLSTM(5, 7), UnrolledLSTM(5, 7, reverse=True)
    for layer, suffix in ((forward, "_l0"), (backward, "_l0_reverse")):
        for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(layer, p).data.copy_(getattr(reference, p + suffix))
    x = torch.randn(3, 6, 5)
    expected, _ = reference(x)
    got = torch.cat([torch.stack(forward(x), 1), torch.stack(backward(x), 1)], 2)
    torch.testing.assert_close(got, expected)


def test_transformer_layers_have_nn_transformer_parameter_count():
    with torch.device("meta"):
        reference = sum(p.numel() for p in nn.Transformer(batch_first=True).parameters())
        ours = custom.build_transformer(1).model
    assert sum(p.numel() for p in ours.core.parameters()) == reference


def _spos_paths(seed: int, forwards: int, torch_seed: int) -> list[tuple[int, ...]]:
    """The paths a fresh SPOS supernet with path seed ``seed`` takes on consecutive forwards
    (of small images: the path does not depend on the input)."""
    torch.manual_seed(torch_seed)
    model = custom.build_spos_supernet(1, seed=seed).model
    paths = []
    for _ in range(forwards):
        model(torch.randn(2, 3, 32, 32))
        paths.append(model.last_path)
    return paths


def test_spos_samples_a_new_path_each_forward_from_its_own_seed():
    paths = _spos_paths(seed=0, forwards=3, torch_seed=0)
    assert len(paths[0]) == 20 and all(0 <= c < 4 for c in paths[0])
    assert len(set(paths)) == 3
    # Same model seed, different torch seed: the same sequence (torch's RNG is not used).
    assert _spos_paths(seed=0, forwards=3, torch_seed=1) == paths
    assert _spos_paths(seed=1, forwards=3, torch_seed=0) != paths


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _tree_ops(seed: int) -> tuple[int, int]:
    """(leaf count, ops of one forward and backward) of the TreeLSTM on tree ``seed``."""
    wl = custom.build_treelstm(1, seed=seed)
    with _OpCounter() as counter:
        wl.loss(wl.model, wl.batch).backward()
    return len(wl.batch.leaves), counter.ops.total()


def test_treelstm_graph_follows_the_tree():
    same = [custom.build_treelstm(1, seed=4).batch.tree for _ in range(2)]
    assert same[0] == same[1]
    ops_by_size: dict[int, set[int]] = {}
    for seed in range(6):
        leaves, ops = _tree_ops(seed)
        ops_by_size.setdefault(leaves, set()).add(ops)
    # A binary tree's size fixes its node count, so op counts differ exactly when sizes do.
    assert len(ops_by_size) >= 2
    assert all(len(ops) == 1 for ops in ops_by_size.values())
    assert len(set().union(*ops_by_size.values())) == len(ops_by_size)
