"""Ctrl-C during a solve, through the real commands: the first SIGINT stops the search
within seconds, and the best result so far is checked, printed and written as usual but
labelled interrupted, with exit status 130; before any result, one line and exit status 130.

SIGINT goes to the command's process group, as a terminal's Ctrl-C does, or to its process
alone (``kill -INT PID``). Each command runs in a session of its own with SIGINT's default
handling, and with ``FORCE_COLOR`` set so that rich draws its status line into the pipe:
the test waits for it to name the search before it interrupts.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from membudget.plan.graph import from_trace
from membudget.plan.minimalloc_csv import read_csv
from membudget.plan.planner import location_problem
from membudget.plan.validate import validate, validate_plan
from membudget.sim import simulate
from membudget.sim.evictions import EvictionPlan
from membudget.trace import load_trace

SRC = Path(__file__).resolve().parents[1] / "src"
LOGS = Path(__file__).resolve().parents[1].parent / "shared" / "dtr-logs" / "logs.zip"
needs_logs = pytest.mark.skipif(not LOGS.is_file(), reason=f"{LOGS} is missing")
PROMPT = 6.0  # seconds from SIGINT to exit, at most (about 1 s on an idle machine)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # rich's colours and cursor moves
CHILDREN = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")  # Linux lists them


@dataclass
class Run:
    code: int
    out: str
    err: str  # without the status line's frames and ANSI codes
    seconds: float  # from SIGINT to exit
    workers: list[int]  # the command's child processes when it was interrupted


def interrupted(args: list[str], marker: str, after: float = 1.0, group: bool = True,
                worker: bool = False) -> Run:
    """Run ``membudget ARGS``; once its status line shows ``marker`` (and, with ``worker``,
    a child process runs), wait ``after`` seconds and send SIGINT."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "FORCE_COLOR": "1"}
    p = subprocess.Popen([sys.executable, "-m", "membudget.cli", *args], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True, preexec_fn=_default_sigint)
    out, err = bytearray(), bytearray()
    readers = [threading.Thread(target=_drain, args=(s, b), daemon=True)
               for s, b in ((p.stdout, out), (p.stderr, err))]
    for r in readers:
        r.start()
    try:
        _wait(lambda: marker.encode() in err, p, f"{marker!r} on stderr")
        if worker and CHILDREN.exists():
            _wait(lambda: _children(p.pid), p, "a worker process")
        time.sleep(after)
        workers = _children(p.pid)
        assert p.poll() is None, "the command ended before it was interrupted"
        start = time.perf_counter()
        if group:
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGINT)
        code = p.wait(timeout=60)
        seconds = time.perf_counter() - start
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for r in readers:
        r.join()
    for stream in (p.stdout, p.stderr):
        stream.close()
    lines = [line for line in re.split(r"[\r\n]+", ANSI.sub("", err.decode()))
             if line.strip() and not "\u2800" <= line[0] <= "\u28ff"]  # spinner frames
    return Run(code, ANSI.sub("", out.decode()), "\n".join(lines), seconds, workers)


def _default_sigint() -> None:
    """In the child: SIGINT handled as by default, and not blocked (a test runner's
    background job inherits it ignored, a harness may block it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _drain(stream: IO[bytes], into: bytearray) -> None:
    while chunk := os.read(stream.fileno(), 1 << 16):
        into += chunk


def _wait(condition: Callable[[], object], p: subprocess.Popen, what: str,
          timeout: float = 60.0) -> None:
    end = time.perf_counter() + timeout
    while not condition():
        assert p.poll() is None, f"the command ended before {what} (exit {p.returncode})"
        assert time.perf_counter() < end, f"no {what} after {timeout:g} s"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (none where Linux does not list them)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def check_clean(run: Run, folder: Path) -> None:
    """Exit 130, promptly, no traceback, no temporary file, no worker left."""
    assert run.code == 130, (run.code, run.out, run.err)
    assert run.seconds < PROMPT, run.seconds
    assert "Traceback" not in run.err, run.err
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    for pid in run.workers:
        _wait_gone(pid)


def _wait_gone(pid: int) -> None:
    end = time.perf_counter() + 5
    while Path(f"/proc/{pid}").exists():
        assert time.perf_counter() < end, f"worker {pid} is still running"
        time.sleep(0.05)


def random_problem(path: Path, n: int, span: int, life: int, seed: int) -> None:
    """``n`` buffers starting at random within ``span``, living less than ``life``."""
    rng = random.Random(seed)
    rows = ["id,lower,upper,size"]
    for i in range(n):
        lo = rng.randrange(0, span)
        rows.append(f"{i},{lo},{lo + rng.randrange(1, life)},"
                    f"{rng.randrange(1, 1000) * 7 + rng.randrange(13)}")
    path.write_text("\n".join(rows) + "\n")


@pytest.mark.parametrize(("problem_args", "marker", "group"), [
    ((1500, 3000, 400, 3), "windowed CP-SAT", True),  # CP-SAT in the main thread
    ((600, 1200, 300, 5), "exact search", False),  # CP-SAT and canonical search threads
])
def test_pack_returns_and_writes_its_best_packing(tmp_path, problem_args, marker, group):
    problem, out = tmp_path / "p.csv", tmp_path / "solution.csv"
    random_problem(problem, *problem_args)
    run = interrupted(["pack", str(problem), "--time-limit", "60", "-o", str(out)], marker,
                      group=group)
    check_clean(run, tmp_path)
    assert "(interrupted: the best packing so far)" in run.out, run.out
    assert "interrupted after" in run.err
    solution = read_csv(out)
    assert [(b.id, b.lower, b.upper, b.size) for b in solution.buffers] == [
        (b.id, b.lower, b.upper, b.size) for b in read_csv(problem).buffers]
    height = validate(solution)
    assert re.match(rf"height {height:,} ", run.out), run.out


@needs_logs
@pytest.mark.parametrize(("solver", "group"), [
    ("cpsat", True),  # CP-SAT in this process
    ("highs", False),  # HiGHS in a worker process (OR-Tools is loaded here)
])
def test_plan_returns_and_writes_its_best_plan(tmp_path, solver, group):
    out = tmp_path / "plan.json"
    source = f"{LOGS}::treelstm"  # window ILPs of several seconds each
    run = interrupted(["plan", source, "--solver", solver, "--time-limit", "60", "-o",
                       str(out)], "planning treelstm: order", after=1.5, group=group,
                      worker=solver == "highs")
    check_clean(run, tmp_path)
    assert "interrupted: the best plan found so far" in run.out, run.out
    assert "interrupted after" in run.err
    plan = json.loads(out.read_text())
    assert plan["interrupted"] is True
    graph = from_trace(load_trace(source))
    problem = location_problem(graph, plan["order"])
    validate_plan(graph, plan["order"], plan["planned_peak"], problem, plan["offsets"],
                  plan["arena"])


@needs_logs
def test_optimum_returns_its_best_schedule(tmp_path):
    out = tmp_path / "best.plan.json"
    source = f"{LOGS}::resnet32"  # Checkmate's MILP runs to the time limit
    run = interrupted(["optimum", source, "--ratio", "0.5", "--time-limit", "60", "--json",
                       "--plan-out", str(out)], "solving Checkmate", after=0.5)
    check_clean(run, tmp_path)
    result = json.loads(run.out)
    assert result["interrupted"] is True and not result["timed_out"]
    assert result["status"] == "feasible" and result["overhead"] >= result["lower_bound"]
    replay = simulate(load_trace(source), "dtr-eq", budget=result["budget_bytes"],
                      allocator="fungible", inplace="cow", plan=EvictionPlan.load(out))
    assert replay.status == "ok"


def test_an_interrupt_before_any_result_says_so_in_one_line(tmp_path):
    problem, out = tmp_path / "big.csv", tmp_path / "solution.csv"
    problem.write_text("id,lower,upper,size\n" + "".join(
        f"{i},{i % 5000},{i % 5000 + 7},{i % 1000 + 1}\n" for i in range(1_000_000)))
    run = interrupted(["pack", str(problem), "-o", str(out)], "packing", after=0.0)
    check_clean(run, tmp_path)  # reading it takes seconds: no packing yet
    assert run.err == "interrupted before any valid result" and not run.out
    assert not out.exists()
