"""What the live runtime (``membudget.budget``) costs on real PyTorch code, on this CPU.

Two measurements, each a median of several repetitions taken in one process, interleaved so
that the plain and in-session numbers of a repetition share the machine's noise:

1. **Per-op overhead.** A loop of N tiny ops (``y = y + 1.0`` on 8 floats; ``torch.mm(y, q)`` with
   a 16×16 orthogonal ``q``) timed plain and inside ``membudget.budget("1 GiB", policy)``, a
   budget nothing comes close to, so the extra time is the dispatch mode and the engine's
   bookkeeping (never eviction or recomputation). Read "overhead" as the fixed cost the
   session adds to every aten op. Each time includes entering and leaving the session and a
   ``gc.collect()`` after it, so that nothing the session defers (it pauses the cyclic
   collector while it runs) escapes the measurement.
2. **A GPT-2 training step** (forward + backward, random init, dropout on, labels = inputs).
   Plain eager first (the reference loss and gradients), then the session's peak without a
   constraint (budget 10^11 B, dtr), then each policy at 1.0, 0.5 and 0.3 of that peak, in
   rounds that each run every row once beside an eager step of its own. "vs eager" is the
   median over the rounds of each in-session step time over its eager partner's, and
   "fastest vs fastest" the row's fastest step over the fastest of its eager partners (the
   machine's interference only ever adds time): above 1 is slower. "runtime's own work" is the time
   the session spends on its own bookkeeping in a step, measured inside it (ops,
   recomputation and the freeing of memory, which eager does too, left out).
   "loss/grads = eager" says whether every repetition's loss and gradients were bitwise
   equal to the eager ones (they must be: recomputation is exact).
   "too small" means the budget raised ``BudgetTooSmallError``; the cell gives the op that
   failed and what the error said it needed at that moment (a lower bound for the step).
   Each policy runs with its own default pool (coop: two-sided). Before the timed rounds, a
   scan runs one step of each policy at ratios 0.95, 0.9, … 0.35 (``--no-scan`` skips it);
   the smallest that completes is timed in the rounds as one more row, so that some row
   shows eviction and recomputation. Last, the rows that evicted nothing run again with one
   intra-op thread, whose step times this shared machine disturbs far less. glibc is told to
   keep freed memory for this part (``--system-malloc`` does not): by default it unmaps
   every freed tensor over 32 MiB, and the page faults of the next step cost 1–2 s of
   kernel time that swings with the machine's load, for eager and session alike.

With ``--instructions`` it also counts the instructions per op under valgrind, a figure the
machine's drifting speed cannot touch.

Run: python benchmarks/live_overhead.py [--quick] [--instructions] [--policies dtr,dtr-eq,coop]
[--system-malloc] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import membudget
from membudget import BudgetTooSmallError
from membudget.bench.malloc import keep_freed_memory
from membudget.bench.report import git_state
from membudget.core import COMPILED
from membudget.core.policies import POLICIES
from membudget.runtime.session import Session, SessionStats
from membudget.runtime.tensor import value_of

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "results" / "live-overhead.md"
RATIOS = (1.0, 0.5, 0.3)
SCAN = tuple(round(0.95 - 0.05 * k, 2) for k in range(13))  # 0.95 … 0.35, one step each
ABOVE_PEAK = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0)  # tried in turn when no scanned ratio completes
UNCONSTRAINED = 10**11
OP_BUDGET = "1 GiB"
DEFAULT_POLICIES = "dtr,dtr-eq,coop"
MALLOC_AS_IS = ("glibc's malloc as it is, which unmaps every freed tensor over 32 MiB, so each "
                "step faults in their pages afresh")


def log(msg: str) -> None:
    print(msg, flush=True)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def median_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval (at least ``level``) for the median of ``xs``:
    the k-th smallest and k-th largest values, k the largest rank whose binomial(n, 1/2)
    tail is at most (1 - level)/2 (the whole range when n is too small for that)."""
    xs = sorted(xs)
    n = len(xs)
    tail, k = 0.0, 0
    while True:
        nxt = tail + math.comb(n, k) / 2**n  # P(fewer than k + 1 values below the median)
        if nxt > (1 - level) / 2:
            break
        tail, k = nxt, k + 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


def span(xs: Sequence[int]) -> str:
    """One number if all repetitions agree, else their range."""
    lo, hi = min(xs), max(xs)
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f}"


# ---------------------------------------------------------------------------- per-op overhead
OpLoop = Callable[[int], Any]


def op_loops() -> dict[str, tuple[str, OpLoop]]:
    """name -> (description, loop running n dependent ops); inputs are made outside."""
    x8 = torch.zeros(8)
    g = torch.Generator().manual_seed(0)
    x16 = torch.randn(16, 16, generator=g)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g))  # orthogonal: values stay bounded

    def add(n: int) -> Any:
        y = x8
        for _ in range(n):
            y = y + 1.0
        return y

    def mm(n: int) -> Any:
        y = x16
        for _ in range(n):
            y = torch.mm(y, q)
        return y

    return {"add": ("`y = y + 1.0`, 8 floats", add),
            "mm": ("`y = torch.mm(y, q)`, 16×16", mm)}


class _Bare(torch.Tensor):
    """The least a wrapper runtime creates per op: a wrapper subclass holding the value."""

    __slots__ = ("value",)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        raise RuntimeError("a _Bare tensor is only used inside _FloorMode")


class _FloorMode(TorchDispatchMode):
    """Unwraps the inputs, runs the op and wraps its (single) output, nothing else: PyTorch's
    own cost of a dispatch mode plus a wrapper per op, which any runtime of this design pays."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func._op(*[a.value if type(a) is _Bare else a for a in args], **(kwargs or {}))
        w = torch.Tensor._make_wrapper_subclass(_Bare, out.shape, strides=out.stride(),
                                                dtype=out.dtype, device=out.device)
        w.value = out
        return w


def floor_loop(loop: OpLoop, n: int) -> float:
    """µs per op of ``loop(n)`` inside the bare wrapper mode (timed as ``time_loop`` does)."""
    gc.collect()
    t0 = time.perf_counter()
    with _FloorMode():
        loop(n)
    gc.collect()
    return (time.perf_counter() - t0) / n * 1e6


def time_loop(loop: OpLoop, n: int, policy: str | None) -> tuple[float, SessionStats | None]:
    """µs per op of ``loop(n)``, plain (policy None) or inside a session, and its stats.

    The time runs from before the session starts to after it has ended and one
    ``gc.collect()`` has run (the plain loop is followed by one too): a session pauses the
    cyclic collector and frees its records when it closes, so that work is charged to it
    here rather than to whatever runs next. ``measure_ops`` freezes the heap around the
    measurement, so each collection walks only what the loop left behind."""
    gc.collect()
    t0 = time.perf_counter()
    if policy is None:
        loop(n)
        stats = None
    else:
        with membudget.budget(OP_BUDGET, policy) as session:
            loop(n)
        stats = session.stats
    gc.collect()
    return (time.perf_counter() - t0) / n * 1e6, stats


def empty_session_us(policy: str, reps: int) -> tuple[float, str]:
    """Entering and leaving a session that runs one op (µs), and the pool the policy uses.
    The heap is frozen, as in ``measure_ops``: the collection that the collector, running
    again, may start at once would otherwise walk the whole process."""
    x = torch.zeros(8)
    times = []
    pool = "?"
    gc.collect()
    gc.freeze()
    try:
        for _ in range(reps):
            gc.collect()
            t0 = time.perf_counter()
            with membudget.budget(OP_BUDGET, policy) as session:
                _ = x + 1.0
                if session.engine is not None:
                    pool = session.engine.allocator.name
            times.append((time.perf_counter() - t0) * 1e6)
    finally:
        gc.unfreeze()
    return median(times), pool


# A child process run under valgrind: n dependent adds, plain, in the bare wrapper mode or in
# a session. Its instruction count for two n, differenced, is the count per op: a figure this
# machine's drifting speed cannot touch.
_ICOUNT_CHILD = """
import gc, sys
sys.path.insert(0, {bench!r})
import torch
import membudget
from live_overhead import OP_BUDGET, _FloorMode
torch.set_num_threads(1)
variant, n = sys.argv[1], int(sys.argv[2])
x = torch.zeros(8)
def loop(k):
    y = x
    for _ in range(k):
        y = y + 1.0
loop(100)
if variant == "plain":
    loop(n)
elif variant == "bare":
    with _FloorMode():
        loop(n)
else:
    with membudget.budget(OP_BUDGET, variant):
        loop(n)
gc.collect()
"""
ICOUNT_OPS = (1000, 9000)
# One thread everywhere: an idle OpenBLAS or OpenMP worker spins, and valgrind counts the
# spinning, which moved the figure by a few thousand instructions per op from run to run.
_ICOUNT_ENV = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}


def instructions(variant: str) -> int:
    """Instructions one ``y = y + 1.0`` costs in ``variant`` ("plain", "bare" or a policy),
    counted by valgrind (the two runs go in parallel)."""
    import re
    import subprocess

    code = _ICOUNT_CHILD.format(bench=str(Path(__file__).resolve().parent))
    env = {**os.environ, **_ICOUNT_ENV}
    # the same addresses in every run (dict and set layouts follow them), where setarch can
    norandom = ["setarch", platform.machine(), "-R"] if shutil.which("setarch") else []
    runs = [subprocess.Popen([*norandom, "valgrind", "--tool=callgrind",
                              "--callgrind-out-file=/dev/null",
                              sys.executable, "-c", code, variant, str(n)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=env) for n in ICOUNT_OPS]
    counts = []
    for run in runs:
        _, err = run.communicate()
        found = re.search(r"Collected\s*:\s*([\d,]+)", err)
        if run.returncode or found is None:
            raise RuntimeError(f"valgrind failed on {variant}: {err[-500:]}")
        counts.append(int(found.group(1).replace(",", "")))
    return round((counts[1] - counts[0]) / (ICOUNT_OPS[1] - ICOUNT_OPS[0]))


def instructions_markdown(policies: Sequence[str]) -> list[str]:
    log("\n== instructions per op under valgrind (a few minutes)")
    counts = {v: instructions(v) for v in ("plain", "bare", *policies)}
    log("  " + ", ".join(f"{v} {c:,}" for v, c in counts.items()))
    plain = counts["plain"]
    lines = ["Instructions per `y = y + 1.0` (8 floats), counted by valgrind's callgrind: the "
             f"difference of two runs of {ICOUNT_OPS[0]:,} and {ICOUNT_OPS[1]:,} ops, one "
             "thread (BLAS and OpenMP pools too), `PYTHONHASHSEED=0`, address randomization "
             "off (a session's entry, exit and deferred collection included, as above). "
             "Unlike the times, these do not drift with the machine; repeated runs agree to "
             "within about 0.5k.", "",
             "| run | instructions per op | over plain |", "|---|---:|---:|"]
    for v, c in counts.items():
        name = {"plain": "plain", "bare": "bare wrapper mode"}.get(v, f"session, {v}")
        lines.append(f"| {name} | {c:,} | {c - plain:,} |")
    return lines


@dataclass
class OpRow:
    op: str
    policy: str
    plain: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    session: list[float] = field(default_factory=list)
    engine_ops: list[int] = field(default_factory=list)


def measure_ops(policies: Sequence[str], n: int,
                reps: int) -> tuple[list[OpRow], dict[str, str]]:
    loops = op_loops()
    log(f"\n== per-op overhead: {n} ops × {reps} repetitions, policies {', '.join(policies)}")
    for _name, (_, loop) in loops.items():  # warm up: first dispatch-mode use, kernels, caches
        loop(max(n // 10, 50))
        for policy in policies:
            time_loop(loop, max(n // 10, 50), policy)
    rows = {(name, p): OpRow(name, p) for name in loops for p in policies}
    gc.collect()
    gc.freeze()  # the process's own objects (torch, transformers, ...): no collection walks them
    try:
        for rep in range(reps):
            for name, (_, loop) in loops.items():
                plain, _ = time_loop(loop, n, None)
                floor = floor_loop(loop, n)
                for policy in policies:
                    row = rows[name, policy]
                    row.plain.append(plain)
                    row.floor.append(floor)
                    us, stats = time_loop(loop, n, policy)
                    row.session.append(us)
                    assert stats is not None
                    row.engine_ops.append(stats.ops)
            log(f"  rep {rep + 1}/{reps}: " + "; ".join(
                f"{r.op}/{r.policy} {r.plain[-1]:.1f} (bare {r.floor[-1]:.1f}) → "
                f"{r.session[-1]:.1f} µs/op"
                for r in rows.values()))
    finally:
        gc.unfreeze()
    return list(rows.values()), {name: desc for name, (desc, _) in loops.items()}


def ops_markdown(rows: Sequence[OpRow], descs: dict[str, str], n: int, reps: int,
                 empty: dict[str, tuple[float, str]]) -> list[str]:
    lines = [f"Each cell: median over {reps} repetitions of a {n}-op loop (µs per op). "
             f"Budget {OP_BUDGET}: no eviction happens, so the overhead is pure bookkeeping. "
             "Each time runs from before the session starts to after it has ended and one "
             "`gc.collect()` has run (the plain and bare loops are followed by one too), with "
             "the process's older objects frozen: the session pauses the cyclic collector "
             "while it runs, and what that defers is charged to it. \"bare wrapper mode\": the "
             "same loop in a dispatch mode that only unwraps the inputs, runs the op and wraps "
             "its output (PyTorch's own cost of this design, with no engine); its overhead is "
             "part of the session's.", "",
             "| op | policy | plain µs/op | bare wrapper mode µs/op | in session µs/op | "
             "overhead µs/op | of which bare mode | × plain | overhead, fastest reps µs/op | "
             "engine ops/loop |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        plain, sess, bare = median(r.plain), median(r.session), median(r.floor)
        lines.append(f"| {descs[r.op]} | {r.policy} | {plain:.2f} | {bare:.2f} | {sess:.2f} | "
                     f"{sess - plain:.2f} | {bare - plain:.2f} | {sess / plain:.1f} | "
                     f"{min(r.session) - min(r.plain):.2f} | {span(r.engine_ops)} |")
    lines += ["", "This machine is shared and its speed drifts, by up to 2× within one run: the "
              "medians carry that drift. \"Overhead, fastest reps\" is the fastest in-session "
              "repetition minus the fastest plain one, the figure for an undisturbed machine "
              "(as `timeit` takes the minimum); \"× plain\" is the steadiest figure across "
              "runs.", "",
              "Entering and leaving a session that runs one op (median µs): "
              + ", ".join(f"{p} {us:.0f} ({pool} pool)" for p, (us, pool) in empty.items())
              + "."]
    return lines


# ---------------------------------------------------------------------------- GPT-2 step
@dataclass
class Step:
    """One timed step: wall and process CPU seconds, minor page faults, and for a session
    step the seconds the runtime spent on its own work (see ``TimedSession``)."""

    wall: float
    cpu: float
    faults: int
    own: float = 0.0


def clocks() -> tuple[float, float, int]:
    """Wall seconds, process CPU seconds and minor page faults so far (``Step`` takes
    differences)."""
    return time.perf_counter(), time.process_time(), resource.getrusage(
        resource.RUSAGE_SELF).ru_minflt


def step_since(start: tuple[float, float, int], own: float = 0.0) -> Step:
    """The step that began at ``start`` (a ``clocks()`` reading) and ends now."""
    wall, cpu, faults = clocks()
    return Step(wall - start[0], cpu - start[1], faults - start[2], own)


def malloc_setting() -> str:
    """Make glibc keep freed memory in the process; return what the report should say."""
    if not keep_freed_memory():
        return MALLOC_AS_IS + " (`mallopt` was not available)"
    return ("glibc's malloc told to keep freed memory (`mallopt(M_MMAP_MAX, 0)`, "
            "`mallopt(M_TRIM_THRESHOLD, 2^31 - 1)`) as a device's caching allocator does, "
            "for eager and session alike: by default it unmaps every freed tensor over 32 MiB "
            "and the next step faults in ~350k fresh pages, 1–2 s of kernel time per step "
            "that swings by 2× with the machine's load (`--system-malloc` keeps that "
            "behaviour)")


@dataclass
class StepRow:
    policy: str  # "eager" for the plain row
    budget: int | None = None
    ratio: str = ""
    steps: list[Step] = field(default_factory=list)
    paired: list[Step] = field(default_factory=list)  # the eager step beside each of steps
    stats: list[SessionStats] = field(default_factory=list)
    loss_equal: list[bool] = field(default_factory=list)
    grads_equal: list[bool] = field(default_factory=list)
    failure: str | None = None
    scanned: bool = False  # the smallest ratio the scan completed, not a listed one


class TimedSession(Session):
    """A session that also times its work: entering, leaving, every op it dispatches, every
    wrapper it releases and every value it reads, and within that the freeing of tensors'
    memory (``executor.drop``, which eager pays too, when its own references go). That time
    less the ops' own run time (``run_seconds``), recomputation (``remat_run_seconds``) and
    freeing is the runtime's own work, a figure the machine's drift disturbs far less than a
    difference of two step times."""

    def __init__(self, budget: int, policy: str) -> None:
        super().__init__(budget, policy)
        self.inside_ns = self.free_ns = 0
        self._inside = False

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its time counted unless it runs within other counted work."""
        if self._inside:
            return fn(*args)
        self._inside = True
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            self.inside_ns += time.perf_counter_ns() - t0
            self._inside = False

    def _enter_timing_drops(self) -> TimedSession:
        super().__enter__()
        drop = self.executor.drop

        def timed_drop(storage: Any) -> None:
            t = time.perf_counter_ns()
            drop(storage)
            self.free_ns += time.perf_counter_ns() - t

        self.executor.drop = timed_drop  # type: ignore[method-assign]
        return self

    def __enter__(self) -> TimedSession:
        return self._timed(self._enter_timing_drops)

    def __exit__(self, *exc: Any) -> None:
        self._timed(super().__exit__, *exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        return self._timed(super().__torch_dispatch__, func, types, args, kwargs)

    def release(self, handle: Any) -> None:
        self._timed(super().release, handle)

    def read(self, handle: Any) -> torch.Tensor:
        return self._timed(super().read, handle)

    def own_seconds(self) -> float:
        st = self.stats
        return (self.inside_ns - self.free_ns) / 1e9 - st.run_seconds - st.remat_run_seconds


def build_gpt2(quick: bool) -> tuple[torch.nn.Module, torch.Tensor, str]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if quick:
        kw = {"n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 64}
    else:
        kw = {"n_embd": 768, "n_layer": 6, "n_head": 12, "n_positions": 256}
    seq = kw["n_positions"]
    config = GPT2Config(**kw, vocab_size=50257)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (4, seq))
    params = sum(p.numel() for p in model.parameters())
    desc = (f"GPT2LMHeadModel(n_embd={kw['n_embd']}, n_layer={kw['n_layer']}, "
            f"n_head={kw['n_head']}, n_positions={seq}, vocab_size=50257), "
            f"{params / 1e6:.1f} M parameters, batch 4 × seq {seq}, labels = input ids, "
            "train mode (dropout 0.1)")
    return model, ids, desc


def reset(model: torch.nn.Module, state: dict) -> None:
    """Back to ``state`` with no gradients (outside any session: loading writes parameters)."""
    model.load_state_dict(state)
    model.train()
    model.zero_grad(set_to_none=True)


def step(model: torch.nn.Module, ids: torch.Tensor) -> Any:
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def grads_of(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def same_grads(model: torch.nn.Module, ref: Sequence[torch.Tensor | None]) -> bool:
    for p, g in zip(model.parameters(), ref, strict=True):
        if (p.grad is None) != (g is None):
            return False
        if g is not None and not torch.equal(value_of(p.grad), g):
            return False
    return True


def eager_step(model: torch.nn.Module, ids: torch.Tensor, state: dict) -> tuple[Step, Any]:
    reset(model, state)
    gc.collect()
    start = clocks()
    loss = step(model, ids)
    return step_since(start), loss.detach()


def session_step(model: torch.nn.Module, ids: torch.Tensor, state: dict, budget: int,
                 policy: str) -> tuple[Step, SessionStats, torch.Tensor]:
    """One step inside a session; the time includes entering and leaving it."""
    reset(model, state)
    gc.collect()
    start = clocks()
    with TimedSession(budget, policy) as session:
        loss = step(model, ids)
    timed = step_since(start, session.own_seconds())
    return timed, session.stats, value_of(loss).detach()


def too_small(e: BudgetTooSmallError) -> str:
    """What the error said: the bytes the failing op needed at that moment."""
    op = f"`{e.op}`"
    if e.needed_bytes > e.budget_bytes:
        return f"too small: {op} needed ≥ {mb(e.needed_bytes)} MB"
    return (f"too small (fragmented): {op} needed a {mb(e.request_bytes)} MB block, largest "
            f"free {mb(e.largest_free_bytes)} MB")


def run_once(row: StepRow, model: torch.nn.Module, ids: torch.Tensor, state: dict,
             ref_loss: torch.Tensor, ref_grads: Sequence[torch.Tensor | None]) -> Step | None:
    """One more repetition of ``row`` (None if it failed); a failure marks the row, which is
    then not retried (a budget that is too small stays too small)."""
    assert row.budget is not None
    try:
        timed, stats, loss = session_step(model, ids, state, row.budget, row.policy)
    except BudgetTooSmallError as e:
        row.failure = too_small(e)
        log(f"  {row.policy} @ {row.ratio}: {row.failure}")
        return None
    except Exception as e:  # keep the long run going; the table shows what failed
        traceback.print_exc()
        row.failure = f"error: {type(e).__name__}: {str(e)[:120]}"
        return None
    dt = timed.wall
    row.steps.append(timed)
    row.stats.append(stats)
    row.loss_equal.append(torch.equal(loss, ref_loss))
    row.grads_equal.append(same_grads(model, ref_grads))
    log(f"  {row.policy} @ {row.ratio} ({mb(row.budget)} MB): {dt:.2f} s, "
        f"{stats.evictions} evictions, {stats.remat_ops} remat ops, "
        f"peak {mb(stats.peak_bytes)} MB, loss equal {row.loss_equal[-1]}, "
        f"grads equal {row.grads_equal[-1]}, runtime's own work {timed.own * 1e3:.0f} ms")
    return timed


@dataclass
class ScanPoint:
    ratio: float
    seconds: float | None = None  # None: did not complete
    evictions: int = 0
    remat_ops: int = 0
    exact: bool = True
    failure: str = ""


def scan_point(model: torch.nn.Module, ids: torch.Tensor, state: dict, peak: int,
               policy: str, ratio: float, ref_loss: torch.Tensor,
               ref_grads: Sequence[torch.Tensor | None]) -> ScanPoint:
    point = ScanPoint(ratio)
    budget = int(peak * ratio)
    try:
        timed, stats, loss = session_step(model, ids, state, budget, policy)
    except BudgetTooSmallError as e:
        point.failure = "fragmented" if e.needed_bytes <= e.budget_bytes else "too small"
        log(f"    {ratio:g} ({mb(budget)} MB): {too_small(e)}")
        return point
    except Exception as e:  # counted as not completing; the traceback says why
        traceback.print_exc()
        point.failure = f"error: {type(e).__name__}"
        return point
    dt = timed.wall
    point.seconds, point.evictions, point.remat_ops = dt, stats.evictions, stats.remat_ops
    point.exact = torch.equal(loss, ref_loss) and same_grads(model, ref_grads)
    log(f"    {ratio:g} ({mb(budget)} MB): {dt:.2f} s, {stats.evictions} evictions, "
        f"{stats.remat_ops} remat ops, exact {point.exact}")
    return point


def scan(model: torch.nn.Module, ids: torch.Tensor, state: dict, peak: int, policy: str,
         ref_loss: torch.Tensor, ref_grads: Sequence[torch.Tensor | None]) -> list[ScanPoint]:
    """One step at each ratio of SCAN (no monotonicity assumed: a fragmented pool can fail at
    a ratio and complete below it); when none completes, ABOVE_PEAK in turn until one does."""
    log(f"  {policy}: one step at each ratio {SCAN[0]:g} … {SCAN[-1]:g}")
    points = [scan_point(model, ids, state, peak, policy, r, ref_loss, ref_grads)
              for r in SCAN]
    if all(p.seconds is None for p in points):
        for r in ABOVE_PEAK:
            points.append(scan_point(model, ids, state, peak, policy, r, ref_loss, ref_grads))
            if points[-1].seconds is not None:
                break
    return points


def smallest(points: Sequence[ScanPoint]) -> float | None:
    return min((p.ratio for p in points if p.seconds is not None), default=None)


def scan_markdown(scans: dict[str, list[ScanPoint]], peak: int) -> list[str]:
    policies = list(scans)
    ratios = sorted({p.ratio for pts in scans.values() for p in pts}, reverse=True)
    lines = ["| ratio | budget MB | " + " | ".join(policies) + " |",
             "|---:|---:|" + "---|" * len(policies)]
    for r in ratios:
        cells = []
        for policy in policies:
            p = next((p for p in scans[policy] if p.ratio == r), None)
            if p is None:
                cells.append("")
            elif p.seconds is None:
                cells.append(p.failure)
            else:
                bad = "" if p.exact else ", **NOT exact**"
                cells.append(f"{p.seconds:.2f} s, {p.evictions:,} ev., {p.remat_ops:,} remat{bad}")
        lines.append(f"| {r:g} | {mb(int(peak * r))} | " + " | ".join(cells) + " |")
    return lines


@dataclass
class StepRuns:
    """The GPT-2 measurements: the timed rows (``rows[0]`` eager) at the default threads,
    the rows that evicted nothing again with one thread (``single``), and the scans."""

    desc: str
    peak: int
    ops: int
    rows: list[StepRow]
    single: list[StepRow]
    scans: dict[str, list[ScanPoint]]


def run_rounds(rows: Sequence[StepRow], model: torch.nn.Module, ids: torch.Tensor, state: dict,
               ref_loss: torch.Tensor, ref_grads: Sequence[torch.Tensor | None],
               rounds: int) -> None:
    """``rounds`` rounds each running every session row once beside an eager step of its
    own (into ``rows[0]``), the eager step first in even rounds and second in odd ones: each
    pair shares the machine's noise of its moment, and the order cancels out."""
    eager = rows[0]

    def eager_once() -> Step:
        timed, loss = eager_step(model, ids, state)
        eager.steps.append(timed)
        eager.loss_equal.append(torch.equal(loss, ref_loss))
        eager.grads_equal.append(same_grads(model, ref_grads))
        log(f"  eager: {timed.wall:.2f} s")
        return timed

    for k in range(rounds):
        log(f" round {k + 1}/{rounds}")
        for row in rows[1:]:
            if row.failure is not None:
                continue
            if k % 2 == 0:
                plain = eager_once()
                timed = run_once(row, model, ids, state, ref_loss, ref_grads)
            else:
                timed = run_once(row, model, ids, state, ref_loss, ref_grads)
                plain = eager_once()
            if timed is not None:
                row.paired.append(plain)


def measure_gpt2(policies: Sequence[str], quick: bool, rounds: int, do_scan: bool) -> StepRuns:
    """Warm up, find the unconstrained peak (and with ``do_scan`` one step of each policy at
    each ratio of SCAN), time every (policy, budget) in ``rounds`` rounds, then the rows
    that evicted nothing again with one intra-op thread (see ``run_rounds``)."""
    model, ids, desc = build_gpt2(quick)
    state = copy.deepcopy(model.state_dict())
    log(f"\n== GPT-2 step: {desc}")
    log("  eager warm-up step (the reference loss and gradients) …")
    reset(model, state)
    ref_loss = step(model, ids).detach()
    ref_grads = grads_of(model)

    log("  unconstrained dtr session (warm-up, and the peak the ratios scale) …")
    _, free, _ = session_step(model, ids, state, UNCONSTRAINED, "dtr")
    peak, ops = free.peak_bytes, free.ops
    log(f"  unconstrained peak {mb(peak)} MB over {ops:,} aten ops")

    scans: dict[str, list[ScanPoint]] = {}
    eager = StepRow("eager")
    rows = [eager]
    for policy in policies:
        ratios = [(r, False) for r in RATIOS]
        if do_scan:
            least = smallest(scans.setdefault(
                policy, scan(model, ids, state, peak, policy, ref_loss, ref_grads)))
            if least is not None and least not in RATIOS:
                ratios.append((least, True))
        rows += [StepRow(policy, int(peak * r), f"{r:.3g}", scanned=flag)
                 for r, flag in sorted(ratios, reverse=True)]

    run_rounds(rows, model, ids, state, ref_loss, ref_grads, rounds)

    # The same steps with one intra-op thread: this machine's second core is shared, and a
    # parallel kernel waits for its slower thread, so two-thread step times swing by tens of
    # percent while one-thread ones vary by a few (and the runtime's cost, on the main
    # thread, is about the same; it is a smaller share of the longer step).
    single = [StepRow("eager")] + [
        StepRow(r.policy, r.budget, r.ratio, scanned=r.scanned) for r in rows[1:]
        if r.steps and all(st.evictions == 0 for st in r.stats)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        log("\n  one intra-op thread: warm-up eager step (its own reference: kernels split "
            "their sums by thread) and session …")
        _, one_loss = eager_step(model, ids, state)
        one_grads = grads_of(model)
        session_step(model, ids, state, UNCONSTRAINED, "dtr")
        run_rounds(single, model, ids, state, one_loss, one_grads, rounds)
    finally:
        torch.set_num_threads(threads)
    return StepRuns(desc, peak, ops, rows, single, scans)


def ratios(row: StepRow, of: Callable[[Step], float]) -> list[float]:
    """Each session step of ``row`` over the eager step beside it."""
    return [of(a) / of(b) for a, b in zip(row.steps, row.paired, strict=True)]


def steps_markdown(rows: Sequence[StepRow]) -> list[str]:
    eager = median([s.wall for s in rows[0].steps])
    lines = ["| policy | budget | budget MB | step s (median) | vs eager, paired: median "
             "[interval] | fastest vs fastest partner | CPU vs eager, paired | page faults "
             "(median) | runtime's own work ms (of eager step) | evictions | remat ops | "
             "remat s | peak MB | policy search p50 µs | loss = eager | grads = eager |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]

    def yes(xs: Sequence[bool]) -> str:
        return f"yes ({len(xs)}/{len(xs)})" if all(xs) else f"**NO** ({sum(xs)}/{len(xs)})"

    for r in rows:
        if r.policy == "eager":
            faults = median([s.faults for s in r.steps])
            lines.append(f"| eager (no session) | — | — | {eager:.2f} | 1.00 | 1.00 | 1.00 | "
                         f"{faults:,.0f} | — | — | — | — | — | — | {yes(r.loss_equal)} | "
                         f"{yes(r.grads_equal)} |")
            continue
        budget_mb = mb(r.budget or 0)
        label = f"{r.ratio} × peak"
        if r.scanned:
            label += " (smallest found in the scan)"
        if not r.steps:
            lines.append(f"| {r.policy} | {label} | {budget_mb} | {r.failure} | — | — | — | — | "
                         "— | — | — | — | — | — | — | — |")
            continue
        t = median([s.wall for s in r.steps])
        wall = ratios(r, lambda s: s.wall)
        lo, hi = median_interval(wall)
        fastest = min(s.wall for s in r.steps) / min(s.wall for s in r.paired)
        own = median([s.own for s in r.steps])
        note = f" ({r.failure})" if r.failure else ""
        st = r.stats
        lines.append(
            f"| {r.policy} | {label} | {budget_mb} | {t:.2f}{note} | {median(wall):.2f} "
            f"[{lo:.2f}–{hi:.2f}] | {fastest:.2f} | "
            f"{median(ratios(r, lambda s: s.cpu)):.2f} | "
            f"{median([s.faults for s in r.steps]):,.0f} | "
            f"{own * 1e3:.0f} ({own / eager:.1%}) | "
            f"{span([s.evictions for s in st])} | {span([s.remat_ops for s in st])} | "
            f"{median([s.remat_run_seconds for s in st]):.3f} | "
            f"{mb(median([s.peak_bytes for s in st]))} | "
            f"{median([s.search_us.get('p50', 0.0) for s in st]):.1f} | "
            f"{yes(r.loss_equal)} | {yes(r.grads_equal)} |")
    return lines


# ---------------------------------------------------------------------------- report
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: GPT-2 with n_embd 128, 2 layers, seq 64; fewer op loops")
    ap.add_argument("--policies", default=DEFAULT_POLICIES,
                    help=f"comma-separated (default {DEFAULT_POLICIES}; dtr-eq is the "
                         "session's own default)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"report path (default {DEFAULT_OUT})")
    ap.add_argument("--ops", type=int, default=None, help="ops per loop (default 5000; quick 500)")
    ap.add_argument("--op-reps", type=int, default=None,
                    help="repetitions of each op loop (default 25; quick 3)")
    ap.add_argument("--step-reps", type=int, default=None,
                    help="rounds of GPT-2 steps, each running every row once beside an eager "
                         "step of its own (default 10; quick 4; at least 2)")
    ap.add_argument("--instructions", action="store_true",
                    help="also count instructions per op under valgrind (deterministic; a few "
                         "minutes)")
    ap.add_argument("--no-scan", action="store_true",
                    help="skip the one-step scan of ratios 0.95 … 0.35 (and its timed row)")
    ap.add_argument("--system-malloc", action="store_true",
                    help="time the GPT-2 steps with glibc's malloc as it is, which unmaps every "
                         "freed large tensor (by default it is told to keep freed memory)")
    args = ap.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; known: {', '.join(sorted(POLICIES))}")
    n_ops = args.ops or (500 if args.quick else 5000)
    op_reps = args.op_reps or (3 if args.quick else 25)
    step_reps = max(args.step_reps or (4 if args.quick else 10), 2)

    t_start = time.perf_counter()
    op_rows, descs = measure_ops(policies, n_ops, op_reps)
    empty = {p: empty_session_us(p, op_reps) for p in policies}
    t_ops = time.perf_counter() - t_start
    counted = instructions_markdown(policies) if args.instructions else []
    malloc = MALLOC_AS_IS if args.system_malloc else malloc_setting()
    runs = measure_gpt2(policies, args.quick, step_reps, not args.no_scan)
    peak, scans = runs.peak, runs.scans
    wall = time.perf_counter() - t_start

    import transformers

    cmd = "python benchmarks/live_overhead.py" + (" --quick" if args.quick else "")
    cmd += " --instructions" if args.instructions else ""
    cmd += " --system-malloc" if args.system_malloc else ""
    if args.policies != DEFAULT_POLICIES:
        cmd += f" --policies {args.policies}"
    lines = [
        "# Live runtime overhead" + (" (quick run)" if args.quick else ""), "",
        f"Produced by `{cmd}` on {datetime.date.today().isoformat()}: {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads), transformers {transformers.__version__}, Python "
        f"{platform.python_version()}, membudget {git_state(ROOT)} (its core "
        f"{'compiled with mypyc' if COMPILED else 'interpreted: MEMBUDGET_PURE_PYTHON'}). "
        "All numbers come from one "
        "process; plain and in-session runs are interleaved, and each number is a median, "
        "since this machine is shared and noisy. Read ratios, not absolute times.", "",
        f"Wall time: {wall:.0f} s ({t_ops:.0f} s for the op loops).", "",
        "## Per-op overhead", "",
        *ops_markdown(op_rows, descs, n_ops, op_reps, empty), "",
        *([*counted, ""] if counted else []),
        "## GPT-2 training step", "",
        f"{runs.desc}. Pools: "
        + ", ".join(f"{p} {pool}" for p, (_, pool) in empty.items())
        + f". Memory: {malloc}. One step = forward + backward from `load_state_dict` and "
        "`zero_grad(set_to_none=True)` done outside the session and outside the timing; "
        "`torch.manual_seed(1)` before each step, so dropout draws are identical. In-session "
        "times include entering and leaving the session (handing out the loss and gradients). "
        f"Unconstrained dtr session peak: {mb(peak)} MB over {runs.ops:,} aten ops; the ratios "
        f"scale that peak. After a warm-up eager step and a warm-up unconstrained session, "
        f"{step_reps} rounds each ran every session row once, in table order, beside an "
        "eager step of its own: eager first in even rounds, second in odd ones. \"vs eager, "
        "paired\" is the median over the rounds of each session step's time over "
        "its eager partner's: the two share the machine's speed of that moment, which drifts "
        "by tens of percent over a run; in brackets, the order statistics that bound that "
        "median with at least 95 % confidence (distribution-free: the k-th smallest and "
        "largest ratio, k from the binomial(n, 1/2) tails). \"Fastest vs fastest partner\": "
        "the row's fastest step over the fastest of its eager partners (the machine's "
        "interference only ever adds time, so the fastest steps are the nearest to an "
        "undisturbed machine, as the per-op \"fastest reps\" are). \"CPU\" does the paired "
        "ratio with the process's CPU time (user and kernel); \"page faults\" counts the "
        "minor faults of a step. "
        "\"Runtime's own work\" is the time spent inside the "
        "session's dispatch, entering and leaving, less the ops' own run time, recomputation "
        "(`run_seconds`, `remat_run_seconds`, both measured around the ops) and the freeing "
        "of tensors' memory (which eager "
        "does too, when its references go): what the runtime itself adds to a step, a "
        "figure the drift disturbs far less. "
        "Evictions and remat ops show a range when the repetitions differ "
        "(dtr's heuristic reads measured op times). \"remat s\": the recomputations' measured "
        "time.", "",
        *steps_markdown(runs.rows), "",
        "### One intra-op thread", "",
        f"The rows above that evicted nothing, again in {step_reps} rounds with "
        "`torch.set_num_threads(1)`, after a warm-up eager step and session at one thread (the "
        "eager step is also the reference here: a kernel splits its sums by thread). "
        "This machine's second core is shared with other work, and a parallel kernel waits "
        "for its slower thread, so the two-thread steps above swing by tens of percent; with "
        "one thread they vary by a few, and the interval of the ratio narrows. The runtime's "
        "own work runs on the main thread either way, so it is about the same in "
        "milliseconds and a smaller share of the longer one-thread step.", "",
        *steps_markdown(runs.single), ""]
    if scans:
        lines += ["### Ratio scan", "",
                  "Before the timed rounds, one step of each policy at each ratio of the dtr "
                  f"peak from {SCAN[0]:g} down to {SCAN[-1]:g} (and, when none of those "
                  f"completes, {', '.join(f'{r:g}' for r in ABOVE_PEAK)} in turn until one "
                  "does). One unrepeated step each, not interleaved with eager: read the trend, "
                  "not single cells. \"too small\": the pinned and locked bytes plus the "
                  "request exceeded the budget; \"fragmented\": they fit, but no free block "
                  "was large enough. Each policy's smallest completing ratio is timed in the "
                  "rounds above as the \"smallest found\" row.", "",
                  *scan_markdown(scans, peak), ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    log("\n" + "\n".join(lines))
    log(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
