"""Static plans for ops on parallel streams: happens-before conflicts, the safe packer, the
independent multi-stream validator and the DDP-style step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from membudget.plan.ddp import COMM, COMPUTE, compare, ddp_from_trace, ddp_step
from membudget.plan.graph import LEAF, Graph, Tensor, from_trace
from membudget.plan.pack import pack
from membudget.plan.planner import location_problem
from membudget.plan.problem import PlanError
from membudget.plan.stream_pack import plan_streams
from membudget.plan.stream_validate import UnsafeSharingError, unsafe_pairs, validate_streams
from membudget.plan.streams import StreamError, StreamProgram, conflict_graph
from membudget.plan.validate import PackingError, validate
from membudget.trace.format import PHASE
from membudget.trace.synthetic import resnet_step

NAMES = {0: "compute", 1: "comm"}


def one_interleaving_program(waits: tuple[tuple[int, int], ...] = ()) -> StreamProgram:
    """``make_a`` (compute) makes A, which ``send`` (comm) reads; then ``make_b`` (compute)
    makes B, which ``use_b`` reads. In the listed order A is dead before B is made; on the
    streams, ``send`` may still run while ``make_b`` writes B."""
    g = Graph(["make_a", "send", "make_b", "use_b"],
              [Tensor("A", 64, 0, (1,)), Tensor("B", 64, 2, (3,))])
    return StreamProgram(g, [0, 1, 0, 0], waits, NAMES)


def test_the_validator_rejects_a_plan_safe_only_in_one_interleaving() -> None:
    program = one_interleaving_program()
    shared = {"0:A": 0, "1:B": 0}
    serial = location_problem(program.graph)
    assert validate(serial, shared) == 64  # fine in the listed (serial) order
    with pytest.raises(UnsafeSharingError) as e:
        validate_streams(program, shared)
    msg = str(e.value)
    for part in ("'0:A'", "'1:B'", "[0, 64)", "send#1 (stream 'comm')",
                 "unordered with make_b#2 (stream 'compute')"):
        assert part in msg
    assert validate_streams(program, {"0:A": 0, "1:B": 64}) == 128
    # A wait from send to make_b orders them on every execution: now sharing is safe.
    assert validate_streams(one_interleaving_program(waits=((1, 2),)), shared) == 64


def test_the_validator_names_an_op_that_reads_one_tensor_and_writes_the_other() -> None:
    g = Graph(["make_a", "a_to_b"], [Tensor("A", 8, 0, (1,)), Tensor("B", 8, 1, ())])
    program = StreamProgram(g, [0, 0])
    with pytest.raises(UnsafeSharingError, match=r"a_to_b#1 .* uses '0:A' and writes '1:B'"):
        validate_streams(program, {"0:A": 0, "1:B": 4})


def test_the_validator_checks_the_offsets_themselves() -> None:
    program = one_interleaving_program()
    with pytest.raises(PackingError, match="'1:B' has no offset"):
        validate_streams(program, {"0:A": 0})
    with pytest.raises(PackingError, match="'0:A' has negative offset"):
        validate_streams(program, {"0:A": -1, "1:B": 64})
    with pytest.raises(PackingError, match=r"does not have, e.g. 'C'"):
        validate_streams(program, {"0:A": 0, "1:B": 64, "C": 0})
    with pytest.raises(PackingError, match="exceeds the capacity 100"):
        validate_streams(program, {"0:A": 0, "1:B": 64}, capacity=100)


def test_ddp_step_serial_plan_is_unsafe_and_the_safe_plan_is_validated() -> None:
    trace = resnet_step(batch=1)
    step = ddp_from_trace(trace, bucket_bytes=256 * 1024)
    program, g = step.program, step.program.graph
    assert len(step.buckets) > 3
    assert step.gradient_bytes == sum(g.tensors[k].size for ks in step.buckets for k in ks)
    first_optimizer_op = min(v for _, v in program.waits)
    for ks, ar in zip(step.buckets, step.all_reduces, strict=True):
        assert program.streams[ar] == COMM
        assert all(g.tensors[k].sinks[-1] == ar for k in ks)  # the all-reduce reads them last
        assert max(g.tensors[k].src for k in ks) == ar - 1  # launched after the last one
        assert (ar, first_optimizer_op) in program.waits
    assert {program.streams[v] for v in range(g.n)} - {COMM} == {COMPUTE}

    c = compare(program, time_limit=2.0)
    serial = location_problem(g)
    assert c.serial_max_load == serial.max_load() <= c.serial_arena
    assert c.unsafe and c.unsafe_bytes > 0 and c.serial_only >= len(c.unsafe)
    assert any("all_reduce" in p.reason and "(stream 'comm')" in p.reason for p in c.unsafe)
    with pytest.raises(UnsafeSharingError, match="may be live at once"):
        validate_streams(program, pack(serial, time_limit=1.0).offsets)
    assert validate_streams(program, c.safe.offsets) == c.safe.height
    assert c.serial_max_load <= c.safe.lower_bound <= c.safe.height
    assert c.cost_of_safety == c.safe.height / c.serial_arena - 1


def test_a_step_without_an_optimizer_phase_has_no_gradients_to_reduce() -> None:
    trace = resnet_step(batch=1)
    trace.events = [ev for ev in trace.events if ev[0] != PHASE]
    with pytest.raises(PlanError, match="no 'optimizer' phase"):
        ddp_from_trace(trace)
    g = from_trace(resnet_step(batch=1))
    with pytest.raises(PlanError, match="is not a gradient"):
        ddp_step(g, [next(k for k, t in enumerate(g.tensors) if t.src == LEAF)], 5)


# --- bad stream programs ----------------------------------------------------------------

def three_op_graph() -> Graph:
    """Ops a, b, c joined by tensors x (a to b) and y (b to c)."""
    return Graph(["a", "b", "c"], [Tensor("x", 4, 0, (1,)), Tensor("y", 4, 1, (2,))])


@pytest.mark.parametrize(("streams", "waits", "names", "match"), [
    ([0, 0], (), None, "2 stream ids for the 3 ops"),
    ([0, -1, 0], (), None, "op b#1 has stream id -1"),
    ([0, 2, 0], (), NAMES, "op b#1 is on stream 2, which is not one of the named streams"),
    ([0, 1, 0], ((0, 7),), None, r"wait \(0, 7\) names op 7, but the ops of 'graph' are 0..2"),
    ([0, 1, 0], ((1, 1),), None, "op b#1 .* waits for itself"),
    ([0, 1, 0], ((2, 1),), NAMES, r"cycle(?=.*b#1 \(stream 'comm'\) -> c#2 \(stream "
                                  r"'compute'\) by tensor 'y')(?=.*c#2 \(stream 'compute'\) "
                                  r"-> b#1 \(stream 'comm'\) by a wait)"),
    ([0, 0, 0], ((2, 0),), None, "cycle.*by the order of stream 0"),
])
def test_bad_stream_programs_are_named(streams, waits, names, match) -> None:
    with pytest.raises(StreamError, match=match):
        StreamProgram(three_op_graph(), streams, waits, names)


def test_a_data_dependency_against_the_stream_order_is_a_cycle() -> None:
    g = Graph(["early", "late"], [Tensor("x", 4, 1, (0,))])  # late makes what early reads
    StreamProgram(g, [0, 1])  # on two streams, late may run first
    with pytest.raises(StreamError, match=r"cycle(?=.*late#1 \(stream 0\) -> early#0 "
                                          r"\(stream 0\) by tensor 'x')(?=.*early#0 \(stream "
                                          r"0\) -> late#1 \(stream 0\) by the order of "
                                          r"stream 0)"):
        StreamProgram(g, [0, 0])


# --- random stream programs -------------------------------------------------------------

@st.composite
def stream_programs(draw, max_streams: int = 3) -> StreamProgram:
    """Random small programs: ops on up to ``max_streams`` streams, tensors read by later
    ops (some held to the end, some leaves), and random waits between ops."""
    n = draw(st.integers(1, 9))
    tensors = [Tensor(f"leaf{i}", draw(st.integers(1, 16)), LEAF)
               for i in range(draw(st.integers(0, 2)))]
    for v in range(n):
        for j in range(draw(st.integers(0, 2))):
            later = st.lists(st.integers(v + 1, n - 1), max_size=3, unique=True) \
                if v + 1 < n else st.just([])
            tensors.append(Tensor(f"t{v}.{j}", draw(st.integers(0, 16)), v,
                                  tuple(sorted(draw(later))), draw(st.booleans()) and
                                  draw(st.booleans())))
    waits = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))
                          .filter(lambda w: w[0] < w[1]), max_size=3))
    streams = draw(st.lists(st.integers(0, max_streams - 1), min_size=n, max_size=n))
    return StreamProgram(Graph([f"op{v}" for v in range(n)], tensors), streams, waits)


@settings(max_examples=150, deadline=None)
@given(stream_programs())
def test_the_safe_plan_always_passes_the_validator(program: StreamProgram) -> None:
    plan = plan_streams(program)
    assert validate_streams(program, plan.offsets) == plan.height >= plan.lower_bound


@settings(max_examples=150, deadline=None)
@given(stream_programs())
def test_the_validator_and_the_conflict_graph_agree_on_every_pair(program) -> None:
    """Independent derivations: with every buffer at offset 0, the pairs the validator
    rejects are exactly the conflicts the packer avoids."""
    c = conflict_graph(program)
    unsafe = {frozenset((p.first, p.second))
              for p in unsafe_pairs(program, dict.fromkeys(c.ids, 0))}
    conflicts = {frozenset((c.ids[i], c.ids[j]))
                 for i, j in zip(*np.nonzero(np.triu(c.matrix)), strict=True)}
    assert unsafe == conflicts
    assert (c.matrix == c.matrix.T).all() and not c.matrix.diagonal().any()


@settings(max_examples=150, deadline=None)
@given(stream_programs(max_streams=1))
def test_on_one_stream_conflicts_are_the_serial_lifetimes_overlaps(program) -> None:
    g = program.graph
    problem = location_problem(g)
    c = conflict_graph(program)
    assert c.ids == tuple(b.id for b in problem.buffers)
    bufs = problem.buffers
    overlap = np.array([[a is not b and a.lower < b.upper and b.lower < a.upper for b in bufs]
                        for a in bufs], dtype=bool).reshape(len(bufs), len(bufs))
    assert (c.matrix == overlap).all()
    assert c.lower_bound == problem.max_load()
    # so the single-stream planner's packings are safe, and the safe plan is a valid one
    assert validate_streams(program, pack(problem, time_limit=0.5).offsets) >= 0
    assert validate(problem, plan_streams(program).offsets) >= problem.max_load()


def test_happens_before_goes_through_other_streams() -> None:
    """a (compute) -> b (comm) by a tensor, b -> c by the comm stream's order, c -> d
    (compute) by a wait: x, used only by a, is dead before d writes y, though no edge joins
    a and d; without the wait, d may run before b and the two conflict."""
    g = Graph(["a", "b", "c", "d"],
              [Tensor("x", 8, 0, ()), Tensor("to_b", 0, 0, (1,)), Tensor("y", 8, 3, ())])
    chained = StreamProgram(g, [0, 1, 1, 2], [(2, 3)])
    assert not conflict_graph(chained).matrix.any()
    assert validate_streams(chained, {"0:x": 0, "2:y": 0}) == 8
    loose = StreamProgram(g, [0, 1, 1, 2])
    assert conflict_graph(loose).matrix.any()
    with pytest.raises(UnsafeSharingError, match=r"used by a#0 .*, unordered with d#3"):
        validate_streams(loose, {"0:x": 0, "2:y": 0})
