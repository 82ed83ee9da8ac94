"""The live runtime: real training under a budget gives the gradients of an unconstrained run.

Each model is trained one step without any session (the reference), then under budgets that
are fractions of its unconstrained session peak, with dtr, dte, coop and the default
(dtr-compact, which moves values to merge free blocks). Where the budget
suffices, the loss and every gradient must be bitwise equal to the reference (CPU kernels are
deterministic, and recomputations restore the RNG state) and the engine's peak must stay
within the budget; where it does not, the error must say what was needed.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import membudget
from membudget import BudgetTooSmallError
from membudget.bench.meter import StorageMeter
from membudget.runtime.session import Session
from membudget.runtime.tensor import RematTensor

POLICIES = ["dtr", "dte", "coop", "default"]


def mlp():
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, 128)]
    for _ in range(6):
        layers += [nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128)]
    model = nn.Sequential(*layers, nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(256, 32), torch.randint(0, 10, (256,))
    return model, lambda m: F.cross_entropy(m(x), y)


def cnn():
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(4):
        layers += [nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Dropout(0.1),
                   nn.Conv2d(8, 8, 3, padding=1)]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    x, y = torch.randn(32, 3, 8, 8), torch.randint(0, 10, (32,))
    return model, lambda m: F.cross_entropy(m(x), y)


def lstm():
    torch.manual_seed(0)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.rnn = nn.LSTM(32, 64, num_layers=2, batch_first=True, dropout=0.1)
            self.out = nn.Linear(64, 50)

        def forward(self, ids):
            return self.out(self.rnn(self.emb(ids))[0])

    ids = torch.randint(0, 50, (8, 24))
    return LM(), lambda m: F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def tree():
    """A recursive model whose graph depends on the input: a random binary tree."""
    torch.manual_seed(0)

    class TreeNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.leaf = nn.Linear(16, 32)
            self.join = nn.Linear(64, 32)
            self.head = nn.Linear(32, 4)

        def forward(self, node):
            if isinstance(node, torch.Tensor):
                return torch.tanh(self.leaf(node))
            left, right = (self(n) for n in node)
            return torch.tanh(self.join(torch.cat([left, right], dim=-1)))

    def build(depth: int, gen: torch.Generator):
        if depth == 0 or torch.rand(1, generator=gen).item() < 0.2:
            return torch.randn(8, 16, generator=gen)
        return (build(depth - 1, gen), build(depth - 1, gen))

    trees = [build(4, torch.Generator().manual_seed(k)) for k in range(2)]
    y = torch.randint(0, 4, (8,))
    return TreeNet(), lambda m: sum(F.cross_entropy(m.head(m(t)), y) for t in trees)


def _hf(model_cls, config):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_cls(config)
    ids = torch.randint(0, config.vocab_size, (4, 16))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return _hf(GPT2LMHeadModel, GPT2Config(n_embd=32, n_layer=3, n_head=2, n_positions=32,
                                           vocab_size=64, bos_token_id=0, eos_token_id=0))


def bert():
    from transformers import BertConfig, BertForMaskedLM

    return _hf(BertForMaskedLM, BertConfig(hidden_size=32, num_hidden_layers=3,
                                           num_attention_heads=2, intermediate_size=64,
                                           vocab_size=64, max_position_embeddings=32))


MODELS = {"mlp": mlp, "cnn": cnn, "lstm": lstm, "tree": tree, "gpt2": gpt2, "bert": bert}


def reset(model, state):
    """Back to ``state`` with no gradients (outside any session: loading writes parameters)."""
    model.load_state_dict(state)
    model.train()
    model.zero_grad(set_to_none=True)


def train_step(model, loss_fn):
    """One step with the same dropout draws each time: loss, and gradients in ``.grad``."""
    torch.manual_seed(1)
    loss = loss_fn(model)
    loss.backward()
    return loss


def reference(model, loss_fn, state):
    reset(model, state)
    loss = train_step(model, loss_fn).detach()
    return loss, [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_same(model, loss, ref):
    ref_loss, ref_grads = ref
    assert type(loss) is torch.Tensor  # a plain tensor once the session closed
    assert torch.equal(loss, ref_loss)
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        if g is None:
            assert p.grad is None
        else:
            assert type(p.grad) is torch.Tensor  # a plain tensor once the session closed
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def run(model, loss_fn, state, nbytes, policy):
    reset(model, state)
    with membudget.budget(nbytes, policy) as session:
        loss = train_step(model, loss_fn)
    assert session.stats.peak_bytes <= nbytes
    return loss, session


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_equal_the_unconstrained_run_under_budgets(name):
    model, loss_fn = MODELS[name]()
    state = copy.deepcopy(model.state_dict())
    ref = reference(model, loss_fn, state)
    _, free = run(model, loss_fn, state, 10**10, "dtr")
    peak = free.stats.peak_bytes
    for policy in POLICIES:
        completed = []
        for ratio in (1.0, 0.5, 0.3):
            try:
                loss, session = run(model, loss_fn, state, int(peak * ratio), policy)
            except BudgetTooSmallError as e:
                assert e.needed_bytes > int(peak * ratio) or e.largest_free_bytes < e.request_bytes
                continue
            assert_same(model, loss, ref)
            completed.append((ratio, session.stats.evictions))
        assert completed and completed[0][0] == 1.0, (policy, completed)
        # the smallest ratio that completes, to 0.05: gradients still exact there
        lo, hi = 0.0, min(r for r, _ in completed)
        while hi - lo > 0.05:
            mid = (lo + hi) / 2
            try:
                loss, _ = run(model, loss_fn, state, int(peak * mid), policy)
                assert_same(model, loss, ref)
                hi = mid
            except BudgetTooSmallError:
                lo = mid
        assert hi < 1.0, policy


def test_a_recomputed_dropout_mask_is_bitwise_identical_and_eviction_frees_the_data():
    import weakref

    x = torch.randn(1000)
    with membudget.budget("64 MiB") as session:
        torch.manual_seed(3)
        y = F.dropout(x * 1.0, p=0.5, training=True)
        first = torch.tensor(y.tolist())  # no op inside the session on the real data
        data = weakref.ref(y.value())
        after = torch.rand(5)  # the generator moved on
        assert session.evict(y)
        assert data() is None  # nothing else kept the real tensor alive
        again = y.value()
        assert session.engine.stats.remat_ops >= 1
        later = torch.rand(5)  # recomputing did not disturb the generator
    assert torch.equal(first, again)
    torch.manual_seed(3)
    F.dropout(x * 1.0, p=0.5, training=True)
    assert torch.equal(after, torch.rand(5))
    assert torch.equal(later, torch.rand(5))


def test_a_budget_too_small_names_the_op_and_leaves_the_process_usable():
    model, loss_fn = mlp()
    state = copy.deepcopy(model.state_dict())
    ref = reference(model, loss_fn, state)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    # below the parameters: they are adopted as the model first runs, and all are counted
    with pytest.raises(BudgetTooSmallError, match=r"parameters, gradients and buffers of "
                       r"Sequential.*needs a budget of at least") as err:
        run(model, loss_fn, state, 50_000, "dtr")
    assert err.value.needed_bytes == params
    # room for them, not for an op's working set: the op is named
    with pytest.raises(BudgetTooSmallError, match=r"aten\.\w+.*needs a budget of at least") as err:
        run(model, loss_fn, state, params + 80_000, "dtr")
    assert err.value.needed_bytes > params + 80_000
    loss, _ = run(model, loss_fn, state, 10**9, "dtr")  # a new session works
    assert_same(model, loss, ref)


def test_an_optimizers_state_is_adopted_at_once_and_named_when_it_does_not_fit():
    """AdamW's state (made in an earlier step) is alive from the session's start: it enters
    with the parameters it updates, in one run, before their module first runs; where they
    cannot all be held, the error names the module and the optimizer and the bytes of all of
    it. An optimizer whose state was loaded and that has not stepped since (torch keeps no
    list of them) is found when the module first runs, since no known optimizer updates its
    parameters; one over a tensor that no module holds brings its state in just before it
    steps, named so. A session with room then steps as eager does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    ref = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref)]
    x = torch.randn(1, 256)
    for m, opt in zip((model, ref), opts, strict=True):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    moments = sum(v.untyped_storage().nbytes() for per in opts[0].state.values()
                  for v in per.values())
    assert moments > 2 * params  # the two moments and the step counts
    with (pytest.raises(BudgetTooSmallError,
                        match=r"adopting the parameters, gradients and buffers of Sequential "
                              r"and the state of AdamW") as err,
          membudget.budget(3 * params, "dtr")):
        model(x).sum().backward()
    assert err.value.request_bytes == params + moments
    loaded = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loaded.load_state_dict(opts[0].state_dict())
    opts[0] = None
    gc.collect()  # (an optimizer is in a reference cycle: until collected, it is known)
    with (pytest.raises(BudgetTooSmallError,
                        match=r"adopting the parameters, gradients and buffers of Sequential "
                              r"and the state of AdamW") as err,
          membudget.budget(3 * params, "dtr")):
        model(x).sum().backward()
    assert err.value.request_bytes == params + moments
    w = torch.randn(256, 256, requires_grad=True)
    first = torch.optim.AdamW([w], lr=1e-3)
    w.sum().backward()
    first.step()
    second = torch.optim.AdamW([w], lr=1e-3)
    second.load_state_dict(first.state_dict())
    first = None
    gc.collect()
    with (pytest.raises(BudgetTooSmallError, match=r"adopting the state of AdamW") as err,
          membudget.budget(4 * w.untyped_storage().nbytes(), "dtr")):
        (x @ w).sum().backward()
        second.step()
    assert err.value.request_bytes == sum(v.untyped_storage().nbytes()
                                          for v in second.state[w].values())
    loaded.zero_grad(set_to_none=True)
    for m, opt, budget in ((model, loaded, 5 * params), (ref, opts[1], None)):
        with membudget.budget(budget) if budget else contextlib.nullcontext():
            m(x).sum().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(),
                                                 strict=True))


def test_a_mode_entered_inside_the_session_does_not_stop_it_adopting_the_model():
    """A dispatch mode the program enters inside the session (a meter, a profiler, planned
    mode's recorder) sits on top of it: the session still adopts each module's parameters
    as a whole before its first op (here more than the budget: named as such). Adopted op
    by op instead, on an address-ordered pool they came to lie among the activations, and
    planned mode's recorded step failed on fragmentation where a dynamic one completed."""
    model, loss_fn = mlp()
    state = copy.deepcopy(model.state_dict())
    ref = reference(model, loss_fn, state)
    with (pytest.raises(BudgetTooSmallError,
                        match=r"parameters, gradients and buffers of Sequential"),
          membudget.budget(50_000), StorageMeter()):
        loss_fn(model).backward()
    loss, _ = run(model, loss_fn, state, 10**9, "dtr")  # and a new session works
    assert_same(model, loss, ref)


def test_a_session_pauses_the_cyclic_collector_and_leaves_it_as_it_found_it():
    x = torch.arange(4.0)
    assert gc.isenabled()
    gc.freeze()  # the program's own frozen objects stay frozen (the session never unfreezes)
    frozen = gc.get_freeze_count()
    try:
        with membudget.budget("1 MiB"):
            assert not gc.isenabled()
            y = x * 2.0
        assert gc.isenabled() and gc.get_freeze_count() == frozen
        with pytest.raises(BudgetTooSmallError), membudget.budget(8):
            x * 2.0
        assert gc.isenabled() and gc.get_freeze_count() == frozen
        gc.disable()  # a program that runs without the collector keeps it off
        with membudget.budget("1 MiB"):
            y = y + 1.0
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0]


def test_no_grad_autograd_grad_accumulation_and_autocast():
    model, _ = mlp()
    x = torch.randn(64, 32)
    with torch.no_grad():
        ref_out = model.eval()(x)
    with membudget.budget("16 MiB"), torch.no_grad():
        out = model(x)
    assert torch.equal(out, ref_out)

    model.train()
    w = next(model.parameters())
    torch.manual_seed(1)
    ref_g = torch.autograd.grad(model(x).square().mean(), w)[0]
    with membudget.budget("16 MiB"):
        torch.manual_seed(1)
        g = torch.autograd.grad(model(x).square().mean(), w)[0]
    assert torch.equal(g, ref_g)

    model.zero_grad(set_to_none=True)
    for k in range(3):  # gradient accumulation over micro-batches
        torch.manual_seed(k)
        model(x[k::3]).square().mean().backward()
    ref_acc = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with membudget.budget("16 MiB"):
        for k in range(3):
            torch.manual_seed(k)
            model(x[k::3]).square().mean().backward()
    for p, g in zip(model.parameters(), ref_acc, strict=True):
        assert torch.equal(p.grad, g)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        ref_bf = model(x)
    with membudget.budget("16 MiB"), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        bf = model(x)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, ref_bf)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_recorded_live_run_replays_with_the_same_decisions(tmp_path, policy):
    from membudget.sim import simulate
    from membudget.trace import load_trace

    model, loss_fn = gpt2()
    state = copy.deepcopy(model.state_dict())
    _, free = run(model, loss_fn, state, 10**10, policy)
    path = tmp_path / "live.jsonl.gz"
    for ratio in (0.5, 0.6, 0.7):  # the first that fits this policy's pool
        budget = int(free.stats.peak_bytes * ratio)
        reset(model, state)
        try:
            with membudget.budget(budget, policy, record=path) as session:
                train_step(model, loss_fn)
            break
        except BudgetTooSmallError:
            continue
    live = session.stats
    assert live.evictions > 0 and live.remat_ops > 0
    sim = simulate(load_trace(path), policy, budget=budget, overhead_limit=None)
    assert sim.status == "ok"
    assert (sim.evictions, sim.remat_ops, sim.peak_bytes) == (
        live.evictions, live.remat_ops, live.peak_bytes)


def test_a_session_records_its_run_only_when_asked(tmp_path):
    from membudget.trace import load_trace
    from membudget.trace.format import CALL

    x = torch.arange(4.0)
    with membudget.budget("1 MiB") as quiet:
        (x * 2.0).sum()
    with pytest.raises(membudget.MembudgetError, match="record=True"):
        quiet.trace(tmp_path / "none.jsonl.gz")
    with membudget.budget("1 MiB", record=True) as kept:
        (x * 2.0).sum()
    events = load_trace(kept.trace(tmp_path / "kept.jsonl.gz")).events
    assert [e[2] for e in events if e[0] == CALL] == ["aten.mul.Tensor", "aten.sum.default"]


def test_budget_works_as_a_decorator_and_a_session_is_reusable():
    model, loss_fn = mlp()
    state = copy.deepcopy(model.state_dict())
    ref = reference(model, loss_fn, state)
    session = membudget.budget("8 MiB", "dte")

    @session
    def step():
        return train_step(model, loss_fn)

    for _ in range(2):
        reset(model, state)
        assert_same(model, step(), ref)
        assert 0 < session.stats.peak_bytes <= 8 * 2**20


def test_reads_of_evicted_values_recompute_them():
    x = torch.arange(6.0)
    with membudget.budget("1 MiB") as session:
        y = x * 2.0
        for read in (lambda t: t.sum().item(), lambda t: t.tolist(), lambda t: t.numpy(),
                     lambda t: repr(t), lambda t: bool((t > 5).any())):
            assert session.evict(y)
            got = read(y)
            assert got is not None
        assert y.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        assert "10." in repr(y) and float(y.sum()) == 30.0
        assert session.engine.stats.remat_ops >= 5


def test_session_stats_add_up_the_time_of_ops_and_of_recomputations():
    """op_seconds sums the ops' first runs and remat_seconds their recomputations, here with
    a cost function that charges 1 ms per op (as a cost model of another device would)."""
    x = torch.arange(6.0)
    session = Session("1 MiB", cost=lambda *_: 1e-3)
    with session:
        y = (x * 2.0).sin()
        assert session.evict(y)
        y.sum().item()
    st = session.stats
    assert st.ops >= 3 and st.remat_ops >= 1  # mul, sin, sum (and item); sin again
    assert st.op_seconds == pytest.approx(1e-3 * st.ops)
    assert st.remat_seconds == pytest.approx(1e-3 * st.remat_ops)


def test_a_cost_function_is_asked_once_per_signature_in_the_process():
    """A session per step prices each op signature only in the first: the prices are kept
    for the process, per cost function, and the steps' stats are the same."""
    asked: list[str] = []

    def cost(func, *_):
        asked.append(str(func))
        return 1e-3

    x = torch.arange(6.0)
    stats = []
    for _ in range(3):
        with Session("1 MiB", cost=cost) as session:
            y = (x * 2.0).sin().sum()
        stats.append((session.stats.ops, session.stats.op_seconds))
    assert float(y) == pytest.approx(float((x * 2.0).sin().sum()))
    assert sorted(asked) == ["aten.mul.Tensor", "aten.sin.default", "aten.sum.default"]
    assert stats[0] == stats[1] == stats[2]


def test_what_escapes_a_session_is_a_plain_value_after_it():
    x = torch.arange(4.0)
    with membudget.budget("1 MiB") as first:
        y = x * 2.0
        dead = x + 1.0
        z = x - 1.0
        assert y.tolist() == [0.0, 2.0, 4.0, 6.0]
    del dead
    ended = weakref.ref(first)
    del first
    gc.collect()
    assert ended() is None  # the wrappers keep their values, not the session
    assert (y + 1.0).tolist() == [1.0, 3.0, 5.0, 7.0]  # outside any session
    with membudget.budget("1 MiB") as second:
        w = y * z  # both from the first session: leaves of this one
        assert type(w) is RematTensor and w._ref.session is second
    assert w.tolist() == [0.0, 0.0, 4.0, 12.0]
    with membudget.budget("1 MiB"):
        inner = x * 3.0
        with pytest.raises(membudget.MembudgetError, match="do not nest"), \
                membudget.budget("1 MiB"):
            inner + 1.0
    assert inner.tolist() == [0.0, 3.0, 6.0, 9.0]


def test_an_inplace_op_reading_what_it_writes():
    x = torch.randn(100)
    ref = (x * 1.5).add_(x * 1.5).mul_(2.0)
    for policy in ("dtr", "coop"):
        with membudget.budget("1 MiB", policy) as session:
            y = x * 1.5
            y.add_(y).mul_(2.0)
            assert session.evict(y)
            assert torch.equal(y.value(), ref)


@pytest.mark.parametrize("policy", ["dtr", "coop"])  # copy-on-write; recomputable in-place
def test_an_inplace_write_copies_the_old_value_only_when_something_may_need_it(policy):
    x = torch.randn(100)
    with membudget.budget("1 MiB", policy) as session:
        y = x * 1.5
        where = y.value().data_ptr()
        y.add_(1.0)  # nothing can need the old y: written where it is, by every policy
        assert y.value().data_ptr() == where
        z = y * 2.0  # computed from this y, so the next write must leave it recoverable
        y.mul_(3.0)  # dtr writes a copy; coop writes in place and can recompute the old y
        assert (y.value().data_ptr() == where) == (policy == "coop")
        assert session.evict(z)
        assert torch.equal(z.value(), (x * 1.5 + 1.0) * 2.0)
        assert torch.equal(y.value(), (x * 1.5 + 1.0) * 3.0)


def test_a_write_through_a_shared_view_keeps_what_was_computed_from_the_old_value():
    """A write the engine cannot version (the storage has another live view) pins what was
    computed from the old contents first: evicting it afterwards is refused, and its value
    is the one computed before the write."""
    x = torch.randn(64)
    with membudget.budget("1 MiB") as session:
        a = x * 2.0
        view = a.view(8, 8)
        b = a + 1.0  # computed from the old contents of a
        c = (b * 3.0).sum()  # held, computed from a through b
        assert session.evict(b) and session.evict(c)
        view.add_(1.0)  # a is shared with `view`: an opaque write
        assert not session.evict(c)  # pinned before the write
        assert torch.equal(b.value(), x * 2.0 + 1.0)
        assert torch.equal(c.value(), ((x * 2.0 + 1.0) * 3.0).sum())
        assert torch.equal(a.value(), x * 2.0 + 1.0)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fused", [False, True])
def test_an_optimizer_step_inside_the_session_updates_parameters_like_eager(policy, fused):
    """forward, backward and AdamW's step (which writes the parameters, memory the engine does
    not own) all under one budget: the parameters afterwards equal an eager step's, bitwise."""
    model, loss_fn = mlp()
    state = copy.deepcopy(model.state_dict())

    def step():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            train_step(model, loss_fn)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    reset(model, state)
    ref = step()
    reset(model, state)
    with membudget.budget(10**9, policy) as session:
        unconstrained = session
        step()
    reset(model, state)
    nbytes = int(unconstrained.stats.peak_bytes * 0.8)
    with membudget.budget(nbytes, policy) as session:
        got = step()
    assert session.stats.evictions > 0 and session.stats.peak_bytes <= nbytes
    for p, r in zip(got, ref, strict=True):
        torch.testing.assert_close(p, r, rtol=0, atol=0)


def test_batchnorm_output_is_recomputed_without_updating_its_statistics_again():
    """Training-mode batch norm writes its running statistics as a side effect: its output
    is still evictable, and recomputing it leaves the statistics as one eager step did."""
    bn = nn.BatchNorm1d(8)
    x = torch.randn(16, 8)
    ref_bn = copy.deepcopy(bn)
    ref = ref_bn(x)
    with membudget.budget("1 MiB") as session:
        y = bn(x)
        assert session.evict(y)
        assert torch.equal(y.value(), ref)
        assert session.engine.stats.remat_ops == 1
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=0, atol=0)
    assert int(bn.num_batches_tracked) == 1


def test_a_models_parameters_enter_together_before_its_activations():
    """Adopted as the model first runs, the parameters sit in one run of blocks at the top
    of the two-sided pool, not interleaved with activations that would fragment it."""
    model, loss_fn = mlp()
    with membudget.budget("8 MiB", "coop") as session:
        loss = loss_fn(model)
        kinds = [b.storage.kind if b.storage is not None else "free"
                 for b in session.engine.allocator.layout()]
        params = [k for k, kind in enumerate(kinds) if kind == "parameter"]
        loss.backward()
    assert len(params) == len(list(model.parameters()))
    assert params == list(range(params[0], params[0] + len(params)))


def test_the_signature_caches_keep_what_every_step_meets_within_their_limit():
    """Layouts and prices are kept per signature for the process. A scalar that changes
    every step (Adam's step size) makes a new signature every step: the caches stay within
    their limit (the price table had none: 20 entries a step, for good, on a small LM), and
    a signature every step meets is never dropped for them."""
    from membudget.runtime.sizing import Recent

    cache: Recent[int] = Recent(8)
    cache.keep(("addmm", (64, 64)), 1)
    for step in range(1000):
        assert cache.get(("addmm", (64, 64))) == 1
        cache.keep(("addcdiv_", -0.001 * step), step)
        assert len(cache) <= 8
    assert cache.get(("addcdiv_", 0.0)) is None and cache.get(("addcdiv_", -0.999)) == 999
    cache.keep((["unhashable"],), 0)  # never repeats: not kept, and no error
    assert cache.get((["unhashable"],)) is None


@pytest.mark.parametrize("op", ["unsqueeze_", "transpose_", "t_", "squeeze_", "as_strided_"])
def test_an_in_place_view_op_changes_the_shape_the_program_sees_and_recomputes(op):
    """``x.unsqueeze_(2)`` and its kind change only the shape, strides or offset of ``x``.
    The program's wrapper takes them too (before: it kept the old shape, so BigBird's
    ``torch.cat`` after ``unsqueeze_`` failed in backward with "start + length exceeds
    dimension size"), and the value recomputes from an alias of the old one, which keeps
    its own layout (before: a RecomputationError on the op that made it)."""
    torch.manual_seed(0)
    a = torch.randn(16, 8, 4, requires_grad=True)
    b = torch.randn(4, 6)

    def run(session=None):
        x = torch.tanh(a @ b) * 1.5  # (16, 8, 6), not saved by its own backward
        if op == "unsqueeze_":
            x.unsqueeze_(2)
        elif op == "transpose_":
            x.transpose_(0, 2)
        elif op == "t_":
            x = x[0]
            x.t_()
        elif op == "squeeze_":
            x = x[:, :1]
            x.squeeze_(1)
        else:
            x.as_strided_((16, 6, 8), (48, 1, 6))
        if session is not None:  # drop it and what it was made from: both recompute
            assert session.evict(x)
        y = torch.cat([x, x * 2], dim=-1)
        (y.sin() * torch.arange(y.shape[-1])).sum().backward()
        return tuple(x.shape), y.detach()

    shape, y = run()
    grad, a.grad = a.grad, None
    with membudget.budget("1 GB") as session:
        got_shape, got = run(session)
    assert got_shape == shape and torch.equal(got, y) and torch.equal(a.grad, grad)
    assert session.stats.remat_ops >= 2  # the op that made it, and the view op again
