"""Operator-order planning: the dataflow graph of a trace, the independent order validator,
the greedy schedules, OLLA's lifetime ILP (CP-SAT and HiGHS) against brute force, and the
DTR logs end to end. Every order produced here goes through ``check_order``."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from membudget.plan import lifetime_ilp
from membudget.plan.check_order import OrderError, check_order, order_peak
from membudget.plan.graph import LEAF, Graph, GraphError, Tensor, from_trace, layered
from membudget.plan.order import optimize_order, segment
from membudget.plan.schedule import GREEDY_RULES, best_greedy, contract, greedy_order
from membudget.trace import read_dtr_log
from membudget.trace.format import Trace, parse_event
from membudget.trace.synthetic import resnet_step

LOGS_ZIP = Path(__file__).parents[1].parent / "shared" / "dtr-logs" / "logs.zip"
needs_logs = pytest.mark.skipif(not LOGS_ZIP.is_file(), reason=f"no DTR logs at {LOGS_ZIP}")

# The example of docs/trace-format.md: its baseline peak is 20 484 bytes.
DOC_EXAMPLE = """\
{"ev":"put","t":1,"bytes":4096,"kind":"param"}
{"ev":"put","t":2,"bytes":8192,"kind":"input"}
{"ev":"call","op":"mm","in":[2,1],"out":[3],"bytes":[8192],"cost":12000}
{"ev":"copy","src":2,"t":4}
{"ev":"release","t":2}
{"ev":"call","op":"view","in":[3],"out":[5],"bytes":[0],"alias":[0],"cost":800}
{"ev":"release","t":3}
{"ev":"call","op":"sum","in":[5],"out":[6],"bytes":[4],"cost":3000}
{"ev":"release","t":5}
{"ev":"call","op":"mm_backward","in":[6,4],"out":[7],"bytes":[4096],"cost":12000}
{"ev":"release","t":4}
{"ev":"call","op":"sgd_","in":[1,7],"out":[],"bytes":[],"cost":2000,"mut":[0]}
{"ev":"release","t":7}
{"ev":"get","t":6}"""


def trace_of(text: str) -> Trace:
    events = [parse_event(json.loads(line), "<test>", i + 2)
              for i, line in enumerate(text.splitlines())]
    return Trace({"model": "test"}, events)


def brute_force_min_peak(g: Graph) -> int:
    """The least peak over every topological order (enumerated by depth-first search)."""
    best = None
    indeg = [len(p) for p in g.preds]
    order: list[int] = []

    def visit() -> None:
        nonlocal best
        if len(order) == g.n:
            peak = order_peak(g, order)
            best = peak if best is None else min(best, peak)
            return
        for v in range(g.n):
            if indeg[v] == 0 and v not in order:
                order.append(v)
                for w in g.succs[v]:
                    indeg[w] -= 1
                visit()
                for w in g.succs[v]:
                    indeg[w] += 1
                order.pop()

    visit()
    assert best is not None
    return best


@st.composite
def small_dags(draw: st.DrawFn, max_nodes: int = 7) -> Graph:
    """Random DAGs whose node ids are a topological order: tensors of sizes 0..32 with 0-3
    later sinks, some held to the end, a few control edges, and leaves."""
    n = draw(st.integers(1, max_nodes))
    tensors = [Tensor("leaf", draw(st.integers(0, 16)), LEAF, (0,))]
    for v in range(n):
        for j in range(draw(st.integers(0, 2))):
            later = list(range(v + 1, n))
            sinks = draw(st.lists(st.sampled_from(later), max_size=3, unique=True)) if later \
                else []
            size = draw(st.sampled_from([0, 4, 8, 12, 16, 32]))
            tensors.append(Tensor(f"t{v}.{j}", size, v, tuple(sorted(sinks)),
                                  draw(st.booleans()) and draw(st.booleans())))
    return Graph([f"op{v}" for v in range(n)], tensors)


# ------------------------------------------------------------------------- graph from a trace
def test_doc_example_graph_and_recorded_peak() -> None:
    g = from_trace(trace_of(DOC_EXAMPLE))
    assert g.ops == ["mm", "view", "sum", "mm_backward", "sgd_", "get"]
    assert g.leaf_bytes == 4096 + 8192
    by_src = {t.src: t for t in g.tensors if t.size > 0 and t.src != LEAF}
    assert by_src[0].sinks == (1, 2)  # the view's reader keeps mm's storage alive
    assert by_src[2].to_end and by_src[2].sinks == (3, 5)  # the loss is held and read
    assert by_src[3].sinks == (4,)
    assert 4 in g.succs[0]  # the in-place update of the weight runs after mm read it
    assert 2 in g.succs[1]  # the view's reader after the view
    assert g.recorded_peak() == 20484  # as the doc's baseline
    assert g.lower_bound() == 20484  # sum's working set + the leaves: already optimal
    check_order(g, range(g.n), 20484)


def test_in_place_write_is_ordered_between_readers_of_old_and_new_value() -> None:
    g = from_trace(trace_of("""\
{"ev":"put","t":1,"bytes":8,"kind":"input"}
{"ev":"call","op":"exp","in":[1],"out":[2],"bytes":[100],"cost":1}
{"ev":"copy","src":2,"t":3}
{"ev":"call","op":"neg","in":[3],"out":[4],"bytes":[10],"cost":1}
{"ev":"call","op":"relu_","in":[2],"out":[],"bytes":[],"cost":1,"mut":[0]}
{"ev":"call","op":"sum","in":[3],"out":[5],"bytes":[4],"cost":1}
{"ev":"release","t":2}
{"ev":"release","t":3}
{"ev":"release","t":4}"""))
    exp_out = next(t for t in g.tensors if t.src == 0 and t.size)
    assert exp_out.sinks == (1, 2, 3)  # one storage: old and new version
    assert 2 in g.succs[1] and 3 in g.succs[2]  # neg < relu_ < sum (even via another handle)
    assert g.out_bytes[2] == 0  # the write allocates nothing
    with pytest.raises(OrderError, match="runs before"):
        check_order(g, [0, 2, 1, 3], 0)


def test_get_becomes_a_node_and_an_overwriting_pin_makes_the_next_call_a_writer() -> None:
    trace = trace_of("""\
{"ev":"put","t":1,"bytes":8,"kind":"param"}
{"ev":"call","op":"mul","in":[1,1],"out":[2],"bytes":[8],"cost":1}
{"ev":"get","t":2}
{"ev":"pin","t":1,"overwrite":true}
{"ev":"call","op":"adam","in":[1],"out":[],"bytes":[],"cost":1}
{"ev":"call","op":"neg","in":[1],"out":[3],"bytes":[8],"cost":1}""")
    g = from_trace(trace)
    assert g.ops == ["mul", "get", "adam", "neg"]
    assert 2 in g.succs[0]  # the update follows the weight's earlier reader
    assert 3 in g.succs[2]  # and precedes its later reader
    check_order(g, [0, 1, 2, 3], 24)
    with pytest.raises(OrderError, match="runs before"):
        check_order(g, [0, 1, 3, 2], 24)


def test_cyclic_graph_names_a_node_on_the_cycle() -> None:
    tensors = [Tensor("a", 4, 0, (1,)), Tensor("b", 4, 1, (2,)), Tensor("c", 4, 2, (1,)),
               Tensor("d", 4, 3, (0,))]
    with pytest.raises(GraphError, match=r"cycle through node (op1|op2)\b"):
        Graph(["op0", "op1", "op2", "op3"], tensors, labels=["op0", "op1", "op2", "op3"])
    with pytest.raises(GraphError, match="op0"):
        Graph(["op0"], [Tensor("self", 1, 0, (0,))], labels=["op0"])


def test_bad_tensor_references_are_rejected() -> None:
    with pytest.raises(GraphError, match="outside"):
        Graph(["a"], [Tensor("t", 4, 0, (3,))])
    with pytest.raises(GraphError, match="negative"):
        Graph(["a"], [Tensor("t", -1, 0)])


def test_synthetic_step_at_batch_1_gains_a_third_by_reordering() -> None:
    """Early weight updates free the gradients: OLLA's batch-1 effect, proven optimal."""
    g = from_trace(resnet_step(batch=1))
    r = optimize_order(g, time_limit=20)
    check_order(g, r.order, r.peak)
    assert r.optimal and r.peak == r.lower_bound and r.gap == 0.0
    assert r.reduction is not None and r.reduction > 0.3


# ------------------------------------------------------------------------- the validator
def test_validator_rejects_bad_orders() -> None:
    g = Graph(["a", "b", "c"], [Tensor("x", 10, 0, (1, 2)), Tensor("y", 5, 1, (2,)),
                                Tensor("ctrl", 0, 2, ()), Tensor("w", 3, LEAF)],
              labels=["a", "b", "c"])
    check_order(g, [0, 1, 2], 3 + 15)
    with pytest.raises(OrderError, match="runs before"):
        check_order(g, [1, 0, 2], 18)
    with pytest.raises(OrderError, match="misses 1 node"):
        check_order(g, [0, 1], 18)
    with pytest.raises(OrderError, match="appears twice"):
        check_order(g, [0, 1, 1, 2], 18)
    with pytest.raises(OrderError, match="not a node id"):
        check_order(g, [0, 1, 7], 18)
    with pytest.raises(OrderError, match="claimed peak 17"):
        check_order(g, [0, 1, 2], 17)


def test_validator_checks_control_edges() -> None:
    g = Graph(["a", "b"], [Tensor("ctrl", 0, 1, (0,))], labels=["a", "b"])
    check_order(g, [1, 0], 0)
    with pytest.raises(OrderError, match="runs before"):
        check_order(g, [0, 1], 0)


# ------------------------------------------------------------------------- greedy, contraction
@settings(max_examples=60)
@given(small_dags())
def test_greedy_orders_are_valid_and_contraction_keeps_the_optimum(g: Graph) -> None:
    for rule in GREEDY_RULES:
        order = greedy_order(g, rule)
        check_order(g, order, g.peak(order))
    c = contract(g)
    for order in itertools.islice(itertools.permutations(range(c.graph.n)), 50):
        if all(order.index(u) < order.index(v) for v in range(c.graph.n)
               for u in c.graph.preds[v]):
            full = c.expand(order)
            check_order(g, full, c.graph.peak(order))
    assert brute_force_min_peak(c.graph) == brute_force_min_peak(g)


# ------------------------------------------------------------------------- the ILP
@settings(max_examples=40)
@given(small_dags())
def test_ilp_optimum_equals_brute_force(g: Graph) -> None:
    best = brute_force_min_peak(g)
    r = optimize_order(g, time_limit=20, rel_gap=0.0)
    check_order(g, r.order, r.peak)
    assert r.optimal and r.peak == best == r.bound
    assert max(g.lower_bound(), g.must_live_bound()) <= r.peak <= g.recorded_peak()
    # the ILP itself, not only the bounds, on the whole uncontracted graph
    start, peak, _ = best_greedy(g)
    ilp = lifetime_ilp.solve(g, "cpsat", 20, start, peak, g.lower_bound())
    assert ilp.status == "optimal" and ilp.peak == best
    check_order(g, ilp.order, best)


@settings(max_examples=15)
@given(small_dags())
def test_cpsat_and_highs_agree(g: Graph) -> None:
    start, peak, _ = best_greedy(g)
    results = [lifetime_ilp.solve(g, s, 20, start, peak, g.lower_bound()) for s in
               lifetime_ilp.SOLVERS]
    for r in results:
        assert r.status == "optimal"
        check_order(g, r.order, r.peak)
    assert results[0].peak == results[1].peak


@pytest.mark.parametrize("solver", ["cpsat", "highs"])
def test_ilp_improves_a_layered_graph_and_reports_progress(solver: str) -> None:
    g = layered(3, layers=5, width=4)
    seen = []
    r = optimize_order(g, time_limit=20, solver=solver, progress=seen.append)
    check_order(g, r.order, r.peak)
    greedy = best_greedy(contract(g).graph)[1]
    assert r.method == "ilp" and r.optimal and r.peak == 23808 < greedy
    assert r.lower_bound <= r.bound <= r.peak
    assert r.gap == pytest.approx((r.peak - r.bound) / r.peak)
    assert seen and seen[0].stage == "greedy" and all(p.bound <= p.peak for p in seen)


def test_tiny_time_limit_returns_the_greedy_order_unproven() -> None:
    g = layered(1)
    r = optimize_order(g, time_limit=0.1)
    check_order(g, r.order, r.peak)
    assert r.method == "greedy" and r.status == "greedy" and not r.optimal
    assert r.lower_bound <= r.peak and r.gap > 0 and r.seconds < 2


def test_windows_keep_the_order_valid_and_never_worse() -> None:
    g = layered(3, layers=8, width=4)
    r = optimize_order(g, time_limit=5, window=12, whole_graph_vars=0)
    check_order(g, r.order, r.peak)
    assert r.method == "windows"
    assert r.peak <= best_greedy(contract(g).graph)[1]


def test_segment_graph_reproduces_the_memory_of_its_steps() -> None:
    g = layered(2, layers=8, width=5)
    order = greedy_order(g)
    profile = g.profile(order)
    for a, b in ((0, 10), (7, 23), (25, 40)):
        seg, nodes = segment(g, order, a, b)
        assert nodes == order[a:b]
        assert seg.peak(range(seg.n)) == profile[a:b].max()


# ------------------------------------------------------------------------- DTR logs
@needs_logs
@pytest.mark.parametrize("model", ["resnet32", "unet"])
def test_small_dtr_logs_run_through(model: str) -> None:
    g = from_trace(read_dtr_log(f"{LOGS_ZIP}::{model}"))
    r = optimize_order(g, time_limit=10)
    check_order(g, r.order, r.peak)
    assert r.lower_bound <= r.bound <= r.peak <= g.recorded_peak()
    assert r.gap <= 1e-4  # these recorded orders are already optimal within 0.01 %


@needs_logs
def test_a_large_dtr_log_is_improved_window_by_window() -> None:
    g = from_trace(read_dtr_log(f"{LOGS_ZIP}::lstm"))
    r = optimize_order(g, time_limit=8)
    check_order(g, r.order, r.peak)
    assert r.method == "windows" and not r.optimal
    assert r.lower_bound <= r.peak < g.recorded_peak()


@needs_logs
@pytest.mark.slow
@pytest.mark.parametrize("model", ["inceptionv4", "transformer", "treelstm", "tv_densenet121",
                                   "unroll_gan"])
def test_every_dtr_log_runs_through(model: str) -> None:
    g = from_trace(read_dtr_log(f"{LOGS_ZIP}::{model}"))
    for solver in ("cpsat", "highs"):
        r = optimize_order(g, time_limit=20, solver=solver)
        check_order(g, r.order, r.peak)
        assert r.lower_bound <= r.bound <= r.peak <= g.recorded_peak()
