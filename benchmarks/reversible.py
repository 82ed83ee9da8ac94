"""Reversible layers against their plain twins, and against the plain twin under a budget.

For each reversible zoo model (``revvit``, ``revbifpn``) and its ``-plain`` twin (the same
parameters, plain autograd), one training step (zero_grad, forward, backward; the optimizer
update is the same for both and left out) is measured:

- **memory**: the peak of live storages by ``membudget.bench.meter.StorageMeter`` (an
  independent dispatch mode; entered outside any session), parameters and gradients included;
- **time**: the step's wall time, median over ``--reps`` rounds; each round runs every row
  once, interleaved, and each row's overhead is its time over the same round's plain eager
  step, minus one (the median of those is reported, so the rows share the machine's noise);
- **gradient error** of the reversible step against the plain one (float32), as the largest
  per-tensor max |difference| / max |reference|.

Then the plain twin runs inside ``membudget.budget`` (default policy) at fractions of its
unconstrained session peak, and the memory it needs to reach the reversible model's overhead
is interpolated (linearly, between the two budgets whose overheads bracket it): "memory
against the plain model at the same overhead". Writes docs/results/reversible.md and .png.
Run: python benchmarks/reversible.py [--quick] [--reps N] [--threads N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import torch

import membudget
from membudget import BudgetTooSmallError
from membudget.bench.malloc import keep_freed_memory
from membudget.bench.meter import StorageMeter
from membudget.bench.report import git_state
from membudget.core import COMPILED
from membudget.models import Workload, build

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"revvit": 8, "revbifpn": 16}  # model: batch (activations dominate the parameters)
QUICK = {"revvit": 2, "revbifpn": 4}
RATIOS = [0.8, 0.6, 0.5, 0.4, 0.35, 0.3, 0.25, 0.2]  # of the plain session peak
UNLIMITED = 10**12
MB = 1e6


@dataclass
class Row:
    """One way to run a step: its memory, and its times (one per round)."""

    label: str
    run: Callable[[], list[torch.Tensor]]
    budget: int | None = None
    meter_peak: int = 0
    session_peak: int | None = None
    evictions: int | None = None
    grad_error: float | None = None
    times: list[float] = field(default_factory=list)  # one per round

    def overhead(self, base: Row) -> float:
        """The median over rounds of this row's time over ``base``'s, minus one."""
        return statistics.median(t / b for t, b in zip(self.times, base.times, strict=True)) - 1


def step(wl: Workload) -> list[torch.Tensor]:
    """One forward and backward from a fixed seed; the parameters' gradients."""
    wl.model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    wl.loss(wl.model, wl.batch).backward()
    return [p.grad for p in wl.model.parameters()]


def in_budget(wl: Workload, nbytes: int, row: Row | None = None) -> list[torch.Tensor]:
    with membudget.budget(nbytes) as session:
        grads = step(wl)
    if row is not None:
        row.session_peak, row.evictions = session.stats.peak_bytes, session.stats.evictions
    return grads


def grad_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref,
                                                                             strict=True))


def twins(name: str, batch: int) -> tuple[Workload, Workload]:
    """The reversible workload and its plain twin: the same seed, so the same parameters and
    batch (checked)."""
    built = []
    for model in (name, f"{name}-plain"):
        torch.manual_seed(0)
        built.append(build(model, batch))
    rev, plain = built
    assert all(torch.equal(a, b) for a, b in zip(rev.model.state_dict().values(),
                                                 plain.model.state_dict().values(), strict=True))
    return rev, plain


def measure(name: str, batch: int, reps: int) -> tuple[list[Row], int]:
    """The rows of one model: plain eager, reversible eager, plain in a session with no
    limit, then plain under each budget that completes; and the bytes of its parameters
    and their gradients (in every row's peak)."""
    rev, plain = twins(name, batch)
    fixed = 2 * sum(p.numel() * p.element_size() for p in plain.model.parameters())
    ref = [g.clone() for g in step(plain)]
    eager = Row(f"{name}-plain, eager", lambda: step(plain))
    revrow = Row(f"{name}, eager", lambda: step(rev))
    revrow.grad_error = grad_error(step(rev), ref)
    free = Row(f"{name}-plain, session, no limit", lambda: in_budget(plain, UNLIMITED))
    in_budget(plain, UNLIMITED, free)
    assert free.session_peak is not None
    rows = [eager, revrow, free]
    for ratio in RATIOS:
        nbytes = int(ratio * free.session_peak)
        row = Row(f"{name}-plain, budget {ratio:.2f}", lambda n=nbytes: in_budget(plain, n),
                  budget=nbytes)
        try:
            row.grad_error = grad_error(in_budget(plain, nbytes, row), ref)
        except BudgetTooSmallError as e:
            print(f"  {row.label}: too small ({e.needed_bytes / MB:.0f} MB needed)",
                  file=sys.stderr)
            continue
        rows.append(row)
    for row in rows:
        with StorageMeter() as meter:
            row.run()
        row.meter_peak = meter.peak_bytes
    for r in range(reps):
        for row in rows:
            t = time.perf_counter()
            row.run()
            row.times.append(time.perf_counter() - t)
        print(f"  round {r + 1}/{reps}: eager {eager.times[-1]:.2f} s", file=sys.stderr)
    return rows, fixed


def at_overhead(rows: list[Row], base: Row, overhead: float) -> tuple[float | None, str]:
    """The plain twin's memory (StorageMeter) in a session at ``overhead`` over ``base``:
    going down the budgets, the first two whose overheads bracket it, interpolated linearly;
    and how it was found."""
    points = sorted(((r.meter_peak, r.overhead(base)) for r in rows), reverse=True)
    if overhead < points[0][1]:
        return None, (f"the session with no limit already costs {points[0][1]:+.0%}, "
                      "its own bookkeeping")
    for (m1, o1), (m2, o2) in pairwise(points):
        if o1 <= overhead <= o2:
            w = 0.0 if o2 == o1 else (overhead - o1) / (o2 - o1)
            return m1 + w * (m2 - m1), (f"interpolated between the budgets at {o1:+.0%} "
                                        f"and {o2:+.0%}")
    return points[-1][0], (f"no completed budget costs that much (the smallest costs "
                           f"{points[-1][1]:+.0%}): the least memory measured, an upper bound")


def table(name: str, rows: list[Row], fixed: int) -> list[str]:
    eager, revrow, free = rows[:3]
    lines = [f"### {name}", "",
             "| run | budget MB | StorageMeter peak MB | × plain eager | session peak MB | "
             "evictions | step s (median) | overhead vs plain eager | overhead vs session, "
             "no limit | grad error vs plain |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.label} | {'' if r.budget is None else f'{r.budget / MB:.1f}'} | "
            f"{r.meter_peak / MB:.1f} | {r.meter_peak / eager.meter_peak:.2f} | "
            f"{'' if r.session_peak is None else f'{r.session_peak / MB:.1f}'} | "
            f"{'' if r.evictions is None else r.evictions} | "
            f"{statistics.median(r.times):.3f} | {r.overhead(eager):+.0%} | "
            f"{r.overhead(free):+.0%} | "
            f"{'' if r.grad_error is None else f'{r.grad_error:.1e}'} |")
    lines += ["", f"The reversible step costs {revrow.overhead(eager):+.0%} over the plain eager "
              f"step, at a peak of {revrow.meter_peak / MB:.1f} MB "
              f"({revrow.meter_peak / eager.meter_peak:.2f} of plain eager; parameters and "
              f"gradients are {fixed / MB:.1f} MB of every peak, so the rest is "
              f"{(revrow.meter_peak - fixed) / MB:.1f} MB against "
              f"{(eager.meter_peak - fixed) / MB:.1f} MB). The plain twin under "
              "`membudget.budget` at that overhead:", ""]
    for base, what in ((eager, "counted over plain eager (what a user pays, the session's "
                               "bookkeeping included)"),
                       (free, "counted over the session with no limit (recomputation and "
                              "eviction only, as the simulator counts overhead)")):
        memory, how = at_overhead(rows[2:], base, revrow.overhead(eager))
        lines.append(f"- {what}: " + (
            f"**{memory / MB:.1f} MB** ({memory / eager.meter_peak:.2f} of plain eager, "
            f"{memory / revrow.meter_peak:.2f} of reversible; {how})." if memory is not None
            else f"no budget matches ({how})."))
    return [*lines, ""]


def plot(results: dict[str, tuple[list[Row], int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (name, (rows, fixed)) in zip(axes[0], results.items(), strict=True):
        eager, revrow = rows[:2]
        budgeted = sorted(rows[2:], key=lambda r: r.overhead(eager))
        ax.plot([100 * r.overhead(eager) for r in budgeted],
                [r.meter_peak / MB for r in budgeted], "o-",
                label="plain twin under membudget.budget")
        ax.plot([0], [eager.meter_peak / MB], "ks", label="plain twin, eager")
        ax.plot([100 * revrow.overhead(eager)], [revrow.meter_peak / MB], "r*", markersize=14,
                label="reversible")
        ax.axhline(fixed / MB, color="gray", linestyle="--", linewidth=1,
                   label="parameters + gradients")
        ax.set_title(name)
        ax.set_xlabel("step time overhead vs plain eager (%)")
        ax.set_ylabel("peak of live storages (MB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"smaller batches {QUICK}, 2 rounds")
    ap.add_argument("--reps", type=int, help="timed rounds (default 5; 2 with --quick)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (default 1: this machine is shared)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "reversible.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kept = keep_freed_memory()
    models = QUICK if args.quick else MODELS
    reps = args.reps or (2 if args.quick else 5)
    t0 = time.perf_counter()
    results = {}
    for name, batch in models.items():
        print(f"{name} at batch {batch}", file=sys.stderr)
        results[name] = measure(name, batch, reps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(results, out.with_suffix(".png"))
    cmd = " ".join(["python", "benchmarks/reversible.py", *sys.argv[1:]])
    lines = [
        "# Reversible layers against the plain model, eager and under a budget", "",
        f"Produced by `{cmd}` on {datetime.date.today().isoformat()}: {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} "
        f"thread(s)), Python {platform.python_version()}, membudget {git_state(ROOT)} (its "
        f"core {'compiled with mypyc' if COMPILED else 'interpreted'}); glibc malloc "
        f"{'told to keep freed memory' if kept else 'as it is'}. Wall time "
        f"{time.perf_counter() - t0:.0f} s.", "",
        "One step = zero_grad, forward, backward (float32, random init, the zoo's batch "
        "below); the optimizer update is the same for all rows and left out. Peaks are "
        "StorageMeter's (live storages seen from dispatch: parameters and gradients "
        f"included). Times are medians over {reps} interleaved rounds; an overhead is the "
        "median of each round's time over that round's plain eager step (or plain step in "
        "a session with no limit), minus one. Budgets are fractions of the plain twin's "
        "unconstrained session peak; membudget's default policy. Gradient error: the "
        "largest per-tensor max |g − g_plain| / max |g_plain| (the plain rows under a "
        "budget must be 0: recomputation is exact).", "",
        f"Models (batch): {', '.join(f'{n} ({b})' for n, b in models.items())}. "
        f"![memory against overhead]({out.with_suffix('.png').name})", ""]
    for name, (rows, fixed) in results.items():
        lines += table(name, rows, fixed)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
