"""Static checkpointing baselines as eviction plans: what each keeps, and that a plan's run
under an unlimited budget is exactly the plan (its evictions, and one recomputation of each
value it evicted that the backward reads)."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from membudget.errors import UnknownNameError
from membudget.sim import baselines, keepsets, measure_baseline
from membudget.sim.keepsets import NotATransformer, StepGraph
from membudget.trace import load_trace
from membudget.trace.format import CALL, GET, PHASE, PUT, RELEASE, Trace
from membudget.trace.synthetic import resnet_step

LOGS = Path(__file__).resolve().parents[1].parent / "shared" / "dtr-logs" / "logs.zip"
needs_logs = pytest.mark.skipif(not LOGS.is_file(), reason=f"{LOGS} is missing")

SIZE, COST = 1000, 10.0


def call(op, ins, outs, nbytes, cost, alias=None, mut=()):
    alias = tuple(alias) if alias is not None else (-1,) * len(outs)
    return (CALL, None, op, tuple(ins), tuple(outs), tuple(nbytes), alias, float(cost),
            tuple(mut))


def chain(n: int, blocks: list[list[int]] | None = None, op: str = "conv") -> Trace:
    """x0 (input) -> x1 -> ... -> xn -> loss, every activation SIZE bytes and COST to make
    and held for the backward (autograd's saved input of the next op); the backward runs
    in reverse, each step reading its saved input, and releases it."""
    ev = [(PUT, None, 0, SIZE, "input"), (PHASE, None, "forward")]
    ev += [call(op, [i - 1], [i], [SIZE], COST) for i in range(1, n + 1)]
    loss, seed, g = n + 1, n + 2, n + 3
    ev += [call("sum", [n], [loss], [4], COST), (PHASE, None, "backward"),
           call("ones_like", [loss], [seed], [4], 1.0),
           call("sum_backward", [seed, n], [g], [SIZE], COST), (RELEASE, None, seed),
           (RELEASE, None, n)]
    for i in range(n, 0, -1):
        ev += [call(f"{op}_backward", [g, i - 1], [g + 1], [SIZE], 2 * COST),
               (RELEASE, None, g)]
        if i > 1:
            ev.append((RELEASE, None, i - 1))
        g += 1
    ev += [(RELEASE, None, g), (GET, None, loss)]
    return Trace({"model": f"chain{n}", **({"blocks": blocks} if blocks else {})}, ev)


def attention() -> Trace:
    """One attention layer: q, k, v from x; scores = q k^T; softmax; dropout (its mask made
    in place, as aten records it); out = probs v; loss. Handles held as autograd saves."""
    s = 4 * SIZE  # a score matrix: seq x seq, larger than the seq x d activations
    ev = [(PUT, None, 1, SIZE, "input"), (PUT, None, 2, 100, "parameter"),
          (PUT, None, 3, 100, "parameter"), (PUT, None, 4, 100, "parameter"),
          (PHASE, None, "forward"),
          call("aten.mm.default", [1, 2], [5], [SIZE], COST),  # q          0
          call("aten.mm.default", [1, 3], [6], [SIZE], COST),  # k          1
          call("aten.mm.default", [1, 4], [7], [SIZE], COST),  # v          2
          call("aten.bmm.default", [5, 6], [8], [s], 4 * COST),  # scores   3
          call("aten.div.Tensor", [8], [9], [s], COST), (RELEASE, None, 8),  # 4
          call("aten._softmax.default", [9], [10], [s], COST), (RELEASE, None, 9),  # 5
          call("aten.empty_like.default", [10], [11], [s], 0.0),  # mask   6
          call("aten.bernoulli_.float", [11], [], [], COST, mut=[0]),  # 7
          call("aten.mul.Tensor", [10, 11], [12], [s], COST),  # dropped    8
          call("aten.bmm.default", [12, 7], [13], [SIZE], 4 * COST),  # out 9
          call("aten.sum.default", [13], [14], [4], COST),  # loss          10
          (PHASE, None, "backward"),
          call("aten.ones_like.default", [14], [15], [4], 1.0),
          call("aten.sum_backward", [15, 13], [16], [SIZE], COST),
          (RELEASE, None, 15), (RELEASE, None, 13),
          call("aten.bmm_backward", [16, 12, 7], [17, 18], [s, SIZE], 8 * COST),
          (RELEASE, None, 16), (RELEASE, None, 12), (RELEASE, None, 7),
          call("aten.mul_backward", [17, 11], [19], [s], COST),
          (RELEASE, None, 17), (RELEASE, None, 11),
          call("aten._softmax_backward_data", [19, 10], [20], [s], COST),
          (RELEASE, None, 19), (RELEASE, None, 10),
          call("aten.bmm_backward", [20, 5, 6], [21, 22], [SIZE, SIZE], 8 * COST),
          (RELEASE, None, 20), (RELEASE, None, 5), (RELEASE, None, 6),
          (RELEASE, None, 21), (RELEASE, None, 22), (RELEASE, None, 18), (GET, None, 14)]
    return Trace({"model": "attention"}, ev)


def _kept(g: StepGraph, keep: keepsets.KeepSet) -> set[tuple[int, int]]:
    return {g.values[v].key for v in keep.keep if g.values[v].nbytes}  # type: ignore[misc]


# ------------------------------------------------------------------------------ Chen √n
@pytest.mark.parametrize("n", [16, 64, 100])
def test_chen_on_a_chain_peaks_near_2_sqrt_n_and_recomputes_one_forward(n):
    tr = chain(n)
    g = StepGraph(tr)
    base = measure_baseline(tr)
    assert base.peak_bytes >= (n + 1) * SIZE  # every activation at the backward's start
    keep = keepsets.chen_sqrt(g)
    cuts = len(keep.keep)  # one activation per cut (the plan keeps the loss too)
    assert keep.info["segments"] == round(math.sqrt(n + 1))  # n activations and the loss
    assert cuts == keep.info["segments"] - 1
    r = baselines.run_plan(tr, baselines.chen_sqrt(tr, graph=g), base)
    assert r.status == "ok"
    # √n checkpoints + one segment of √n recomputed + the input and a gradient or two
    assert abs(r.peak_bytes / SIZE - 2 * math.sqrt(n)) <= 3
    # one extra forward: every activation but the checkpoints, recomputed exactly once
    assert r.remat_ops == n - cuts
    assert r.remat_cost == pytest.approx((n - cuts) * COST)
    assert r.remat_cost >= (1 - 1.5 / math.sqrt(n)) * keepsets.forward_cost(g)


def test_chen_segments_can_be_given():
    tr = chain(20)
    g = StepGraph(tr)
    keep = keepsets.chen_sqrt(g, segments=5)
    assert keep.info["segments"] == 5
    calls = sorted(k for k, _ in _kept(g, keep))  # evenly by cost: 21 calls of equal cost
    assert calls == [3, 7, 12, 16]  # x4, x8, x13, x17: nearest the targets 4.2, 8.4, ...


# ------------------------------------------------------------------------------ per block
def test_per_block_keeps_only_block_inputs():
    blocks = [[0, 3], [3, 6], [6, 9], [9, 12]]  # x1..x3, x4..x6, ...: calls 0-2, 3-5, ...
    tr = chain(12, blocks=blocks)
    g = StepGraph(tr)
    keep = keepsets.per_block(g, baselines.header_blocks(tr))
    assert keep.info["block_source"] == "given"
    # block inputs x3, x6, x9 (x0 is a leaf); x12 leaves the last block for the loss
    x = {i: (i - 1, 0) for i in range(1, 13)}
    assert _kept(g, keep) == {x[3], x[6], x[9], x[12], (12, 0)}
    plan = baselines.make_plan("per-block", tr)
    evicted = {x[i] for i in (1, 2, 4, 5, 7, 8, 10, 11)}
    assert plan.values() == evicted and plan.source == "per-block"
    r = baselines.run_plan(tr, plan)
    assert r.status == "ok" and r.remat_ops == len(evicted)
    assert r.peak_bytes < measure_baseline(tr).peak_bytes


def test_per_block_without_blocks_in_the_header_infers_them_or_says_it_cannot():
    g = StepGraph(chain(12))
    with pytest.raises(Exception, match="no repeated blocks"):
        keepsets.per_block(g)  # a plain chain repeats one op: no layer structure
    tr = resnet_step(depth=6)
    keep = keepsets.per_block(StepGraph(tr))
    assert keep.info["block_source"] == "inferred" and keep.info["blocks"] >= 4


# ------------------------------------------------------------------------------ SAR
def test_selective_evicts_the_attention_core_only():
    tr = attention()
    g = StepGraph(tr)
    assert len(keepsets.attention_cores(g)) == 1
    keep = keepsets.selective(g)
    forward = {v.key for v in g.forward_values() if v.nbytes}
    core = {(3, 0), (4, 0), (5, 0), (6, 0), (7, 0), (8, 0)}  # scores .. dropped probs
    assert forward - _kept(g, keep) == core
    # the program still holds three after the forward: softmax output, mask, dropped probs
    assert {key for keys in baselines.forward_evictions(g, keep.keep).values()
            for key in keys} == {(5, 0), (7, 0), (8, 0)}
    # the rest are recomputed on the way in the backward, and evicted again after; but for
    # the mask's empty value, which its recomputed write takes the block of (the engine
    # evicts it then, so the plan need not)
    plan = baselines.make_plan("selective", tr)
    assert plan.values() == core - {(6, 0)}
    r = baselines.run_plan(tr, plan)
    assert r.status == "ok"
    # recomputed once each: the scores, the scaled scores, softmax, the mask, the dropout
    assert r.remat_cost == pytest.approx(4 * COST + COST + COST + COST + COST)


def test_selective_on_a_trace_without_attention_says_so():
    with pytest.raises(NotATransformer, match=r"needs a transformer trace.*no attention core"):
        baselines.make_plan("selective", chain(8))
    with pytest.raises(NotATransformer):
        baselines.selective(resnet_step(depth=2))


# ------------------------------------------------------------------------------ knapsack
def test_knapsack_is_exact():
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(1, 10)
        sizes = [rng.randint(0, 50) for _ in range(n)]
        values = [rng.randint(0, 30) for _ in range(n)]
        cap = rng.randint(0, 120)
        take, optimal = keepsets.knapsack(sizes, values, cap)
        assert optimal and sum(sizes[i] for i in take) <= cap
        best = max(sum(values[i] for i in c) for r in range(n + 1)
                   for c in itertools.combinations(range(n), r)
                   if sum(sizes[i] for i in c) <= cap)
        assert sum(values[i] for i in take) == best


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 1.0])
def test_min_cut_saves_within_its_budget(fraction):
    tr = resnet_step(depth=4)
    g = StepGraph(tr)
    total = sum(v.nbytes for v in g.saved())
    budget = int(fraction * total)
    keep = keepsets.min_cut(g, budget)
    saved = [v for v in g.saved() if v.index in keep.keep]
    assert sum(v.nbytes for v in saved) == keep.info["saved_bytes"] <= budget
    if fraction == 1.0:
        assert len(saved) == len(g.saved())
    r = baselines.run_plan(tr, baselines.min_cut(tr, budget=budget, graph=g))
    assert r.status == "ok" and r.search_us["count"] == 0


def test_fusion_aware_min_cut_keeps_fewer_pointwise_outputs():
    tr = resnet_step(depth=4)
    g = StepGraph(tr)
    budget = sum(v.nbytes for v in g.saved()) // 2

    def pointwise_saved(fusion_aware: bool) -> int:
        keep = keepsets.min_cut(g, budget, fusion_aware).keep
        return sum(keepsets.is_pointwise(v.op) for v in g.saved() if v.index in keep)

    assert pointwise_saved(True) < pointwise_saved(False)
    assert keepsets.min_cut(g, budget, True).info["estimated_recompute"] < \
        keepsets.min_cut(g, budget, False).info["estimated_recompute"]


def test_the_pointwise_list_agrees_with_pytorchs_tags():
    import torch

    for name in keepsets.POINTWISE_TAGGED:
        packet = getattr(torch.ops.aten, name)
        assert any(torch.Tag.pointwise in getattr(packet, o).tags
                   for o in packet.overloads()), name
    for name in keepsets.POINTWISE_UNTAGGED:
        packet = getattr(torch.ops.aten, name, None)
        assert packet is None or not any(torch.Tag.pointwise in getattr(packet, o).tags
                                         for o in packet.overloads()), name


def test_op_base_names_the_op_across_trace_sources():
    assert keepsets.op_base("aten.add_.Tensor") == "add"
    assert keepsets.op_base("relu_") == "relu"
    assert keepsets.op_base("aten._softmax.default") == "_softmax"
    assert keepsets.is_pointwise("aten.gelu.default") and keepsets.is_pointwise("_masked_scale")
    assert not keepsets.is_pointwise("aten.mm.default")
    assert not keepsets.is_pointwise("cudnn_convolution")


# ------------------------------------------------------------------------------ the plans run
@pytest.mark.parametrize("name", ["chen-sqrt", "per-block", "min-cut"])
def test_with_no_budget_a_plan_runs_exactly_as_planned(name):
    """On a chain every evicted activation is read once by the backward: the run evicts
    what the plan lists, the policy never searches, and each evicted value is recomputed
    exactly once (its own op's cost, nothing else)."""
    tr = chain(36, blocks=[[i, i + 6] for i in range(0, 36, 6)])
    options = {"budget": 10 * SIZE} if name == "min-cut" else {}
    plan = baselines.make_plan(name, tr, **options)
    r = baselines.run_plan(tr, plan)
    assert r.status == "ok" and r.search_us["count"] == 0
    assert r.evictions == plan.evictions == len(plan.values())
    assert r.remat_ops == len(plan.values())
    assert r.remat_cost == pytest.approx(COST * len(plan.values()))
    assert r.overhead == pytest.approx(r.remat_cost / r.baseline_cost)


def test_unknown_baseline_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="chen-sqrt"):
        baselines.make_plan("checkmate", chain(4))


def test_a_recomputed_intermediate_is_evicted_again_after_its_last_read():
    """On the synthetic ResNet, batch norm's output is not held (relu saves its own output)
    so the engine recomputes it on the way to the relu output the backward reads; the plan
    drops it again afterwards, so no recomputed value outlives its reads: the peak under
    Chen's plan is below the unconstrained one, and the plan's run matches the dry run."""
    tr = resnet_step(depth=6)
    g = StepGraph(tr)
    plan = baselines.chen_sqrt(tr, graph=g)
    forward = baselines.forward_evictions(g, keepsets.chen_sqrt(g).keep | g.results())
    assert plan.evictions > sum(map(len, forward.values()))  # evicted again in the backward
    r = baselines.run_plan(tr, plan)
    assert r.status == "ok" and r.evictions == plan.evictions
    assert r.peak_bytes < 0.75 * r.baseline_peak_bytes
    assert r.remat_cost <= keepsets.forward_cost(g)  # no value made twice


# ------------------------------------------------------------------------------ captured blocks
def test_repeated_blocks_are_the_innermost_repeats_with_weight():
    from torch import nn

    from membudget.trace.capture import repeated_blocks

    class ConvBN(nn.Module):  # two parametrized submodules: a layer, not a block
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2)

    class Bottleneck(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Sequential(ConvBN(), ConvBN(), ConvBN())

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(Bottleneck(), Bottleneck())

    stages = nn.ModuleList([Stage(), Stage()])
    model = nn.Sequential(nn.Conv2d(3, 2, 1), nn.ReLU(), nn.ReLU(), *stages)
    assert repeated_blocks(model) == [b for st in stages for b in st.layers]


def test_a_capture_records_its_blocks_and_per_block_follows_them(tmp_path):
    from membudget import models
    from membudget.trace.capture import capture_step

    name = "mobilenet-v2"
    cap = capture_step(name, models.get(name).small_batch, fake=True,
                       path=tmp_path / "t.jsonl.gz")
    tr = load_trace(cap.path)
    g = StepGraph(tr)
    blocks = baselines.header_blocks(tr)
    assert blocks is not None and len(blocks) == 16  # MobileNet-V2's inverted residuals
    assert all(b < e <= c for (b, e), (c, _) in itertools.pairwise(blocks))
    assert blocks[-1][1] < g.boundary  # all in the forward
    assert all(sum("convolution" in op for op in g.call_ops[b:e]) >= 2 for b, e in blocks)
    base = measure_baseline(tr)
    r = baselines.run_plan(tr, baselines.per_block(tr, graph=g), base)
    assert r.status == "ok" and r.peak_bytes < 0.8 * base.peak_bytes


@needs_logs
def test_the_dtr_logs_transformer_has_its_attention_cores_and_each_plan_runs():
    tr = load_trace(f"{LOGS}::transformer")
    g = StepGraph(tr)
    assert g.boundary_source == "phase marker"
    assert len(keepsets.attention_cores(g)) == 24
    base = measure_baseline(tr)
    for name in ("chen-sqrt", "selective"):
        r = baselines.run_plan(tr, baselines.make_plan(name, tr, graph=g), base)
        assert r.status == "ok" and r.peak_bytes < base.peak_bytes
        assert 0 < r.overhead < 0.45


@needs_logs
def test_without_a_phase_marker_the_boundary_is_the_first_backward_op():
    g = StepGraph(load_trace(f"{LOGS}::unroll_gan"))
    assert g.boundary_source.startswith("inferred")
    assert "backward" in g.call_ops[g.boundary]
    assert all("backward" not in op for op in g.call_ops[:g.boundary])
