"""Offset packing: the independent validator, the MiniMalloc CSV format and the packer."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from membudget.errors import MembudgetError, TraceError, UnknownNameError
from membudget.plan.minimalloc_csv import read_csv, write_csv
from membudget.plan.pack import EXACT_MAX_BUFFERS, SOLVERS, pack, pack_file
from membudget.plan.packing.canonical import CanonicalSearch, Options
from membudget.plan.packing.cp_sat import CpSat
from membudget.plan.packing.greedy import PORTFOLIO
from membudget.plan.packing.instance import Instance
from membudget.plan.packing.perfect import perfect_problem
from membudget.plan.problem import Buffer, PlanError, Problem
from membudget.plan.validate import PackingError, validate

SHARED = Path(__file__).resolve().parents[2] / "shared" / "minimalloc"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is missing")
MIB = 1048576


def problem(*rows: tuple[str, int, int, int]) -> Problem:
    """A problem from (id, lower, upper, size) rows."""
    return Problem(tuple(Buffer(*row) for row in rows))


def pairwise_ok(p: Problem, offsets: dict[str, int]) -> bool:
    """The O(n²) definition the sweep in validate() must agree with."""
    for a, b in itertools.combinations(p.buffers, 2):
        if (a.size and b.size and a.lower < b.upper and b.lower < a.upper
                and offsets[a.id] < offsets[b.id] + b.size
                and offsets[b.id] < offsets[a.id] + a.size):
            return False
    return True


# --- validator -------------------------------------------------------------------------

EXAMPLE = problem(("b1", 0, 3, 4), ("b2", 3, 9, 4), ("b3", 0, 9, 4), ("b4", 9, 21, 4),
                  ("b5", 0, 21, 4))
EXAMPLE_OFFSETS = {"b1": 8, "b2": 8, "b3": 4, "b4": 4, "b5": 0}  # MiniMalloc's README


def test_validator_accepts_good_packings() -> None:
    assert validate(EXAMPLE, EXAMPLE_OFFSETS, capacity=12) == 12
    # Touching in time (half-open lifetimes) or in address is not an overlap.
    p = problem(("a", 0, 5, 8), ("b", 5, 9, 8), ("c", 0, 9, 2))
    assert validate(p, {"a": 0, "b": 0, "c": 8}) == 10
    assert validate(Problem(()), {}) == 0


@pytest.mark.parametrize(("offsets", "capacity", "names"), [
    ({"a": 0, "b": 4, "c": 20}, None, ["'a'", "'b'", "overlap in address"]),
    ({"a": 4, "b": 0, "c": 20}, None, ["'a'", "'b'", "overlap in address"]),
    ({"a": 0, "b": 8, "c": 8}, None, ["'b'", "'c'", "overlap in address"]),
    ({"a": 0, "b": 8, "c": 16}, 16, ["'c'", "capacity 16"]),
    ({"a": -8, "b": 8, "c": 16}, None, ["'a'", "negative offset"]),
    ({"a": 0, "b": 8}, None, ["'c'", "no offset"]),
    ({"a": 0, "b": 8, "c": 16, "zz": 0}, None, ["'zz'", "unknown"]),
])
def test_validator_rejects_bad_packings(offsets: dict[str, int], capacity: int | None,
                                        names: list[str]) -> None:
    p = problem(("a", 0, 10, 8), ("b", 5, 15, 8), ("c", 12, 20, 4))
    with pytest.raises(PackingError) as e:
        validate(p, offsets, capacity)
    for name in names:
        assert name in str(e.value)


def test_validator_uses_offsets_carried_by_the_buffers() -> None:
    assert validate(EXAMPLE.with_offsets(EXAMPLE_OFFSETS)) == 12
    with pytest.raises(PackingError, match="'b5' has no offset"):
        validate(EXAMPLE.with_offsets({k: v for k, v in EXAMPLE_OFFSETS.items() if k != "b5"}))


@settings(max_examples=300)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6), st.integers(0, 5),
                          st.integers(0, 12)), max_size=9))
def test_validator_agrees_with_pairwise_definition(rows: list[tuple[int, int, int, int]]) -> None:
    p = Problem(tuple(Buffer(str(i), lo, lo + span, size)
                      for i, (lo, span, size, _) in enumerate(rows)))
    offsets = {str(i): off for i, (*_, off) in enumerate(rows)}
    ok = pairwise_ok(p, offsets)
    try:
        validate(p, offsets)
    except PackingError:
        assert not ok
    else:
        assert ok


def test_validator_is_fast_on_large_packings() -> None:
    """20,000 buffers, one per step, each two steps long: a sweep, not all pairs."""
    n = 20000
    p = Problem(tuple(Buffer(str(i), i, i + 2, 8) for i in range(n)))
    offsets = {str(i): 8 * (i % 2) for i in range(n)}
    assert validate(p, offsets) == 16
    offsets[str(n - 1)] = offsets[str(n - 2)]
    with pytest.raises(PackingError, match=f"'{n - 2}'.*'{n - 1}'"):
        validate(p, offsets)


# --- CSV -------------------------------------------------------------------------------

def test_csv_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    write_csv(path, EXAMPLE)
    assert path.read_text().splitlines()[0] == "id,lower,upper,size"
    assert read_csv(path) == EXAMPLE
    solved = EXAMPLE.with_offsets(EXAMPLE_OFFSETS)
    write_csv(path, solved)
    assert path.read_text().splitlines()[0] == "id,lower,upper,size,offset"
    assert read_csv(path) == solved
    with pytest.raises(PlanError, match="no offset"):
        write_csv(path, EXAMPLE.with_offsets({"b1": 0}))


@pytest.mark.parametrize(("text", "line", "words"), [
    ("id,lower,upper,size\n0,0,4,8\n1,0,4\n", 3, "malformed row"),
    ("id,lower,upper,size\n0,0,4,8\n\n1,0,x,8\n", 4, "not an integer"),
    ("id,lower,upper,size\n0,0,4,-8\n", 2, "has size -8; sizes must be positive"),
    ("id,lower,upper,size\n0,0,4,8\n1,0,4,0\n", 3, "has size 0; sizes must be positive"),
    ("id,lower,upper,size\n0,0,4,8\n1,4,4,8\n", 3, "empty lifetime"),
    ("id,lower,upper,size\n0,5,4,8\n", 2, "empty lifetime"),
    ("id,lower,upper,size\n0,0,4,8\n0,1,4,8\n", 3, "duplicate buffer id '0'"),
    ("id,lower,size\n0,0,8\n", 1, "missing column(s) upper"),
    ("id,lower,upper,size,gaps\n0,0,4,8,\n", 1, "unsupported column(s) 'gaps'"),
    ("", 1, "empty file"),
])
def test_csv_errors_name_the_file_and_line(tmp_path: Path, text: str, line: int,
                                           words: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as e:
        read_csv(path)
    assert isinstance(e.value, MembudgetError)
    assert f"{path}:{line}:" in str(e.value)
    assert words in str(e.value)


@pytest.mark.parametrize(("rows", "words"), [
    ([("a", 0, 4, 8), ("a", 1, 4, 8)], "duplicate buffer id 'a'"),
    ([("a", 0, 4, -1)], "negative size"),
    ([("a", 4, 4, 8)], "empty lifetime"),
])
def test_problem_rejects_bad_buffers(rows: list[tuple[str, int, int, int]], words: str) -> None:
    with pytest.raises(PlanError, match=words):
        problem(*rows)


def test_csv_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        read_csv(tmp_path / "nope.csv")


# --- packer ----------------------------------------------------------------------------

def brute_force_height(p: Problem) -> int:
    """Optimum by enumeration: every packing pushed down is some order of the buffers, each
    placed right on top of the earlier ones it overlaps in time."""
    best = None
    for order in itertools.permutations(p.buffers):
        tops: list[tuple[Buffer, int]] = []
        for b in order:
            off = max((t for o, t in tops if o.lower < b.upper and b.lower < o.upper),
                      default=0)
            tops.append((b, off + b.size))
        height = max((t for _, t in tops), default=0)
        best = height if best is None else min(best, height)
    return best or 0


def small_problems(max_size: int) -> st.SearchStrategy[Problem]:
    row = st.tuples(st.integers(0, 8), st.integers(1, 6), st.integers(0, 6))
    return st.builds(
        lambda rows, unit: Problem(tuple(Buffer(f"t{i}", lo, lo + span, size * unit)
                                         for i, (lo, span, size) in enumerate(rows))),
        st.lists(row, max_size=max_size), st.sampled_from([1, 3, 1024]))


@settings(max_examples=40)
@given(small_problems(6))
def test_pack_is_valid_and_optimal_on_tiny_problems(p: Problem) -> None:
    r = pack(p, time_limit=10)
    assert validate(p, r.offsets) == r.height
    assert r.height >= r.lower_bound >= r.max_load == p.max_load()
    assert r.proven_optimal
    assert r.height == brute_force_height(p)


@settings(max_examples=15)
@given(small_problems(30), st.integers(0, 2))
def test_pack_with_capacity_is_valid(p: Problem, slack: int) -> None:
    capacity = p.max_load() + slack
    r = pack(p, capacity=capacity, time_limit=5)
    assert validate(p, r.offsets) == r.height >= r.lower_bound
    assert r.fits == (r.height <= capacity)
    assert not (r.fits and r.proven_infeasible)


def test_zero_sizes_and_whole_span_buffers() -> None:
    p = problem(("w", 0, 10, 4), ("z", 2, 3, 0), ("a", 0, 5, 4), ("b", 5, 10, 4),
                ("v", 0, 10, 2))
    r = pack(p)
    assert validate(p, r.offsets) == r.height == 10 == r.lower_bound
    assert r.offsets["z"] == 0 and r.proven_optimal


def test_capacity_below_max_load_is_proven_infeasible() -> None:
    r = pack(EXAMPLE, capacity=11, time_limit=5)
    assert not r.fits and r.proven_infeasible and r.height == 12
    assert "nothing fits capacity 11" in r.message


# Optimum 10 > max load 9 (found by random search, optimum checked by brute force).
GAP = problem(("0", 3, 6, 2), ("1", 5, 8, 2), ("2", 4, 8, 2), ("3", 7, 11, 5),
              ("4", 2, 3, 5), ("5", 0, 5, 4), ("6", 9, 15, 4), ("7", 5, 7, 2))


def test_gap_instance_is_proven_infeasible_at_max_load() -> None:
    assert GAP.max_load() == 9 and brute_force_height(GAP) == 10
    r = pack(GAP, capacity=9, time_limit=20)
    assert not r.fits and r.proven_infeasible and "exhaustive search" in r.message
    assert r.height == 10 and r.proven_optimal  # minimised once 9 was proven impossible
    assert validate(GAP, r.offsets) == 10
    r = pack(GAP, time_limit=20)
    assert r.height == 10 == r.lower_bound and r.proven_optimal and r.max_load == 9


@pytest.mark.parametrize("solver", SOLVERS)
def test_each_solver_alone_minimises_the_gap_instance(solver: str) -> None:
    r = pack(GAP, time_limit=20, solvers=[solver])
    assert r.height == 10 and r.proven_optimal and validate(GAP, r.offsets) == 10


def test_unknown_solver_is_named() -> None:
    with pytest.raises(UnknownNameError, match="unknown solver 'gurobi'"):
        pack(GAP, solvers=["gurobi"])


@settings(max_examples=60)
@given(small_problems(7))
@example(GAP)
def test_each_exact_solver_alone_is_exact(p: Problem) -> None:
    """Both canonical-search strategies, with every combination of the search's rules on
    and off, and CP-SAT decide 'fits in opt' and 'fits in opt-1' exactly, checked against
    brute force."""
    inst = Instance(p)
    if not len(inst):
        return
    opt = brute_force_height(p) // inst.gcd - inst.floor
    strategies: list = [CpSat(inst, workers=1)]
    for options in Options.combinations():
        search = CanonicalSearch(inst, options)
        strategies += [search.restarts, search.discrepancies]
    for strategy in strategies:
        for goal in (opt, opt - 1):
            units = strategy(goal, lambda: False)
            assert (units is not None) == (goal >= opt), strategy
            if units is not None:
                assert validate(p, inst.offsets(units)) <= (goal + inst.floor) * inst.gcd


def test_options_name_every_rule_and_pack_takes_them() -> None:
    combos = list(Options.combinations())
    assert len(combos) == 32 and len(set(combos)) == 32
    r = pack(GAP, time_limit=20, solvers=["restarts"], options=Options(
        canonical=False, section_load=False, dominance=False, hatless=False,
        decompose=False))
    assert r.height == 10 and r.proven_optimal


def test_components_are_packed_separately() -> None:
    """Two time ranges no buffer crosses: each part from offset 0, the arena as high as
    the higher part, and the message says so."""
    p = Problem(GAP.buffers + tuple(Buffer(f"late{b.id}", b.lower + 100, b.upper + 100,
                                           b.size) for b in GAP.buffers))
    r = pack(p, time_limit=20)
    assert validate(p, r.offsets) == r.height == 10 and r.proven_optimal
    assert "2 independent parts" in r.message
    whole = pack(p, time_limit=20, options=Options(decompose=False))
    assert validate(p, whole.offsets) == whole.height == 10 and whole.proven_optimal
    assert "independent parts" not in whole.message


def test_large_problems_are_searched_window_by_window() -> None:
    """Above EXACT_MAX_BUFFERS a part is improved by windowed CP-SAT, within the limit."""
    p = perfect_problem(EXACT_MAX_BUFFERS + 500, seed=3)
    messages: list[str] = []
    r = pack(p, time_limit=8, progress=messages.append)
    assert validate(p, r.offsets) == r.height >= r.lower_bound == p.max_load()
    assert r.height < r.greedy_height, "the windows lowered the greedy packing"
    assert r.searched.startswith("windowed CP-SAT (") and r.method == "windowed CP-SAT"
    assert r.seconds < 8 + 2
    assert len(r.greedy) > 1 and min(h for _, h in r.greedy) == r.greedy_height


def test_portfolio_tries_tie_breaks() -> None:
    """Equal sizes: which one goes first decides the height, so the portfolio tries
    several tie orders and keeps the lowest."""
    names = [g.name for g in PORTFOLIO]
    for key in ("size, then id", "size, then start", "size, then longest lifetime",
                "area", "lifetime", "start"):
        assert any(key in n and "best fit" in n for n in names)
        assert any(key in n and "first fit" in n for n in names)
    r = pack(perfect_problem(300, seed=4), time_limit=0)
    assert len(r.greedy) == 1  # no time: the first packer only
    r = pack(perfect_problem(300, seed=4), time_limit=60, solvers=["restarts"])
    assert len(r.greedy) == len(PORTFOLIO)
    assert r.greedy_height == min(h for _, h in r.greedy)


def test_random_medium_problem_minimised() -> None:
    rng = random.Random(7)
    bufs = []
    for i in range(120):
        lo = rng.randrange(60)
        bufs.append(Buffer(str(i), lo, lo + rng.randrange(1, 15), 512 * rng.randrange(1, 9)))
    p = Problem(tuple(bufs))
    r = pack(p, time_limit=5)
    assert validate(p, r.offsets) == r.height
    assert r.lower_bound <= r.height <= r.greedy_height


@needs_shared
def test_input_12_packs_at_height_12(tmp_path: Path) -> None:
    out = tmp_path / "sol.csv"
    r, code = pack_file(SHARED / "input.12.csv", capacity=12, out=out)
    assert code == 0 and r.height == 12 and r.proven_optimal
    solved = read_csv(out)
    assert validate(solved, capacity=12) == 12
    r, code = pack_file(SHARED / "input.12.csv")
    assert code == 0 and r.height == 12


@needs_shared
def test_short_time_limit_returns_a_valid_greedy_packing(tmp_path: Path) -> None:
    out = tmp_path / "sol.csv"
    r, code = pack_file(SHARED / "A.1048576.csv", capacity=MIB, time_limit=0.1, out=out)
    assert code == 1 and not r.fits and not r.proven_optimal and not r.proven_infeasible
    assert r.method.startswith(("greedy", "pyramid"))
    assert "not proven" in r.message
    assert not out.exists(), "a packing over the capacity is written only on request"
    r, code = pack_file(SHARED / "A.1048576.csv", capacity=MIB, time_limit=0.1, out=out,
                        write_unfit=True)
    assert code == 1 and validate(read_csv(out)) == r.height > MIB
    r = pack(read_csv(SHARED / "A.1048576.csv"), time_limit=0.1)
    assert not r.proven_optimal and "not proven optimal" in r.message
    assert r.seconds < 5


def _pack_challenging(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.csv"
    r, code = pack_file(SHARED / f"{name}.1048576.csv", capacity=MIB, time_limit=60, out=out)
    assert code == 0 and r.height == MIB == r.lower_bound and r.proven_optimal
    assert validate(read_csv(out), capacity=MIB) == MIB
    assert r.greedy_height > MIB


@needs_shared
@pytest.mark.parametrize("name", ["I", "K"])
def test_challenging_fast_ones_fit_in_one_mib(name: str, tmp_path: Path) -> None:
    _pack_challenging(name, tmp_path)


@needs_shared
@pytest.mark.slow
@pytest.mark.parametrize("name", ["A", "B", "E", "F", "G", "H"])
def test_challenging_fit_in_one_mib(name: str, tmp_path: Path) -> None:
    _pack_challenging(name, tmp_path)


@needs_shared
@pytest.mark.slow
@pytest.mark.parametrize("name", ["C", "D", "J"])
def test_challenging_below_capacity(name: str) -> None:
    p = read_csv(SHARED / f"{name}.1048576.csv")
    r = pack(p, capacity=MIB, time_limit=60)
    assert r.fits and validate(p, r.offsets, MIB) == r.height >= r.lower_bound


def test_pack_command_keeps_its_time_limit_on_20000_buffers(tmp_path: Path) -> None:
    """The whole run, greedy packers and windowed search included, ends within the time
    limit plus 2 s, says what ran, and writes a valid packing."""
    from typer.testing import CliRunner

    from membudget.cli import app

    p = perfect_problem(20000, seed=7)  # a buffer across (nearly) all of it: one part
    p = Problem((*p.buffers, Buffer("across", 1, max(b.upper for b in p.buffers) - 1, 64)))
    path, out = tmp_path / "big.csv", tmp_path / "big.solution.csv"
    write_csv(path, p)
    result = CliRunner().invoke(app, ["pack", str(path), "--time-limit", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    seconds = float(result.output.split(" in ")[-1].split(" s")[0])
    assert seconds <= 4 + 2
    assert "windowed CP-SAT" in result.output and "greedy packer" in result.output
    solved = read_csv(out)
    assert validate(solved) == int(result.output.split()[1].replace(",", ""))


CTRL_C = """
import json, signal, sys, threading
# a Ctrl-C must reach it whatever it inherits (ignored by a shell's & job, or blocked)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
from membudget.plan.pack import pack
from membudget.plan.packing.perfect import perfect_problem
from membudget.plan.validate import validate

def progress(message):
    if "greedy packers" in message:  # the greedy phase ended: the search starts
        print("searching", flush=True)

p = perfect_problem(int(sys.argv[1]), seed=11)
r = pack(p, time_limit=60, progress=progress)
print(json.dumps({"interrupted": r.interrupted, "message": r.message, "seconds": r.seconds,
                  "searched": r.searched, "valid": validate(p, r.offsets) == r.height,
                  "no worse": r.height <= r.greedy_height,
                  "threads": sum(t.is_alive() for t in threading.enumerate()) - 1}))
"""


@pytest.mark.parametrize(("buffers", "what"), [(500, "canonical search by restarts"),
                                               (EXACT_MAX_BUFFERS + 500, "windowed CP-SAT")])
def test_ctrl_c_returns_the_best_packing_so_far(buffers: int, what: str) -> None:
    """Ctrl-C during the search (in the race of solver threads, or between windows) stops
    it: the best valid packing so far comes back, named as interrupted, with every solver
    thread stopped. The Ctrl-C is a real SIGINT, sent to a process of its own half a second
    after its greedy phase ended."""
    import json
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", CTRL_C, str(buffers)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "searching"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    r = json.loads(out.splitlines()[-1])
    assert r["interrupted"] and "interrupted after" in r["message"] and r["seconds"] < 10
    assert what in r["searched"]
    assert r["valid"] and r["no worse"] and r["threads"] == 0
