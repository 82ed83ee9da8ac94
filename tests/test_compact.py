"""dtr-compact, the default policy: DTR's choices on an address-ordered pool, with
fragmentation undone by moving live tensors; "default" names it everywhere.

Moves must keep the pool consistent and lose no data (the property tests run every policy,
this one included, with a symbolic executor that fails on a moved value it does not hold);
here: a hand-made fragmented pool, random programs where moves do happen on both layouts,
the live runtime's gradients and real memory with moves, and the same decisions on every run.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_properties import SymbolicExecutor, programs, reference, run_program
from test_runtime import MODELS, assert_same, reset, train_step

import membudget
from membudget.bench.meter import StorageMeter
from membudget.core import Engine
from membudget.core.executor import SimulatedExecutor
from membudget.core.policies import DEFAULT_POLICY, make_policy
from membudget.errors import EngineError, MembudgetError, OutOfBudget
from membudget.sim.simulate import copy_executor, simulate
from membudget.trace.synthetic import resnet_step


def fragmented(policy: str, cost: float = 5.0,
               executor: SimulatedExecutor | None = None) -> tuple[Engine, list]:
    """A 100 B best-fit pool holding a 10 B leaf and three 30 B activations (each made at
    ``cost``), the outer two then evicted: 60 B free in two holes of 30 B around the middle
    one. The default executor prices moves at 0."""
    eng = Engine(100, policy, "best-fit", executor)
    x = eng.put(10)
    a, b, c = (eng.apply(f"op{k}", [x], [30], cost=cost)[0] for k in range(3))
    assert [t.storage.block.addr for t in (a, b, c)] == [10, 40, 70]
    assert eng.evict(a) and eng.evict(c)
    return eng, [x, a, b, c]


def test_a_move_instead_of_an_eviction_when_free_bytes_are_split():
    eng, (x, _, b, _) = fragmented("dtr-compact")
    (d,) = eng.apply("op3", [x], [40], cost=5.0)
    st_ = eng.stats
    assert (st_.moves, st_.moved_bytes, st_.evictions) == (1, 30, 2)  # the two made by hand
    assert b.storage.resident and d.storage.resident and eng.used_bytes == 80
    eng.allocator.check()
    # DTR's own choice on the same pool must evict to make one block
    eng2, (x2, *_) = fragmented("dtr")
    eng2.apply("op3", [x2], [40], cost=5.0)
    assert eng2.stats.evictions == 3 and eng2.stats.moves == 0


def test_a_move_costs_what_the_executor_prices_and_counts_in_the_executed_cost():
    eng, (x, *_rest) = fragmented("dtr-compact-moves")  # moves never weighed: it moves
    eng.executor = SimulatedExecutor(copy_ns_per_byte=0.5, copy_launch=100.0)
    before = eng.stats.executed_cost
    eng.apply("op3", [x], [40], cost=5.0)
    assert eng.stats.move_cost == 100.0 + 2 * 30 * 0.5
    assert eng.stats.executed_cost == before + 5.0 + eng.stats.move_cost
    # the simulator prices it on the trace's device spec (an A100 where none is named)
    assert copy_executor({}).copy_ns_per_byte < copy_executor(
        {"device_spec": "titan-v"}).copy_ns_per_byte


def test_the_moves_that_make_one_block_are_one_batched_copy_with_one_launch():
    """Two 10 B storages moved out of a run into a hole elsewhere: independent copies, one
    multi-tensor launch (100) and their bytes (2 * 20 * 0.5), not a launch each."""
    ex = SimulatedExecutor(copy_ns_per_byte=0.5, copy_launch=100.0)
    eng = Engine(100, "dtr-compact-moves", "best-fit", ex)
    x = eng.put(10)
    p, q, r, s, t, u = (eng.apply(f"op{k}", [x], [n], cost=5.0)[0]
                        for k, n in enumerate((20, 10, 10, 20, 10, 20)))
    assert [v.storage.block.addr for v in (p, s)] == [10, 50]
    assert eng.evict(p) and eng.evict(s)  # 40 B free in two holes of 20 B
    (d,) = eng.apply("op6", [x], [40], cost=5.0)
    assert (eng.stats.moves, eng.stats.moved_bytes, eng.stats.evictions) == (2, 20, 2)
    assert eng.stats.move_cost == 100.0 + 2 * 20 * 0.5
    assert ex.batch_price([q.storage, r.storage]) == eng.stats.move_cost
    assert d.storage.resident and all(v.storage.resident for v in (q, r, t, u))
    eng.allocator.check()


def test_a_cheaper_window_is_evicted_instead_of_priced_moves():
    # Moving b (30 B) costs 100 + 2 * 30 * 0.5 = 130. Made at cost 5, its eviction is
    # weighed at 0.1 * 5 = 0.5 (as DTR's exact e*, nothing evicted around it adds to it): b
    # is evicted and nothing moves. Made at cost 2000 (200 weighed), it is moved.
    for cost, moves, evictions in ((5.0, 0, 3), (2000.0, 1, 2)):
        ex = SimulatedExecutor(copy_ns_per_byte=0.5, copy_launch=100.0)
        eng, (x, _, b, _) = fragmented("dtr-compact", cost, ex)
        (d,) = eng.apply("op3", [x], [40], cost=5.0)
        assert (eng.stats.moves, eng.stats.evictions) == (moves, evictions)
        assert d.storage.resident and b.storage.resident is bool(moves)
        assert eng.peak_bytes <= 100
        eng.allocator.check()
    with pytest.raises(MembudgetError, match="remat_share"):
        make_policy("dtr-compact", remat_share=0)


def test_it_evicts_before_it_slides_until_the_victims_cost_the_slides_price():
    """No run can be emptied into the holes outside it (b, 30 B, fits neither 15 B hole),
    but sliding b down merges both holes. Where the copy costs more than evicting DTR's
    victim would, the victim goes (it opens a block here); where it costs nothing, b is
    slid at once. The "last" ablation slides only when nothing is left to evict."""
    def run(policy: str, per_byte: float) -> Engine:
        ex = SimulatedExecutor(copy_ns_per_byte=per_byte, copy_launch=0.0)
        eng = Engine(100, policy, "best-fit", ex)
        x = eng.put(10)
        a, b, c, d = (eng.apply(f"op{k}", [x], [n], cost=5.0)[0]
                      for k, n in enumerate((15, 30, 15, 30)))
        assert [t.storage.block.addr for t in (a, b, c, d)] == [10, 25, 55, 70]
        assert eng.evict(a) and eng.evict(c)
        (e,) = eng.apply("op4", [x], [30], cost=5.0)
        assert e.storage.resident and eng.peak_bytes <= 100
        eng.allocator.check()
        return eng

    for policy, per_byte, moves, evictions in (("dtr-compact", 10.0, 0, 3),
                                               ("dtr-compact", 0.0, 1, 2),
                                               ("dtr-compact-lastslide", 0.0, 0, 3)):
        eng = run(policy, per_byte)
        assert (eng.stats.moves, eng.stats.evictions) == (moves, evictions), policy
    with pytest.raises(MembudgetError, match="slide"):
        make_policy("dtr-compact", slide="sometimes")


def test_leaves_never_move_and_the_engine_refuses_to_move_one():
    eng = Engine(100, "dtr-compact", "best-fit")
    x = eng.put(10)
    with pytest.raises(EngineError, match="cannot move"):
        eng._relocate([(x.storage, eng.allocator.layout()[-1])])


def test_with_nothing_left_to_evict_it_compacts_the_pool_across_a_leaf():
    """Leaf ``x``, then pinned activations of 20 B and holes of 10 B in two runs split by
    leaf ``y``: 40 B free, 20 in each run, and a request of 30 B. No run can be emptied
    (each of its storages is bigger than every hole outside it) and neither run's free bytes
    cover the request, so the run would stop; the last resort compacts: ``a2`` slides down,
    ``b1`` moves below ``y``, and the request gets the block ``b1`` left. DTR, which never
    moves, stops."""
    def layout(policy: str) -> tuple[Engine, list]:
        eng = Engine(140, policy, "best-fit")
        x = eng.put(10)
        a1, h1, a2, h2 = (eng.apply(f"a{k}", [x], [n], cost=5.0)[0]
                          for k, n in enumerate((20, 10, 20, 10)))
        y = eng.put(10)
        b1, h3, b2, h4 = (eng.apply(f"b{k}", [x], [n], cost=5.0)[0]
                          for k, n in enumerate((20, 10, 20, 10)))
        for t in (a1, a2, b1, b2):
            eng.pin(t)
        for t in (h1, h2, h3, h4):
            eng.release(t)
        assert [t.storage.block.addr for t in (x, a1, a2, y, b1, b2)] == [0, 10, 40, 70, 80, 110]
        assert eng.allocator.largest_free_block() == 10 and eng.allocator.free_bytes == 40
        return eng, [x, a1, a2, y, b1, b2]

    eng, (x, a1, a2, y, b1, b2) = layout("dtr-compact")
    (c,) = eng.apply("c", [x], [30], cost=5.0)
    assert [t.storage.block.addr for t in (x, a1, a2, y, b1, c, b2)] == [0, 10, 30, 70, 50, 80,
                                                                          110]
    assert (eng.stats.moves, eng.stats.moved_bytes, eng.stats.evictions) == (2, 40, 0)
    assert eng.peak_bytes <= 140
    eng.allocator.check()
    eng2, (x2, *_) = layout("dtr")
    with pytest.raises(OutOfBudget, match="largest block"):
        eng2.apply("c", [x2], [30], cost=5.0)


def test_a_leaf_taken_in_late_goes_beside_the_pinned_state_the_values_in_its_way_moved():
    """A segregated pool of 100 B: leaf ``x`` at the top, values ``a``, ``b``, ``c`` from the
    bottom, ``b`` released: holes of 30 B (``b``'s) and of 10 B (between ``c`` and ``x``). A
    leaf ``y`` of 20 B arrives. Placed in the topmost hole that holds it, it would split the
    free bytes into two holes of 10 B; the default moves ``c`` to the low end of ``b``'s hole
    and puts ``y`` beside ``x``, so the 20 B left are one block and a value of 20 B fits
    with no eviction. DTR, which never moves, splits them and must evict."""
    def late_leaf(policy: str) -> tuple[Engine, list]:
        eng = Engine(100, policy, "segregated")
        x = eng.put(10)
        a, b, c = (eng.apply(f"v{k}", [x], [n], cost=5.0)[0] for k, n in enumerate((30, 30, 20)))
        eng.release(b)
        assert [t.storage.block.addr for t in (a, c, x)] == [0, 60, 90]
        return eng, [x, a, c, eng.put(20)]

    eng, (x, a, c, y) = late_leaf("dtr-compact")
    assert [t.storage.block.addr for t in (a, c, y, x)] == [0, 30, 70, 90]
    assert (eng.stats.moves, eng.stats.moved_bytes) == (1, 20)
    assert eng.allocator.largest_free_block() == 20
    eng.apply("d", [y], [20], cost=5.0)
    assert eng.stats.evictions == 0
    eng.allocator.check()
    eng2, (_, _, _, y2) = late_leaf("dtr")
    assert y2.storage.block.addr == 40 and eng2.allocator.largest_free_block() == 10
    eng2.apply("d", [y2], [20], cost=5.0)
    assert eng2.stats.evictions > 0


def test_a_late_leaf_moves_values_even_where_that_shrinks_the_largest_block_for_now():
    """A segregated pool of 100 B: leaf ``x`` at the top, values ``a``, ``b``, ``d``, ``c``
    from the bottom, ``b`` released (a 20 B hole). A leaf ``y`` of 5 B arrives: ``c`` (10 B)
    moves into ``b``'s hole and ``y`` goes beside ``x``, which leaves holes of 10 and 5 B
    where placing ``y`` in ``b``'s hole would leave one of 15. Once ``d`` is released the
    free bytes are one block of 45 B and a value of 40 B fits with no eviction; with ``y``
    in ``b``'s hole (DTR, which never moves) they are split, 15 and 30 B. (The trade's
    other side: tests/test_properties.py, test_budget_holding_every_storage_never_evicts.)"""
    def late_leaf(policy: str) -> tuple[Engine, list]:
        eng = Engine(100, policy, "segregated")
        x = eng.put(10)
        a, b, d, c = (eng.apply(f"v{k}", [x], [n], cost=5.0)[0]
                      for k, n in enumerate((30, 20, 30, 10)))
        eng.release(b)
        assert [t.storage.block.addr for t in (a, d, c, x)] == [0, 50, 80, 90]
        return eng, [x, d, c, eng.put(5)]

    eng, (x, d, c, y) = late_leaf("dtr-compact")
    assert [t.storage.block.addr for t in (c, y)] == [30, 85]
    assert eng.allocator.largest_free_block() == 10
    eng.release(d)
    assert eng.allocator.largest_free_block() == 45
    eng.apply("e", [x], [40], cost=5.0)
    assert eng.stats.evictions == 0
    eng.allocator.check()
    eng2, (x2, d2, _, y2) = late_leaf("dtr")
    assert y2.storage.block.addr == 45
    eng2.release(d2)
    assert eng2.allocator.largest_free_block() == 30
    eng2.apply("e", [x2], [40], cost=5.0)
    assert eng2.stats.evictions > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instrs=programs(), fraction=st.sampled_from([0.4, 0.5, 0.6, 0.75, 0.9]),
       allocator=st.sampled_from(["best-fit", "torch-caching", "segregated"]))
def test_moves_keep_every_value_and_the_pool_consistent(instrs, fraction, allocator):
    expected, ref = reference(instrs)
    budget = int(ref.peak_bytes * fraction)
    eng = Engine(budget, "dtr-compact", allocator, SymbolicExecutor())
    try:
        reads = run_program(instrs, eng, check=True)
    except OutOfBudget:
        return
    assert reads == expected
    assert eng.peak_bytes <= budget


@pytest.mark.parametrize("allocator", ["segregated", "best-fit"])
def test_on_a_best_fit_pool_it_makes_dtrs_choices_on_the_ideal_pool_plus_moves(allocator):
    """On a synthetic ResNet step at budgets where moves always find room, the victims are
    exactly those of DTR on the fungible pool, and the overhead is DTR's plus the copies;
    DTR's own choices on the same address-ordered pool need many more evictions."""
    trace = resnet_step(depth=8, batch=64)
    for ratio in (0.7, 0.5):
        engines: list[Engine] = []
        r = simulate(trace, "dtr-compact", ratio=ratio, allocator=allocator,
                     on_engine=engines.append)
        engines[0].allocator.check()
        fungible = simulate(trace, "dtr", ratio=ratio, allocator="fungible")
        plain = simulate(trace, "dtr", ratio=ratio, allocator=allocator)
        assert r.status == fungible.status == "ok"
        assert r.extra["moves"] > 0 and r.peak_bytes <= r.budget_bytes
        assert (r.evictions, r.remat_ops) == (fungible.evictions, fungible.remat_ops)
        assert r.executed_cost == pytest.approx(fungible.executed_cost + r.extra["move_cost"])
        assert plain.evictions > 1.5 * r.evictions


def test_on_the_caching_allocators_pool_it_evicts_less_than_dtr_alone():
    """PyTorch's caching allocator reserves segments: whole segments are emptied by moves
    so that a new one fits, and fewer values are evicted than by DTR on the same pool."""
    trace = resnet_step(depth=8, batch=64)
    for ratio in (0.7, 0.5):
        engines: list[Engine] = []
        r = simulate(trace, "dtr-compact", ratio=ratio, allocator="torch-caching",
                     on_engine=engines.append)
        engines[0].allocator.check()
        plain = simulate(trace, "dtr", ratio=ratio, allocator="torch-caching")
        assert r.status == plain.status == "ok" and r.extra["moves"] > 0
        assert r.evictions < plain.evictions and r.overhead < plain.overhead


def test_default_names_the_default_policy_everywhere():
    assert type(make_policy("default")) is type(make_policy(DEFAULT_POLICY))
    with membudget.budget("1 MiB") as session:
        torch.ones(4) * 2
    assert session.policy == DEFAULT_POLICY
    with pytest.raises(membudget.MembudgetError, match="unknown cost"):
        membudget.budget("1 MiB", cost="wall clock")


def test_live_moves_keep_gradients_bitwise_and_real_memory_within_the_budget():
    """GPT-2 (tiny) at 0.5 of its peak moves values in the live runtime: the gradients equal
    the unconstrained run's, and a meter of live storages outside the engine (a dispatch
    mode around the session) never sees more than the budget."""
    model, loss_fn = MODELS["gpt2"]()
    state = copy.deepcopy(model.state_dict())
    reset(model, state)
    ref_loss = train_step(model, loss_fn).detach()
    ref = (ref_loss, [p.grad.clone() for p in model.parameters()])
    reset(model, state)
    with membudget.budget(10**10) as free:
        train_step(model, loss_fn)
    nbytes = int(free.stats.peak_bytes * 0.5)
    reset(model, state)
    with StorageMeter() as meter, membudget.budget(nbytes) as session:
        loss = train_step(model, loss_fn)
    assert session.stats.moves > 0
    assert session.stats.peak_bytes <= nbytes
    assert_same(model, loss, ref)
    assert meter.peak_bytes <= nbytes


DECISIONS = textwrap.dedent("""
    import hashlib, json, sys
    sys.path.insert(0, sys.argv[1])
    from test_runtime import MODELS, reset, train_step
    import copy, membudget
    model, loss_fn = MODELS["gpt2"]()
    state = copy.deepcopy(model.state_dict())

    class Log:
        def __init__(self):
            self.events = []
        def on_alloc(self, s, b):
            self.events.append(("alloc", s.id, b.addr, b.size))
        def on_free(self, s, b):
            self.events.append(("free", s.id, b.addr, b.size))
        def on_segment(self, action, addr, size):
            self.events.append((action, addr, size))

    reset(model, state)
    log = Log()
    with membudget.budget(int(sys.argv[2])) as session:
        session.engine.allocator.observer = log
        train_step(model, loss_fn)
    st = session.stats
    print(json.dumps({"evictions": st.evictions, "remat_ops": st.remat_ops,
                      "moves": st.moves,
                      "layout": hashlib.sha256(repr(log.events).encode()).hexdigest()}))
""")


def test_the_same_program_and_budget_make_the_same_decisions_in_fresh_processes(tmp_path):
    """Every eviction, recomputation and move (the pool's whole history of placements and
    frees) is the same in two fresh processes: costs come from the cost model."""
    script = tmp_path / "decide.py"
    script.write_text(DECISIONS)
    tests = str(__import__("pathlib").Path(__file__).parent)
    model, loss_fn = MODELS["gpt2"]()
    with membudget.budget(10**10) as free:
        train_step(model, loss_fn)
    nbytes = str(int(free.stats.peak_bytes * 0.5))
    runs = [json.loads(subprocess.run([sys.executable, str(script), tests, nbytes],
                                      capture_output=True, text=True, check=True,
                                      timeout=300).stdout.splitlines()[-1])
            for _ in range(2)]
    assert runs[0]["evictions"] > 0 and runs[0]["moves"] > 0
    assert runs[0] == runs[1]


def test_pinned_state_at_the_top_and_sliding_complete_a_step_plain_best_fit_cannot():
    """An MLP whose parameters and gradients take most of the budget: the targets, adopted
    late, and the pinned gradients split the free bytes. With both at the top or moved, and
    the rest slid together when nothing is left to evict, the default completes at 0.95 of
    the peak with exact gradients. Never sliding, it completes only by its last resort,
    compacting the pool; on plain best fit, where the late targets land among the
    activations and compaction cannot move them, it runs out of one free block, and so does
    coop."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(512, 768)]
    for _ in range(4):
        layers += [torch.nn.ReLU(), torch.nn.Linear(768, 768)]
    model = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(768, 10))
    x, y = torch.randn(1024, 512), torch.randint(0, 10, (1024,))
    state = copy.deepcopy(model.state_dict())

    def step():
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    ref = step()
    ref = (ref[0], [g.clone() for g in ref[1]])
    with membudget.budget(10**10) as free:
        step()
    nbytes = int(free.stats.peak_bytes * 0.95)
    model.load_state_dict(state)
    with membudget.budget(nbytes) as session:
        loss, grads = step()
    assert session.stats.moves > 0 and session.stats.peak_bytes <= nbytes
    assert torch.equal(loss, ref[0])
    assert all(torch.equal(g, r) for g, r in zip(grads, ref[1], strict=True))
    model.load_state_dict(state)
    with membudget.budget(nbytes, "dtr-compact-noslide") as session:
        loss, grads = step()
    assert session.stats.moves > 0 and session.stats.peak_bytes <= nbytes
    assert torch.equal(loss, ref[0])
    assert all(torch.equal(g, r) for g, r in zip(grads, ref[1], strict=True))
    for policy, allocator in (("default", "best-fit"), ("coop", None)):
        model.load_state_dict(state)
        with (pytest.raises(membudget.BudgetTooSmallError, match="one free block"),
              membudget.budget(nbytes, policy, allocator=allocator)):
            step()


def test_an_rwkv_trained_with_adamw_completes_where_dtr_eq_does():
    """A transformers RWKV with AdamW, a new default session per step, at 0.45 of its eager
    peak (StorageMeter), where dtr-eq completes (from 0.42, since AdamW's state counts from
    each session's start). It ran out at 0.36 in its first step (free bytes in pieces that
    only compacting the pool gathers) and at 0.35 in its second (AdamW's state, made in the
    first step and adopted as the step read it, landed in holes all over the pool; now it is
    adopted in one run). Its long evicted chains made each of DTR's exact searches take
    25 ms here, a step 14x dtr-eq's (benchmarks/search_speed.py). Losses and parameters stay
    bitwise eager's, and the meter within the budget."""
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(0)
    cfg = RwkvConfig(vocab_size=512, hidden_size=64, num_hidden_layers=3,
                     attention_hidden_size=64, intermediate_size=128, context_length=64)
    model = RwkvForCausalLM(cfg)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(3))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with StorageMeter() as meter:
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
    nbytes = int(meter.peak_bytes * 0.45)
    losses = [loss.item()]
    for _ in range(2):
        ref_opt.zero_grad(set_to_none=True)
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
        losses.append(loss.item())
    for k in range(3):
        opt.zero_grad(set_to_none=True)
        with StorageMeter() as meter, membudget.budget(nbytes):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
        assert meter.peak_bytes <= nbytes and loss.item() == losses[k]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(),
                                                 strict=True))


def segformer() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A small transformers Segformer in training mode (stochastic depth draws in every
    step), and a batch of images with their per-pixel labels."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    cfg = SegformerConfig(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 96],
                          decoder_hidden_size=64, num_labels=5)
    model = SegformerForSemanticSegmentation._from_config(cfg).train()
    g = torch.Generator().manual_seed(1)
    return (model, torch.randn(2, 3, 128, 128, generator=g),
            torch.randint(0, 5, (2, 128, 128), generator=g))


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """An optimizer's state: alive through forward and backward, which do not touch it (a
    meter of them does not see it unless told), it counts from each session's start."""
    return [v for per in opt.state.values() for v in per.values() if isinstance(v, torch.Tensor)]


def state_bytes(opt) -> int:
    """The bytes of an optimizer's state (see :func:`optimizer_tensors`)."""
    return sum(v.untyped_storage().nbytes() for v in optimizer_tensors(opt))


def test_a_segformer_completes_where_dtr_eq_does_its_labels_beside_the_parameters():
    """A transformers Segformer with AdamW, a new default session per step, at 0.6 of its
    eager peak (forward and backward) and AdamW's state, where dtr-eq completes. Its
    per-pixel labels (256 KiB) are read only by the loss, at the end of the forward pass,
    when the session takes them in: they landed in the middle of the activations and split
    the free bytes into two blocks too small for a 2 MiB gradient, and the run stopped. A
    leaf now goes beside the pinned state, the values in its way moved aside. Losses and
    parameters stay bitwise eager's, and the meter within the budget."""
    model, pixels, labels = segformer()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peak = [], 0
    for k in range(3):
        ref_opt.zero_grad(set_to_none=True)
        torch.manual_seed(k)  # (stochastic depth draws in every step)
        with StorageMeter() as meter:
            loss = ref(pixel_values=pixels, labels=labels).loss
            loss.backward()
        ref_opt.step()
        losses.append(loss.item())
        peak = peak or meter.peak_bytes
    nbytes = int(peak * 0.6) + state_bytes(ref_opt)
    for k in range(3):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(k)
        with StorageMeter() as meter, membudget.budget(nbytes) as session:
            loss = model(pixel_values=pixels, labels=labels).loss
            loss.backward()
        opt.step()
        assert meter.peak_bytes <= nbytes and loss.item() == losses[k]
        assert session.stats.evictions > 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(),
                                                 strict=True))


def test_a_funnel_in_planned_mode_completes_at_0_6_bitwise_within_the_budget():
    """A transformers Funnel (a model no test was written for) with AdamW in one planned
    session at 0.6 of its eager peak (forward and backward) and AdamW's state: losses and
    parameters bitwise eager's, the meter within the budget. With this machine's measured
    spec at one thread, its first step took a 64 B leaf in late while a 512 KiB value lay in
    its place; placed without moving that value, the leaf split the free bytes once the
    activations around it were freed, and the step ran out (the hand-made test above pins
    that behaviour; under the suite's pinned spec the decisions differ and the leaf does not
    land there)."""
    from transformers import FunnelConfig, FunnelForSequenceClassification

    torch.manual_seed(0)
    model = FunnelForSequenceClassification(FunnelConfig(
        vocab_size=1000, block_sizes=[1, 1, 1], d_model=128, n_head=4, d_head=32,
        d_inner=256, num_labels=3, hidden_dropout=0.1))
    g = torch.Generator().manual_seed(6)
    ids, y = torch.randint(0, 1000, (8, 128), generator=g), torch.randint(0, 3, (8,), generator=g)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peak = [], 0
    for k in range(3):
        ref_opt.zero_grad(set_to_none=True)
        torch.manual_seed(100 + k)
        with StorageMeter() as meter:
            loss = ref(input_ids=ids, labels=y).loss
            loss.backward()
        ref_opt.step()
        losses.append(loss.item())
        peak = peak or meter.peak_bytes
    nbytes = int(peak * 0.6) + state_bytes(ref_opt)
    session = membudget.budget(nbytes, mode="planned")
    for k in range(3):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(100 + k)
        with StorageMeter() as meter, session:
            loss = model(input_ids=ids, labels=y).loss
            loss.backward()
            opt.step()
        assert meter.peak_bytes <= nbytes and loss.item() == losses[k]
        session.wait_for_plan()
    assert session.stats.evictions > 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(),
                                                 strict=True))


def test_a_wav2vec2_completes_at_0_4_of_its_peak_as_dtr_does():
    """A model no test was written for: at 0.4 of its peak the default ran out of memory
    while recomputing (it evicted DTR's victims one by one, each deepening later
    recomputations, where sliding a run together would have opened the block), while DTR
    completes. Gradients equal eager's, and the meter stays within the budget."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    cfg = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2),
                         conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                         num_conv_pos_embedding_groups=4, vocab_size=20, hidden_dropout=0.1,
                         feat_proj_dropout=0.1, mask_time_prob=0.0, ctc_zero_infinity=True)
    model = Wav2Vec2ForCTC._from_config(cfg).train()
    x, labels = torch.randn(2, 4000), torch.randint(1, 20, (2, 12))

    def step(m):
        torch.manual_seed(7)
        loss = m(input_values=x, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad for p in m.parameters()]

    ref = step(copy.deepcopy(model))
    with membudget.budget(10**12) as free:
        step(copy.deepcopy(model))
    nbytes = int(free.stats.peak_bytes * 0.4)
    with StorageMeter() as meter, membudget.budget(nbytes) as session:
        loss, grads = step(model)
    assert session.stats.evictions > 0 and meter.peak_bytes <= nbytes
    assert torch.equal(loss, ref[0])
    assert all(torch.equal(g, r) for g, r in zip(grads, ref[1], strict=True))


def test_a_recorded_plan_and_a_plan_followed_keep_the_moves():
    """Recording the default's decisions (the planner of planned mode) and following them
    wrap the policy: its moves must go through the wrappers, so both runs match the plain
    one instead of falling back to DTR's choices alone on the address-ordered pool."""
    trace = resnet_step(depth=8, batch=64)
    plain = simulate(trace, "default", ratio=0.5)
    recorded = simulate(trace, "default", ratio=0.5, record_plan=True)
    followed = simulate(trace, "default", ratio=0.5, plan=recorded.eviction_plan)
    assert plain.extra["moves"] > 0
    for r in (recorded, followed):
        assert r.status == "ok"
        assert (r.evictions, r.extra["moves"]) == (plain.evictions, plain.extra["moves"])
