"""Swapping to host memory: a victim's bytes copied to the host and back instead of dropped.

Hand-built programs check the engine's bookkeeping and the copy streams' waits (derived in the
comments); a zoo trace checks what each mode buys; live runs check that swapped values come
back bitwise equal (the gradients equal an unconstrained run's) and that a recorded run with
swaps replays with the same decisions.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_runtime import MODELS, reference, reset, train_step

import membudget
from membudget.core import Engine
from membudget.core.executor import SimulatedExecutor
from membudget.errors import EngineError, MembudgetError

B = 100
LOGS = Path(__file__).resolve().parents[1].parent / "shared" / "dtr-logs" / "logs.zip"


def executor(overlap: bool, pinned: bool = False) -> SimulatedExecutor:
    """A host link that copies one byte per cost unit each way, no launch cost; ``pinned``:
    leaves and pinned outputs may go to the host too (the simulator's default; most tests
    here follow activations alone)."""
    ex = SimulatedExecutor(link_ns_per_byte=1.0, overlap=overlap)
    ex.swaps_pinned = pinned
    return ex


def chain(eng: Engine, n: int, cost: float) -> list:
    xs = [eng.put(B)]
    for i in range(1, n + 1):
        (x,) = eng.apply(f"op{i}", [xs[-1]], [B], cost=cost)
        xs.append(x)
    return xs


def test_swap_only_never_recomputes_and_reads_copy_values_back():
    # Budget = leaf + 2 activations: each new output past the second sends the stalest one
    # to the host (a copy of 100 B, priced 100 each way); no history is kept.
    eng = Engine(3 * B, "lru", "fungible", executor(overlap=False), swap="only")
    xs = chain(eng, 5, cost=1000.0)
    assert [x.storage.swapped for x in xs[1:]] == [True, True, True, False, False]
    assert all(not x.storage.parents for x in xs[1:])
    st = eng.stats
    assert (st.swap_outs, st.evictions, st.remat_ops) == (3, 3, 0)
    assert st.swap_stall == 3 * 100  # copied synchronously: each swap-out waits its copy
    eng.get_value(xs[1])  # back from the host: one copy in, and one more value goes out
    assert xs[1].defined and xs[1].storage.resident and not xs[1].storage.swapped
    assert (st.swap_ins, st.swap_outs, st.remat_ops) == (1, 4, 0)
    assert eng.peak_bytes <= 3 * B
    assert st.executed_cost == st.base_cost + st.swap_stall
    # x1 keeps its host copy: evicted again, it leaves without a copy
    assert xs[1].storage.host_ready < float("inf")
    stall = st.swap_stall
    eng.evict(xs[1])
    assert xs[1].storage.swapped and st.swap_stall == stall
    for x in xs:  # all released: every host copy is let go
        eng.release(x)
    assert st.host_bytes == 0 and st.host_peak == 4 * B


def test_both_swaps_only_what_costs_more_to_recompute_than_to_copy():
    # Round trip of 100 B = 200. Ops costing 1000 are cheaper to copy; ops costing 10
    # cheaper to recompute: the same program then swaps everything or nothing.
    for cost, swapped in ((1000.0, True), (10.0, False)):
        eng = Engine(3 * B, "lru", "fungible", executor(overlap=False), swap="both")
        xs = chain(eng, 5, cost=cost)
        assert xs[1].storage.swapped is swapped and xs[1].storage.evicted is not swapped
        for x in xs[1:]:
            eng.get_value(x)
        st = eng.stats
        assert (st.swap_outs > 0) is swapped and (st.remat_ops > 0) is not swapped


def test_both_counts_the_evicted_ancestors_a_recomputation_needs():
    # Ops cost 150, a round trip 200. x1's parent is resident: recomputing it costs 150, so
    # it is dropped. x2's parent x1 is then evicted: rebuilding x2 costs 300, so it is
    # copied. x3's parent x2 is on the host: rebuilding it costs its op and x2's copy back
    # (250), so it is copied too.
    eng = Engine(10 * B, "lru", "fungible", executor(overlap=False), swap="both")
    xs = chain(eng, 3, cost=150.0)
    for x in xs[1:]:
        eng.evict(x)
    assert [(x.storage.evicted, x.storage.swapped) for x in xs[1:]] == [
        (True, False), (False, True), (False, True)]
    eng.get_value(xs[3])  # one copy back, nothing recomputed
    assert (eng.stats.swap_ins, eng.stats.remat_ops) == (1, 0)


def test_a_released_value_with_a_finished_host_copy_stays_there_for_its_descendants():
    # Budget = leaf + 3. c's allocation sends f to the host (LRU); as op c starts the idle
    # link backs up the oldest value still resident, a (ready at 2211, while c runs to
    # 3111). b is then evicted: its round trip (at least 200) costs more than its op (10),
    # so it is dropped. Released, a leaves for its finished copy rather than being dropped:
    # copying it back (100) costs less than its op (1000). Reading b then recomputes b alone
    # (10) and copies a back, where dropping a would have recomputed both (1010).
    eng = Engine(4 * B, "lru", "fungible", executor(overlap=True), swap="both")
    x0 = eng.put(B)
    (f,) = eng.apply("f", [x0], [B], cost=1000.0)
    (a,) = eng.apply("a", [x0], [B], cost=1000.0)
    (b,) = eng.apply("b", [a], [B], cost=10.0)
    eng.apply("c", [b], [B], cost=1000.0)
    assert f.storage.swapped and a.storage.host_ready == 2211.0 < eng.clock
    eng.evict(b)
    assert b.storage.evicted
    eng.release(a)
    st = eng.stats
    assert a.storage.swapped and not a.storage.evicted
    assert (st.shelved, st.eager_evictions, st.swap_outs) == (1, 1, 1)
    eng.get_value(b)
    assert (st.swap_ins, st.remat_ops, st.remat_cost) == (1, 1, 10.0)
    assert eng.peak_bytes <= 4 * B


def test_a_live_released_value_comes_back_from_the_host_for_a_recomputation():
    # Priced by a cost function: the matmul costs 1 s, everything else 1 ns, a copy what
    # this machine's memory bandwidth says (microseconds). a goes to the host and back (its
    # host copy stays); b, cheaper to recompute than to copy, is dropped; released, a
    # leaves for its host copy; reading b copies a back and recomputes b alone.
    def cost(func, args, kwargs, out):
        return 1.0 if func is torch.ops.aten.mm.default else 1e-9

    x, w = torch.randn(64, 128), torch.randn(128, 64)
    ref = x @ w + 1
    with membudget.budget("64 MiB", swap="both", cost=cost) as session:
        a = x.clone() @ w.clone()
        b = a + 1
        assert session.evict(a)
        a.value()
        assert session.evict(b)
        del a
        st = session.engine.stats
        assert (st.swap_outs, st.evictions, st.shelved) == (1, 2, 1)
        assert torch.equal(b.value(), ref)
        assert (st.swap_ins, st.remat_ops) == (2, 1)


def test_released_values_kept_on_the_host_spare_their_chains_on_unroll_gan():
    # The DTR paper's unroll_gan at 0.2 of its peak: dropped, the values it releases were
    # rebuilt through chains of released ancestors, and "both" thrashed like recomputation
    # alone; kept on the host, it completes.
    from membudget.sim import simulate
    from membudget.trace import expand_sources, load_trace

    (src,) = [s for s in expand_sources([str(LOGS)]) if "unroll_gan" in s]
    trace = load_trace(src)
    off, both = (simulate(trace, "dtr", ratio=0.2, swap=m) for m in ("off", "both"))
    assert off.status == "thrashed"
    assert both.status == "ok" and both.peak_bytes <= both.budget_bytes
    assert both.extra["shelved"] > 0 and both.overhead < 0.5


def test_overlapped_copies_wait_only_for_what_is_unfinished():
    # With copy streams: x3's allocation (clock 2001) sends x1 to the host with no backup
    # yet, a wait of its whole copy (100). As op3 starts (2101) the idle link backs up the
    # oldest value still resident, x2 (ready at 2201, while op3 runs to 3101), so x4's
    # allocation sends x2 away with no wait. Copied synchronously, both wait 100.
    eng = Engine(3 * B, "lru", "fungible", executor(overlap=True), swap="only")
    xs = chain(eng, 4, cost=1000.0)
    st = eng.stats
    assert st.backups >= 1 and xs[2].storage.swapped
    assert st.swap_stall == 100
    sync = Engine(3 * B, "lru", "fungible", executor(overlap=False), swap="only")
    chain(sync, 4, cost=1000.0)
    assert sync.stats.swap_stall == 200 and sync.stats.backups == 0


def test_a_copy_out_is_priced_with_the_copies_queued_ahead_of_it():
    # A backup of 1000 B occupies the link to the host from clock 0 to 1000. At clock 100 a
    # 100 B value with no host copy would wait 900 for the link, then 100 for its own copy;
    # the one being backed up waits out the rest of its copy; a finished backup waits
    # nothing. Copied synchronously, a copy waits its own time alone. "Both" weighs exactly
    # that wait plus the copy back (100) against recomputing: so a value whose bare round
    # trip (200) is cheaper than its recomputation (500) is still dropped while the link is
    # busy, where it would have stalled the ops 1100.
    ex = executor(overlap=True)
    eng = Engine(20 * B, "lru", "fungible", ex, swap="both")
    big = eng.put(10 * B).storage
    (small,) = eng.apply("op", [eng.put(B)], [B], cost=500.0)
    assert ex.backup(big, 0.0) == 1000.0
    big.host_ready = 1000.0
    assert ex.out_wait(small.storage, 100.0) == 900.0 + 100.0
    assert ex.out_wait(big, 100.0) == 900.0 and ex.out_wait(big, 2000.0) == 0.0
    assert executor(overlap=False).out_wait(small.storage, 100.0) == 100.0
    eng.clock = 100.0
    assert eng._return_cost(small.storage) == 500.0  # recomputing is cheaper now
    eng.clock = 1000.0
    assert eng._return_cost(small.storage) == 200.0  # the link is free again


def test_a_value_is_prefetched_back_while_an_op_runs_and_read_with_no_wait():
    # Budget = leaf + 3 activations: x1 and x2 are on the host after the chain. Releasing
    # x3..x5 frees their blocks; as the next op (cost 1000) starts, the idle link back
    # brings the value made last, x2 (it fits with as much again to spare), which is in
    # before the op ends: reading it then waits for nothing.
    eng = Engine(4 * B, "lru", "fungible", executor(overlap=True), swap="only")
    xs = chain(eng, 5, cost=1000.0)
    assert xs[1].storage.swapped and xs[2].storage.swapped
    for x in xs[3:]:
        eng.release(x)
    eng.apply("op", [xs[0]], [B], cost=1000.0)
    st = eng.stats
    assert st.prefetches == 1 and xs[2].storage.resident and xs[1].storage.swapped
    stall = st.swap_stall
    eng.get_value(xs[2])
    assert st.swap_stall == stall and st.swap_ins == 1


def test_the_value_made_last_comes_back_first_whatever_order_they_left_in():
    # Budget = leaf + 3 blocks. op4 reads x1 again, so LRU sends x2 to the host first (for
    # x4), then x1 (for the two blocks of x5). A backward reads values in the reverse order
    # they were made, so with room for one guess the link brings back x2, though x1 left
    # last.
    eng = Engine(4 * B, "lru", "fungible", executor(overlap=True), swap="only")
    x0, x1, x2 = chain(eng, 2, cost=1000.0)
    (x3,) = eng.apply("op3", [x2], [B], cost=1000.0)
    (x4,) = eng.apply("op4", [x1], [B], cost=1000.0)
    assert x2.storage.swapped and x1.storage.resident
    eng.release(x3)
    (x5,) = eng.apply("op5", [x4], [2 * B], cost=1000.0)
    assert eng.stats.swap_outs == 2 and x1.storage.swapped
    eng.release(x4)
    eng.release(x5)
    eng.apply("op", [x0], [B], cost=1000.0)
    assert eng.stats.prefetches == 1
    assert x2.storage.resident and x1.storage.swapped


def test_a_prefetched_value_not_yet_read_goes_back_before_anything_is_evicted():
    # Budget = leaf + 4. a (cost 1000: a round trip of 200 is cheaper) goes to the host when
    # r needs room; z (cost 10) is then the stalest value left. Once p, q and r are
    # released, the next op's start brings a back ahead of need. An op that then needs two
    # blocks with one free sends the unread a back to the host, with no copy (its host copy
    # stayed) and no wait, where LRU alone would have dropped z, to be recomputed.
    eng = Engine(5 * B, "lru", "fungible", executor(overlap=True), swap="both")
    x0 = eng.put(B)
    (a,) = eng.apply("a", [x0], [B], cost=1000.0)
    (z,) = eng.apply("z", [x0], [B], cost=10.0)
    rest = [eng.apply(name, [x0], [B], cost=1000.0)[0] for name in "pqr"]
    assert a.storage.swapped and z.storage.resident
    for t in rest:
        eng.release(t)
    eng.apply("s", [x0], [B], cost=1000.0)
    st = eng.stats
    assert st.prefetches == 1 and a.storage.resident
    stall, outs = st.swap_stall, st.swap_outs
    eng.apply("c", [x0], [B, B], cost=1000.0)
    assert a.storage.swapped and z.storage.resident and not z.storage.evicted
    assert st.swap_outs == outs + 1 and st.swap_stall == stall and st.remat_ops == 0
    eng.get_value(z)
    assert st.remat_ops == 0


def test_a_swapped_output_recomputed_beside_its_dropped_sibling_is_resident_again():
    # One op makes a (1000 B) and b (10 B) at cost 100: sending a to the host and back
    # would cost 2000, so it is dropped; b's round trip costs 20, so it goes to the host.
    # Reading a reruns the op, which makes b again too: b is then resident, not swapped.
    eng = Engine(10**6, "lru", "fungible", executor(overlap=False), swap="both")
    x = eng.put(B)
    a, b = eng.apply("op", [x], [1000, 10], cost=100.0)
    assert eng.evict(a) and eng.evict(b)
    assert a.storage.evicted and b.storage.swapped
    eng.get_value(a)
    assert b.storage.resident and not b.storage.swapped and b.defined
    assert eng.stats.remat_ops == 1 and eng.stats.swap_ins == 0
    eng.evict(b)  # its host copy is still there: it leaves without a copy
    assert b.storage.swapped and eng.stats.swap_stall == 10


def test_swap_options_fail_clearly():
    with pytest.raises(EngineError, match="unknown swap mode 'al'"):
        Engine(B, "lru", swap="al")
    with pytest.raises(EngineError, match="inplace='cow'"):
        Engine(B, "lru", inplace="remat", swap="only")
    with pytest.raises(MembudgetError, match="unknown swap mode"):
        membudget.budget("1 MiB", swap="yes")
    with pytest.raises(NotImplementedError, match="planned"):
        membudget.budget("1 MiB", mode="planned", swap="both")


def test_swap_lowers_the_budget_a_trace_completes_at():
    # The DTR paper's LSTM and TreeLSTM logs (a TITAN V on PCIe 3.0): at 0.1 of the peak
    # recomputation alone runs out of memory or past the 2x overhead limit, while copies to
    # the host complete; at a roomy budget "both" costs within 1 % of recomputation (a
    # copy priced cheaper can still wait on a busy link: 6.55 % against 6.51 % on lstm).
    from membudget.sim import simulate
    from membudget.sim.simulate import measure_baseline
    from membudget.trace import expand_sources, load_trace

    logs = {load_trace(s).name: s for s in expand_sources([str(LOGS)])}
    for name in ("lstm", "treelstm"):
        trace = load_trace(logs[name])
        base = measure_baseline(trace)
        runs = {(m, r): simulate(trace, "dtr", ratio=r, baseline=base, swap=m)
                for m in ("off", "only", "both") for r in (0.5, 0.1)}
        for r in runs.values():
            if r.status == "ok":
                assert r.peak_bytes <= r.budget_bytes
        assert runs["both", 0.5].overhead <= runs["off", 0.5].overhead * 1.01
        only = runs["only", 0.1]
        assert only.remat_ops == 0 and only.extra["swap_outs"] > 0
        assert runs["off", 0.1].status != "ok" and only.status == "ok"


@pytest.mark.parametrize("swap", ["only", "both"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2"])
def test_swapped_values_come_back_bitwise_equal(name, swap):
    model, loss_fn = MODELS[name]()
    state = copy.deepcopy(model.state_dict())
    ref_loss, ref_grads = reference(model, loss_fn, state)
    reset(model, state)
    with membudget.budget(10**10) as free:
        train_step(model, loss_fn)
    nbytes = int(free.stats.peak_bytes * 0.5)
    reset(model, state)
    with membudget.budget(nbytes, swap=swap) as session:
        loss = train_step(model, loss_fn)
    st = session.stats
    assert st.peak_bytes <= nbytes and st.evictions > 0
    if swap == "only":  # ("both" may find every victim cheaper to recompute on a CPU)
        assert st.swap_outs > 0 and st.swap_ins > 0 and st.remat_ops == 0
    assert torch.equal(loss, ref_loss)
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        assert torch.equal(p.grad, g)


# budgets where the live run reads swapped values back (at 0.5 the mlp's "both" run swaps
# two out and needs neither again)
@pytest.mark.parametrize(("name", "swap", "ratio"), [("mlp", "both", 0.45), ("gpt2", "only", 0.5)])
def test_a_recorded_run_with_swaps_replays_with_the_same_decisions(tmp_path, name, swap, ratio):
    from membudget.sim import simulate
    from membudget.trace import load_trace

    model, loss_fn = MODELS[name]()
    state = copy.deepcopy(model.state_dict())
    reset(model, state)
    with membudget.budget(10**10) as free:
        train_step(model, loss_fn)
    budget = int(free.stats.peak_bytes * ratio)
    path = tmp_path / "swap.jsonl.gz"
    reset(model, state)
    with membudget.budget(budget, swap=swap, record=path) as session:
        train_step(model, loss_fn)
    live = session.stats
    assert live.swap_outs > 0 and live.swap_ins > 0
    sim = simulate(load_trace(path), "default", budget=budget, overhead_limit=None, swap=swap)
    assert sim.status == "ok"
    assert (sim.evictions, sim.remat_ops, sim.extra["swap_outs"], sim.extra["swap_ins"],
            sim.peak_bytes) == (live.evictions, live.remat_ops, live.swap_outs, live.swap_ins,
                                live.peak_bytes)


def test_pinned_values_go_to_the_host_as_a_last_resort_never_dropped():
    # Budget = 2 blocks. u (0 B) moves the clock: x is last used at 1, then y at 4+10.
    # y is pinned as unsafe to recompute, though recomputing it (cost 10) would cost less
    # than its copies (200). With no candidate left, the put of z sends the least
    # recently used pinned storage, x, to the host; reading x back then sends y (z was
    # read later), and reading y sends z: nothing is ever dropped or recomputed.
    eng = Engine(2 * B, "lru", "fungible", executor(overlap=False, pinned=True), swap="both")
    x = eng.put(B)
    eng.apply("op0", [x], [0], cost=3.0)
    (y,) = eng.apply("op", [x], [B], cost=10.0)
    eng.pin(y)
    z = eng.put(B)
    assert x.storage.swapped and y.defined and z.defined
    eng.apply("op1", [z], [0], cost=1.0)
    eng.apply("op2", [z], [0], cost=1.0)
    eng.get_value(x)
    assert x.defined and y.storage.swapped and z.defined
    eng.get_value(y)
    assert y.defined and z.storage.swapped
    st = eng.stats
    assert (st.swap_outs, st.swap_ins, st.remat_ops) == (3, 2, 0)
    assert not any(t.storage.evicted for t in (x, y, z)) and eng.peak_bytes <= 2 * B
    assert not eng.evict(x)  # not a candidate of the policy's: only room can send it


def test_pinned_values_stay_where_the_executor_does_not_own_them():
    # Recomputation alone, or an executor that does not own the program's parameters (the
    # live runtime's), cannot free a leaf: three leaves need three blocks.
    from membudget.errors import OutOfBudget
    from membudget.runtime.executor import TorchExecutor

    assert not TorchExecutor().swaps_pinned
    for eng in (Engine(2 * B, "lru", "fungible", executor(False, pinned=True), swap="off"),
                Engine(2 * B, "lru", "fungible", executor(False, pinned=False), swap="both")):
        eng.put(B)
        eng.put(B)
        with pytest.raises(OutOfBudget, match="pinned"):
            eng.put(B)
