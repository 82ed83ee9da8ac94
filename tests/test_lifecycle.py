"""The training loop people actually write: sessions across steps, state that outlives a
session, saving inside one, an error caught and training continued, nesting and threads.

The models here (a small Llama, a CNN with in-place ReLU and residual ``+=``) appear in no
other test. Every comparison with eager PyTorch is bitwise: CPU kernels are deterministic
and recomputation restores the RNG state.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import re
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_compact import optimizer_tensors
from torch import nn

import membudget
from membudget import BudgetRaisedWarning, BudgetTooSmallError, MembudgetError
from membudget.bench.meter import StorageMeter
from membudget.runtime.tensor import RematTensor


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attention_dropout=0.1)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (4, 64))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.bn(self.conv1(x)))
        y = self.conv2(y)
        y += x  # residual, in place
        return self.relu(y)


def cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
                          *[Block(8) for _ in range(3)], nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    return model, lambda m: F.cross_entropy(m(x), y)


OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw-for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def peak_of(model, loss_fn, make_opt):
    """The most a session of one whole step (forward, backward, optimizer) holds with no
    limit, over a first step and one with the optimizer's state made."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    peaks = []
    for _ in range(2):
        with membudget.budget(10**10) as s:
            loss_fn(model).backward()
            opt.step()
        peaks.append(s.stats.peak_bytes)
    return max(peaks)


def train(model, loss_fn, make_opt, steps, budget=None, decorated=False):
    """``steps`` steps, each in a session of its own (none if ``budget`` is None); the
    losses and the parameters after each step."""
    torch.manual_seed(1)
    opt = make_opt(model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        return loss

    session = membudget.budget(budget) if budget is not None else None
    if decorated:
        step = session(step)
    losses, params, evictions = [], [], 0
    for _ in range(steps):
        if session is None or decorated:
            loss = step()
        else:
            with session:
                loss = step()
        if session is not None:
            evictions += session.stats.evictions
        assert type(loss) is torch.Tensor  # handed back as a plain tensor
        losses.append(loss.detach().clone())
        params.append([p.detach().clone() for p in model.parameters()])
    for value in opt.state_dict()["state"].values():
        for v in value.values():
            assert type(v) is torch.Tensor
    assert session is None or evictions > 0  # the budget was tight enough to matter
    return losses, params


def assert_bitwise(got, ref):
    for (la, pa), (lb, pb) in zip(zip(*got, strict=True), zip(*ref, strict=True), strict=True):
        assert torch.equal(la, lb)
        for a, b in zip(pa, pb, strict=True):
            assert torch.equal(a, b)


def tight(model, loss_fn, make_opt, state_per_param):
    """A budget halfway between what an optimizer step must hold at once (parameters,
    gradients and ``state_per_param`` state tensors per parameter) and the unlimited peak:
    the activations must be evicted and recomputed."""
    floor = sum(p.numel() * p.element_size() for p in model.parameters()) * (
        2 + state_per_param)
    peak = peak_of(model, loss_fn, make_opt)
    assert peak > floor
    return (floor + peak) // 2


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("build", [llama, cnn], ids=["llama", "cnn"])
def test_one_session_per_step_with_a_stateful_optimizer_is_bitwise_eager(build, opt):
    model, loss_fn = build()
    make = OPTIMIZERS[opt]
    budget = tight(model, loss_fn, make, 1 if opt == "sgd-momentum" else 2)
    ref = train(copy.deepcopy(model), loss_fn, make, 3)
    got = train(copy.deepcopy(model), loss_fn, make, 3, budget=budget)
    assert_bitwise(got, ref)


@pytest.mark.parametrize("micro", [1, 2], ids=["one-session", "two-micro-batches"])
def test_what_an_earlier_session_left_alive_counts_from_the_next_ones_start(micro):
    """A meter around the whole loop, not per session: AdamW's state from the first step
    and (accumulating over two sessions) the gradients of the first micro-batch are alive
    through the forward and backward of the next session, so they count from its start.
    Before, the state entered only when the optimizer stepped and the gradients when
    backward reached them, and real memory passed the budget by them (1.30x on an MLP)."""
    model, loss_fn = llama()
    make = OPTIMIZERS["adamw-foreach"]
    budget = tight(model, loss_fn, make, 2)

    def loop(m, budget):
        torch.manual_seed(1)
        opt, losses = make(m.parameters()), []
        for _ in range(3):
            for i in range(micro):
                with membudget.budget(budget) if budget else contextlib.nullcontext():
                    loss = loss_fn(m)
                    loss.backward()
                    if i == micro - 1:
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
                del loss
        return losses

    ref = copy.deepcopy(model)
    ref_losses = loop(ref, None)
    with StorageMeter() as meter:
        losses = loop(model, budget)
    assert meter.peak_bytes <= budget
    assert losses == ref_losses
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_run_resumed_from_a_checkpoint_counts_the_loaded_optimizers_state_at_once():
    """Resumed from a checkpoint: a new model and a new AdamW loaded from it, the optimizer
    stepping after each session. Its state is alive through the first resumed session,
    though it has not stepped yet, so the session finds it and counts it from the start.
    Before, an optimizer was known only once it had stepped, and a meter that counts the
    state saw the budget overrun by it in the first resumed step."""
    model, loss_fn = llama()
    make = OPTIMIZERS["adamw-foreach"]
    budget = tight(model, loss_fn, make, 2)

    def step(m, opt, budget):
        with StorageMeter() as meter:
            meter.count([*m.parameters(), *optimizer_tensors(opt)])
            with membudget.budget(budget) if budget else contextlib.nullcontext():
                loss = loss_fn(m)
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item(), meter.peak_bytes

    torch.manual_seed(1)
    ref = copy.deepcopy(model)
    ref_opt = make(ref.parameters())
    ref_losses = [step(ref, ref_opt, None)[0] for _ in range(4)]
    torch.manual_seed(1)
    opt = make(model.parameters())
    losses = [step(model, opt, budget)[0] for _ in range(2)]
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    del model, opt
    buf.seek(0)
    checkpoint = torch.load(buf)
    rng = torch.get_rng_state()  # (llama() seeds its own; dropout goes on from here)
    model, _ = llama()
    torch.set_rng_state(rng)
    model.load_state_dict(checkpoint["model"])
    opt = make(model.parameters())
    opt.load_state_dict(checkpoint["opt"])
    del checkpoint
    for _ in range(2):
        loss, peak = step(model, opt, budget)
        losses.append(loss)
        assert peak <= budget
    assert losses == ref_losses
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_decorated_step_function_across_steps_is_bitwise_eager():
    model, loss_fn = cnn()
    make = OPTIMIZERS["adamw-foreach"]
    budget = tight(model, loss_fn, make, 2)
    ref = train(copy.deepcopy(model), loss_fn, make, 3)
    got = train(copy.deepcopy(model), loss_fn, make, 3, budget=budget, decorated=True)
    assert_bitwise(got, ref)


def test_a_tensor_made_in_one_session_is_written_in_place_in_a_later_one():
    x = torch.arange(4.0)
    with membudget.budget("1 MiB"):
        y = x * 2.0
    assert type(y) is torch.Tensor and "RematTensor" not in repr(y)
    with membudget.budget("1 MiB"):
        y += 1.0
        y.mul_(2.0)
    assert y.tolist() == [2.0, 6.0, 10.0, 14.0]


def test_torch_save_inside_a_session_writes_plain_tensors_that_load_back_equal(tmp_path):
    model, loss_fn = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with membudget.budget(10**9):
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        assert type(loss) is RematTensor and type(opt.state[model.lm_head.weight]["exp_avg"]) \
            is RematTensor
        torch.save(model.state_dict(), tmp_path / "model.pt")
        torch.save(opt.state_dict(), tmp_path / "opt.pt")
        torch.save({"loss": loss, "step": 1}, tmp_path / "loss.pt")
        pickled = pickle.dumps(loss)
        assert repr(loss).startswith("tensor(") and "grad_fn=" in repr(loss)
    model_sd, opt_sd = torch.load(tmp_path / "model.pt"), torch.load(tmp_path / "opt.pt")
    for k, v in model.state_dict().items():
        assert type(model_sd[k]) is torch.Tensor and torch.equal(model_sd[k], v)
    for k, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            assert type(opt_sd["state"][k][name]) is torch.Tensor
            assert torch.equal(opt_sd["state"][k][name], v)
    assert torch.equal(torch.load(tmp_path / "loss.pt")["loss"], loss)
    assert torch.equal(pickle.loads(pickled), loss)
    buf = io.BytesIO()
    torch.save(loss, buf)  # after the session too
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue())), loss)


def _mlp(width: int = 256):
    """Parameters dominate its memory: a budget can fit forward and backward but not the
    optimizer's temporaries, or forward but not backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                          nn.Tanh(), nn.Linear(width, 10))
    x, y = torch.randn(4, width), torch.randint(0, 10, (4,))
    return model, lambda m: F.cross_entropy(m(x), y)


def _eager_step(model, loss_fn, opt):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    opt.step()
    return loss.detach()


def _fail_in(phase: str):
    """Train one eager step (so the optimizer has state), then fail the next in a session in
    ``phase``; return the model, optimizer and loss function, and the error."""
    model, loss_fn = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    _eager_step(model, loss_fn, opt)
    params = sum(p.numel() * 4 for p in model.parameters())
    # forward needs the parameters, AdamW's two moments and a little; backward the
    # gradients too; the update of AdamW (foreach) makes whole lists of temporaries
    budget = int(params * (3.2 if phase == "backward" else 4.5))
    opt.zero_grad(set_to_none=True)
    reached = "forward"
    with pytest.raises(BudgetTooSmallError) as err, membudget.budget(budget):
        loss = loss_fn(model)
        reached = "backward"
        loss.backward()
        reached = "optimizer"
        opt.step()
    assert reached == phase, (phase, str(err.value))
    return model, opt, loss_fn, loss


def test_a_failure_in_backward_leaves_plain_state_and_eager_training_goes_on():
    """A failed backward changed only gradients: after zero_grad, training continues as if
    the failed step never ran (bitwise)."""
    model, opt, loss_fn, loss = _fail_in("backward")
    if type(loss) is not torch.Tensor:  # evicted when it failed: not recomputed after it
        assert "value lost" in repr(loss)
        with pytest.raises(MembudgetError, match="lost when its membudget session failed"):
            loss.item()
    for p in model.parameters():
        assert p.grad is None or type(p.grad) is torch.Tensor
    ref_model, ref_loss_fn = _mlp()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=True)
    _eager_step(ref_model, ref_loss_fn, ref_opt)
    for _ in range(2):
        assert torch.equal(_eager_step(model, loss_fn, opt),
                           _eager_step(ref_model, ref_loss_fn, ref_opt))
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_failure_in_the_optimizer_step_leaves_plain_state_and_eager_training_goes_on():
    """A failed optimizer step may have updated part of the optimizer's state (AdamW's step
    counts first): what the program holds stays usable and training continues."""
    model, opt, loss_fn, _ = _fail_in("optimizer")
    for st in opt.state.values():
        for v in st.values():
            assert type(v) is torch.Tensor and torch.isfinite(v).all()
    for p in model.parameters():
        assert type(p.grad) is torch.Tensor
    losses = [_eager_step(model, loss_fn, opt) for _ in range(3)]
    assert all(torch.isfinite(x) for x in losses)


def test_optimizer_state_made_in_a_failed_first_step_comes_back_with_its_eager_values():
    """A fresh optimizer makes its state (``zeros_like``, cheap to evict) inside a session
    that then fails in the update: every state tensor comes back, recomputed if it was
    evicted, holding what eager AdamW had made of it by then (its zeros, or the first
    moment updates), bitwise; training then goes on eagerly."""
    model, loss_fn = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    params = sum(p.numel() * 4 for p in model.parameters())
    reached = ""
    # (at 4 × the parameters it fails in the update of the third parameter)
    with pytest.raises(BudgetTooSmallError), membudget.budget(int(params * 4.0)) as session:
        loss = loss_fn(model)
        loss.backward()
        reached = "optimizer"
        opt.step()
    assert reached == "optimizer" and session.stats.evictions > 0
    ref, ref_loss_fn = _mlp()
    ref_loss_fn(ref).backward()
    b1, b2 = opt.defaults["betas"]
    made = {"exp_avg": 0, "exp_avg_sq": 0}
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        st, g = opt.state[p], q.grad
        assert all(type(v) is torch.Tensor for v in st.values())
        zero = torch.zeros_like(g)
        first = {"exp_avg": zero.clone().lerp_(g, 1 - b1),
                 "exp_avg_sq": zero.clone().mul_(b2).addcmul_(g, g, value=1 - b2)}
        for k in made:
            made[k] += int(not torch.equal(st[k], zero))
            assert torch.equal(st[k], zero) or torch.equal(st[k], first[k]), k
    assert 0 < made["exp_avg"] < len(opt.state)  # the step failed midway
    losses = [_eager_step(model, loss_fn, opt) for _ in range(3)]
    assert all(torch.isfinite(x) for x in losses)


def test_sessions_do_not_nest_and_the_outer_one_goes_on():
    x = torch.arange(4.0)
    inner = membudget.budget("1 MiB")

    @inner
    def decorated():
        return x * 3.0

    with membudget.budget("1 MiB") as outer:
        y = x * 2.0
        with pytest.raises(MembudgetError, match="do not nest"), membudget.budget("1 MiB"):
            pass
        with pytest.raises(MembudgetError, match="do not nest"):
            decorated()
        z = y + 1.0
        assert type(z) is RematTensor and z._ref.session is outer
    assert z.tolist() == [1.0, 3.0, 5.0, 7.0]
    assert decorated().tolist() == [0.0, 3.0, 6.0, 9.0]  # on its own it works


def test_another_thread_using_session_tensors_is_warned_once():
    x = torch.arange(4.0)
    results = []
    with membudget.budget("1 MiB"):
        y = x * 2.0

        def work():
            results.append((y + 1.0).tolist())
            results.append((y * 2.0).tolist())

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            t = threading.Thread(target=work)
            t.start()
            t.join()
    ours = [w for w in seen if "runs outside its budget" in str(w.message)]
    assert len(ours) == 1
    assert results == [[1.0, 3.0, 5.0, 7.0], [0.0, 4.0, 8.0, 12.0]]


def test_the_suggested_budget_is_accepted_as_printed():
    model, loss_fn = cnn()
    params = sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(BudgetTooSmallError) as err, membudget.budget(params + 20_000):
        loss_fn(model).backward()
    message = str(err.value)
    printed = re.search(r"needs a budget of at least ([\d,]+ B)", message).group(1)
    assert "a lower bound" in message and "--min-budget" in message
    session = membudget.budget(printed)
    assert session.budget_bytes == err.value.needed_bytes
    try:  # at that budget the op that failed fits: the run completes, or fails further on
        with session:
            loss_fn(model).backward()
    except BudgetTooSmallError as later:
        assert later.needed_bytes > err.value.needed_bytes or later.op != err.value.op


def test_torch_save_of_evicted_values_never_fails_half_written(tmp_path):
    """torch.save holds every storage it saves until it writes the file: inside a session
    each value is materialized and pinned as it is pickled, so the engine counts what the
    save holds, and where the budget cannot hold them all it is raised (and says by how
    much) rather than failing with the file half-written."""
    torch.manual_seed(0)
    x = torch.randn(512, 256)

    def chain():  # twelve 512 KiB activations, all held (elementwise: bitwise repeatable)
        acts = [x]
        for _ in range(12):
            acts.append(torch.tanh(acts[-1] * 1.5 + 0.25))
        return acts[1:]

    ref = chain()
    budget = 7 * 2**19  # x, five activations and room for an op
    said = r"raised by [\d,]+ B to hold the values the program held at once \(stats"
    with (pytest.warns(BudgetRaisedWarning, match=said + r"\.beyond_budget_bytes\)\. Let go"),
          StorageMeter() as meter, membudget.budget(budget) as session):
        acts = chain()
        torch.save({"acts": acts}, tmp_path / "acts.pt")
        del acts  # (nothing left to hand out: what is raised, the save raised)
    assert session.stats.evictions > 0 and session.stats.beyond_budget_bytes > 0
    assert meter.peak_bytes <= budget + session.stats.beyond_budget_bytes
    saved = torch.load(tmp_path / "acts.pt")["acts"]
    assert all(torch.equal(a, b) for a, b in zip(saved, ref, strict=True))


def test_values_held_past_the_budget_at_the_end_are_handed_back_and_the_raise_is_said():
    """The program holds more than the budget when the session ends: the evicted values it
    holds are recomputed and handed back, the budget raised only by what they need beyond
    it (real memory within the raised budget), and a warning says by how much and why."""
    torch.manual_seed(0)
    x = torch.randn(512, 256)

    def chain():  # twelve 512 KiB activations, all held
        acts = [x]
        for _ in range(12):
            acts.append(torch.tanh(acts[-1] * 1.5 + 0.25))
        return acts[1:]

    ref = chain()
    budget = 7 * 2**19
    with (pytest.warns(BudgetRaisedWarning) as caught, StorageMeter() as meter,
          membudget.budget(budget) as session):
        acts = chain()
    st = session.stats
    assert st.evictions > 0 and 0 < st.beyond_budget_bytes < 12 * 2**19
    assert meter.peak_bytes <= budget + st.beyond_budget_bytes
    evicted = int(re.search(r"; ([\d,]+) values", str(caught[0].message))[1].replace(",", ""))
    assert 0 < evicted <= st.evictions
    assert all(type(a) is torch.Tensor and torch.equal(a, b)
               for a, b in zip(acts, ref, strict=True))


def test_autograd_history_outlives_the_session():
    """A leaf made inside stays a leaf with its gradient; an output keeps its history, so
    a backward pass after the session reaches the parameters (as eager would)."""
    with membudget.budget("1 MiB"):
        w = torch.zeros(3, requires_grad=True)
        (w * 2.0).sum().backward()
    assert type(w) is torch.Tensor and w.is_leaf and w.requires_grad
    assert w.grad.tolist() == [2.0, 2.0, 2.0]

    model, loss_fn = cnn()
    ref_model = copy.deepcopy(model)
    torch.manual_seed(1)
    loss_fn(ref_model).backward()
    with membudget.budget(10**9):
        torch.manual_seed(1)
        loss = loss_fn(model)
    assert type(loss) is torch.Tensor and loss.grad_fn is not None
    loss.backward()  # outside the session
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def train_with_copies(budget, built_inside):
    """Three SGD steps of the CNN, a session each (none if ``budget`` is None), in a loop that
    keeps copies as users do: ``copy.deepcopy(model)`` in the first step starts an EMA that
    later steps update in place, and every step keeps a snapshot. With ``built_inside`` the
    model is built in the first session, so its parameters are still the engine's (with
    gradients) when they are copied. Returns the EMA, the snapshots, the meter's peaks and
    the evictions."""
    model = None if built_inside else cnn()
    opt = ema = None
    snapshots, peaks, evictions = [], [], 0
    for _ in range(3):
        session = membudget.budget(budget) if budget is not None else None
        with StorageMeter() as meter, session or contextlib.nullcontext():
            if model is None:
                model = cnn()
            net, loss_fn = model
            if opt is None:
                opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            opt.zero_grad(set_to_none=False)
            loss_fn(net).backward()
            opt.step()
            if ema is None:
                ema = copy.deepcopy(net)
            with torch.no_grad():
                for e, p in zip(ema.parameters(), net.parameters(), strict=True):
                    e.lerp_(p, 0.1)
            snapshots.append(copy.deepcopy(net))
        peaks.append(meter.peak_bytes)
        evictions += session.stats.evictions if session is not None else 0
    return ema, snapshots, peaks, evictions


@pytest.mark.parametrize("built_inside", [False, True], ids=["built-before", "built-inside"])
def test_models_deep_copied_inside_sessions_are_parameters_equal_to_eager(built_inside):
    """Before: deep-copying a plain tensor (a buffer) in a session failed (torch's copy
    asks ``new_empty`` for a plain tensor and got a wrapper), so did a wrapper's (its engine
    handle was copied), and the parameters of a model built in a session left it as plain
    tensors, no longer ``nn.Parameter``."""
    ref_ema, ref_snaps, _, _ = train_with_copies(None, built_inside)
    _, _, free_peaks, _ = train_with_copies(10**10, built_inside)
    budget = int(0.8 * max(free_peaks))
    ema, snaps, peaks, evictions = train_with_copies(budget, built_inside)
    assert max(peaks) <= budget < max(free_peaks) and evictions > 0
    for got, ref in zip([ema, *snaps], [ref_ema, *ref_snaps], strict=True):
        for (name, p), q in zip(got.named_parameters(), ref.parameters(), strict=True):
            assert type(p) is nn.Parameter and p.requires_grad, name
            assert torch.equal(p, q) and p.grad is None and q.grad is None, name
        for b, c in zip(got.buffers(), ref.buffers(), strict=True):
            assert type(b) is torch.Tensor and torch.equal(b, c)
    with membudget.budget(budget):  # a copy trains like any model
        snaps[-1](torch.randn(2, 3, 16, 16)).sum().backward()
    assert all(type(p.grad) is torch.Tensor for p in snaps[-1].parameters())


def test_tensors_deep_copied_inside_a_session_are_copied_as_torch_copies_them():
    """A leaf's gradient and attributes come along; views of one storage (a plain tensor's
    or the session's) copy to views of one copy, so a write through one shows in the others,
    in the session and after it; the originals are untouched."""
    b = torch.arange(10.0)

    def make():
        w = torch.arange(3.0, requires_grad=True)
        w.tag = "w"
        (w * 2.0).sum().backward()
        h = b * 1.0
        c = copy.deepcopy([w, b, b[2:5], h, h.view(2, 5)[:, 1]])
        c[1][3] = 100.0
        c[3][6] = 60.0
        return c

    ref = make()
    with membudget.budget("1 MiB"):
        got = make()
        assert all(type(t) is RematTensor for t in got)
    assert torch.equal(b, torch.arange(10.0))
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r) and g.requires_grad == r.requires_grad
    assert type(got[0]) is torch.Tensor and got[0].is_leaf and got[0].tag == "w"
    assert torch.equal(got[0].grad, ref[0].grad)
    got[1][4] = ref[1][4] = 50.0
    assert torch.equal(got[2], ref[2]) and got[2].tolist() == [2.0, 100.0, 50.0]


def test_a_model_built_in_a_session_converts_with_to_inside_it_as_eager_does():
    """``module.to(dtype)`` sets ``.data`` of each parameter when the old and new tensors are
    of one kind, as two wrappers are: each wrapper took the float64 metadata but kept
    standing for its float32 value (a matmul then refused the mixed dtypes). Now it stands
    for the converted value: values and gradients equal eager's, bitwise, and the
    parameters leave the session as float64 ``nn.Parameter`` s. ``.data =`` with a tensor
    from outside the session is refused by name."""
    def run(inside=None):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(torch.float64)
        x = torch.randn(32, 8, dtype=torch.float64)
        m(x).pow(2).mean().backward()
        if inside is not None:
            with pytest.raises(MembudgetError, match=r"takes only a tensor made in that session"):
                m[0].bias.data = inside
        return m

    ref = run()
    outside = torch.zeros(16, dtype=torch.float64)
    with membudget.budget("1 MiB"):
        got = run(outside)
    for p, q in zip(got.parameters(), ref.parameters(), strict=True):
        assert type(p) is nn.Parameter and p.dtype == torch.float64
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def test_a_parameter_from_before_the_session_given_a_sessions_data_is_named_and_the_fix_works():
    """``p.data = new`` with ``new`` made in the session gives a plain parameter a wrapper's
    storage, which has no data: the next op failed in torch ("data is not allocated yet").
    It is now named, with the fix, and the fix (writing the values in) trains as eager."""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with (pytest.raises(MembudgetError, match=r"p\.data = new.*p\.copy_\(new\)"),
          membudget.budget("1 MiB"), torch.no_grad()):
        m.weight.data = m.weight * 0.5
        m(x)
    torch.manual_seed(0)
    m, ref = nn.Linear(4, 4), nn.Linear(4, 4)
    ref.load_state_dict(m.state_dict())
    for net, budget in ((m, "1 MiB"), (ref, None)):
        with membudget.budget(budget) if budget else contextlib.nullcontext():
            with torch.no_grad():
                net.weight.copy_(net.weight * 0.5)
            net(x).sum().backward()
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.weight.grad, ref.weight.grad)


def test_an_activation_that_retains_its_grad_is_handed_back_with_it():
    """``retain_grad()`` makes autograd hold a weak reference to the tensor itself, so torch
    refuses to swap it for a plain one at the session's end (before: RuntimeError "Expected
    no weakrefs" from the session's exit, also hiding a BudgetTooSmallError). It stays a
    wrapper holding its value, with its gradient, and computes as the eager one does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(64, 16)
    ref = copy.deepcopy(model)
    h_ref = ref[0](x)
    h_ref.retain_grad()
    ref[1:](h_ref).pow(2).mean().backward()
    with membudget.budget("1 GB"):
        h = model[0](x)
        h.retain_grad()
        model[1:](h).pow(2).mean().backward()
    assert torch.equal(h.grad, h_ref.grad) and torch.equal(h, h_ref)
    with membudget.budget("1 GB"):  # a later session reads it like any tensor
        assert torch.equal((h * 2).sum(), (h_ref * 2).sum())
    with pytest.raises(membudget.BudgetTooSmallError), membudget.budget(4096):
        h = model[0](x)
        h.retain_grad()
        model[1:](h).pow(2).mean().backward()


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_code_runs_eagerly_inside_a_session_and_its_stance_comes_back():
    """A compiled graph's kernels allocate where the session cannot see them: inside a
    session torch.compile'd code runs eagerly, so the step is eager's bitwise and within the
    budget, and dynamo does not trace into the session (before: dozens of its warnings and
    graph breaks). The compiler's stance comes back when the session ends."""
    from torch._dynamo import eval_frame

    from membudget.bench.meter import StorageMeter

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(10) for m in (nn.Linear(64, 64), nn.GELU())],
                          nn.Linear(64, 1))
    x = torch.randn(4096, 64)
    ref = copy.deepcopy(model)
    ref_loss = ref(x).pow(2).mean()
    ref_loss.backward()
    compiled = torch.compile(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with membudget.budget(10**10) as free:
            compiled(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        budget = free.stats.peak_bytes // 2
        with StorageMeter() as meter, membudget.budget(budget) as session:
            loss = compiled(x).pow(2).mean()
            loss.backward()
    assert not [str(w.message) for w in caught if "_dynamo" in w.filename]
    assert session.stats.evictions > 0 and meter.peak_bytes <= budget
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert eval_frame._stance.stance == "default"
