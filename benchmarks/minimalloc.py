"""Pack MiniMalloc's 11 challenging problems (A..K) at capacity 1 MiB with `membudget.plan.pack`.

Writes docs/results/minimalloc.md and prints the table. The inputs are read from the shared
folder beside the repository (never copied into it).
Run: python benchmarks/minimalloc.py [--shared ../shared/minimalloc] [--time-limit 60]
[--ablation] (--ablation adds a table of each exact solver alone: slow, up to 33 min).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path

import numpy as np
import ortools

from membudget.plan.minimalloc_csv import read_csv
from membudget.plan.pack import SOLVERS, PackResult, pack
from membudget.plan.problem import Problem
from membudget.plan.validate import validate

ROOT = Path(__file__).resolve().parents[1]
NAMES = "ABCDEFGHIJK"


def status(r: PackResult) -> str:
    """Proven optimal, feasible (fits), proven infeasible, or not found in time."""
    if r.fits:
        return "optimal (= max load)" if r.proven_optimal else "fits"
    return "proven infeasible" if r.proven_infeasible else "not found"


def ablation(problems: dict[str, Problem], capacity: int, time_limit: float) -> list[str]:
    """Rows of a table: seconds each exact solver alone (after the greedy portfolio, with
    all the cores) takes to fit each problem in the capacity."""
    lines = ["", "## Each exact solver alone", "",
             f"`pack(problem, capacity, time_limit={time_limit:g}, solvers=[one])` (CP-SAT "
             "alone gets every core, a canonical search one): seconds to a packing within "
             "the capacity; `-` = none found in the time limit.", "",
             "| file | " + " | ".join(SOLVERS) + " |", "|---|" + "---:|" * len(SOLVERS)]
    for name, problem in problems.items():
        cells = []
        for solver in SOLVERS:
            r = pack(problem, capacity=capacity, time_limit=time_limit, solvers=[solver])
            assert validate(problem, r.offsets) == r.height
            cells.append(f"{r.seconds:.1f}" if r.fits else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shared", default=str(ROOT.parent / "shared" / "minimalloc"))
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--capacity", type=int, default=1048576)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "minimalloc.md"))
    ap.add_argument("--ablation", action="store_true",
                    help="also pack each problem with each exact solver alone")
    args = ap.parse_args()
    shared = Path(args.shared)
    load = os.getloadavg()
    lines = [
        f"# MiniMalloc challenging problems at capacity {args.capacity:,} B", "",
        f"Produced by `python benchmarks/minimalloc.py --time-limit {args.time_limit:g}"
        f"{' --ablation' if args.ablation else ''}` on "
        f"{datetime.date.today()}: {platform.machine()}, {os.cpu_count()} cores "
        f"({platform.processor() or platform.platform()}; load average "
        f"{load[0]:.1f} at start), Python {platform.python_version()}, numpy "
        f"{np.__version__}, OR-Tools {ortools.__version__}. Inputs: `{shared.name}/X.1048576.csv` "
        "from google/minimalloc (see SOURCE.md there).", "",
        "Each problem is packed by `pack(problem, capacity, time_limit)`: a greedy portfolio, "
        "then CP-SAT (1 worker) beside two canonical searches (restarts and discrepancy "
        "search) sharing the other core. Every packing is re-checked by the independent "
        "validator. Max load is the lower bound; a packing at it is optimal.", "",
        "| file | buffers | max load (B) | best greedy (B) | greedy vs bound | final arena (B) "
        "| time (s) | result | found by |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    fits = 0
    problems = {name: read_csv(shared / f"{name}.{args.capacity}.csv") for name in NAMES}
    for name, problem in problems.items():
        r = pack(problem, capacity=args.capacity, time_limit=args.time_limit)
        assert validate(problem, r.offsets, args.capacity if r.fits else None) == r.height
        over = 100 * (r.greedy_height / r.lower_bound - 1)
        lines.append(f"| {name} | {len(problem)} | {r.lower_bound:,} | {r.greedy_height:,} | "
                     f"+{over:.1f} % | {r.height:,} | {r.seconds:.1f} | {status(r)} | "
                     f"{r.method} |")
        print(lines[-1], flush=True)
        fits += r.fits
    lines += ["", f"{fits} of {len(NAMES)} fit in {args.capacity:,} B within "
                  f"{args.time_limit:g} s each.", "",
              "## Without a capacity: minimise the arena", "",
              f"`pack(problem, time_limit={args.time_limit:g})` on the problems whose max load "
              "is below the capacity (the others are covered above: a packing at the max "
              "load is optimal).", "",
              "| file | max load (B) | arena (B) | above bound | time (s) | result | found by |",
              "|---|---:|---:|---:|---:|---|---|"]
    for name, problem in problems.items():
        if problem.max_load() >= args.capacity:
            continue
        r = pack(problem, time_limit=args.time_limit)
        assert validate(problem, r.offsets) == r.height
        lines.append(f"| {name} | {r.lower_bound:,} | {r.height:,} | "
                     f"+{100 * (r.height / r.lower_bound - 1):.1f} % | {r.seconds:.1f} | "
                     f"{'optimal' if r.proven_optimal else 'not proven optimal'} | "
                     f"{r.method} |")
        print(lines[-1], flush=True)
    if args.ablation:
        lines += ablation(problems, args.capacity, args.time_limit)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
