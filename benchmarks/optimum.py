"""How far the DTR family and Coop are from the best any schedule could do.

For every DTR paper log and four zoo models (captured on the a100-80gb spec at the papers'
batch sizes), at budget ratios 0.7, 0.5 and 0.3, ``membudget.plan.optimum`` bounds the
least recomputation overhead from below (the gap relaxation; Checkmate's MILP where the step
is small enough) and finds the best schedule it can (every candidate run by the simulator).
Beside it, each method's own overhead in the same simulator, as a multiple of the best
schedule found ("× best") and, in brackets, of the proven bound (the true multiple of the
optimum lies between the two). The DTR family runs on the ideal fungible pool, as the
optimum does; Coop on its own address-ordered pool (its paper's setting), so its multiple
also carries fragmentation's cost.

Run: python benchmarks/optimum.py [--time-limit 60] [--quick] [--out docs/results/optimum.md]
[--sources all|logs|zoo] [--replot]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from membudget.inputs import zip_members
from membudget.plan.optimum import BudgetInfeasible, optimum
from membudget.plan.remat_problem import remat_problem
from membudget.sim import measure_baseline, simulate
from membudget.trace import load_trace
from membudget.trace.capture import cached_trace

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT.parent / "shared" / "dtr-logs" / "logs.zip"
ZOO = ["unet", "resnet-50", "inception-v3", "gpt2"]
RATIOS = [0.7, 0.5, 0.3]
METHODS = {"dtr": {}, "dtr-eq": {}, "dtr-local": {}, "coop": None}  # None: its own pool


def sources(quick: bool, which: str = "all") -> list[str]:
    logs = [f"{LOGS}::{m}" for m in zip_members(LOGS, ".log")]
    if quick:
        return [*logs[:1], str(cached_trace("unet", spec="a100-80gb"))]
    zoo = [str(cached_trace(m, spec="a100-80gb")) for m in ZOO] if which != "logs" else []
    return (logs if which != "zoo" else []) + zoo


def fmt(x: float | None, pct: bool = True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{100 * x:.2f}%" if pct else f"{x:.2f}"


def multiple(over: float | None, ref: float | None) -> str:
    if over is None or ref is None:
        return "—"
    if ref <= 1e-12:
        return "=" if over <= 1e-12 else "∞"
    return f"{over / ref:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--ratios", type=float, nargs="+", default=RATIOS)
    ap.add_argument("--quick", action="store_true", help="one log and one zoo model")
    ap.add_argument("--sources", choices=("all", "logs", "zoo"), default="all")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "optimum.md"))
    ap.add_argument("--replot", action="store_true", help="redraw the plot from --out's JSON")
    args = ap.parse_args()
    if args.replot:
        out = Path(args.out)
        plot(json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".png"))
        return
    out = Path(args.out)
    t_start = time.perf_counter()
    rows, records = [], []
    for src in sources(args.quick, args.sources):
        tr = load_trace(src)
        base = measure_baseline(tr)
        prob = remat_problem(tr)
        for ratio in args.ratios:
            t0 = time.perf_counter()
            print(f"{tr.name} @ {ratio}", file=sys.stderr, flush=True)
            try:
                r = optimum(tr, ratio=ratio, time_limit=args.time_limit, problem=prob,
                            baseline=base)
            except BudgetInfeasible as e:
                rows.append(f"| {tr.name} | {ratio} | infeasible: needs ≥ {e.minimum:,} B | "
                            + " | " * (5 + len(METHODS)))
                records.append({"trace": tr.name, "ratio": ratio, "status": "infeasible",
                                "min_budget_bytes": e.minimum})
                continue
            mine, status = {}, {}
            for m, opts in METHODS.items():
                kw = {"allocator": "fungible", "inplace": "cow"} if opts is not None else {}
                s = simulate(tr, m, ratio=ratio, baseline=base, **kw)
                mine[m] = s.overhead if s.status == "ok" else None
                status[m] = s.status
            for m, opts in METHODS.items():  # a run of the table the optimum's limit cut short
                if opts is not None and mine[m] is not None:
                    r = r.beside(f"{m} (own run)", mine[m])
            cells = [status[m] if mine[m] is None else
                     f"{multiple(mine[m], r.overhead)} ({multiple(mine[m], r.lower_bound)})"
                     for m in METHODS]
            rows.append(f"| {tr.name} | {ratio} | {fmt(r.lower_bound)} | {fmt(r.overhead)} | "
                        f"{r.best or '—'} | {fmt(r.gap)} | {'yes' if r.proven else 'no'} | "
                        + " | ".join(cells) + f" | {time.perf_counter() - t0:.0f} s |")
            records.append({**r.to_json(), "methods": mine})
            print("  " + rows[-1], file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t_start
    head = ("| trace | ratio | lower bound | best schedule | from | gap | proven | "
            + " | ".join(f"{m} × best (× bound)" for m in METHODS) + " | time |")
    solved = [x for x in records if x.get("gap") is not None]
    within = sum(1 for x in solved if x["gap"] <= 0.10)
    lines = [
        "# Against the optimum: the DTR family and Coop as multiples of the best schedule",
        "",
        f"Generated by `python benchmarks/optimum.py {' '.join(sys.argv[1:])}` on "
        f"{datetime.date.today()} ({platform.machine()}, Python {platform.python_version()}; "
        f"{elapsed / 60:.0f} min, time limit {args.time_limit:g} s per problem).",
        "",
        "Overheads are the simulator's (executed cost / baseline cost − 1). *lower bound*: "
        "proven, no schedule does better (the best of the gap relaxation and, where the "
        "step is small enough, Checkmate's MILP). *best schedule*: the cheapest schedule "
        "found, run by the simulator (*from*: which candidate; \"own run\": a method's "
        "run of this table, on the same pool, that the optimum's time limit cut short "
        "among its candidates). *gap*: (best − bound) / "
        "best. Method cells: overhead ÷ best schedule, and in brackets ÷ lower bound; the "
        "true multiple of the optimum lies between them.",
        "",
        f"**{within} of {len(solved)}** problems are within a 10 % gap "
        f"({sum(1 for x in solved if x['proven'])} proven optimal).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
        *rows,
        "",
    ]
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(records, indent=1))
    plot(records, out.with_suffix(".png"))
    print(f"wrote {out}", file=sys.stderr)


def plot(records: list[dict], path: Path) -> None:
    """Each method's overhead against the bound and the best schedule, per problem."""
    ok = [r for r in records if r.get("overhead") is not None]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(ok)), 4.5))
    xs = range(len(ok))
    lo = [100 * r["lower_bound"] for r in ok]
    hi = [100 * r["overhead"] for r in ok]
    ax.fill_between(xs, lo, hi, color="0.85", step="mid", label="optimum lies here")
    for m, marker in zip(METHODS, "os^D", strict=False):
        ys = [100 * r["methods"][m] if r["methods"].get(m) is not None else math.nan
              for r in ok]
        ax.plot(xs, ys, marker, label=m, alpha=0.8)
    ax.set_xticks(list(xs), [f"{r['trace'][:12]}@{r['ratio']}" for r in ok], rotation=70,
                  fontsize=7)
    ax.set_ylabel("overhead (%)")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title("Overhead against the optimum's bracket (bound .. best schedule)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
