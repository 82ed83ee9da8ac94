"""Sweep the DTR paper's 8 logs × the 7 DTR-family policies (fungible pool) × ratios 0.9…0.2.

Writes docs/results/dtr-logs.md (tables, speed figures) and docs/results/dtr-logs.png.
Run: python benchmarks/dtr_logs.py [--logs ../shared/dtr-logs/logs.zip] [--semantics simrd]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from membudget.bench.plot import plot_overhead
from membudget.bench.report import overhead_markdown
from membudget.bench.sweep import sweep
from membudget.core.policies import POLICIES, make_policy
from membudget.trace import expand_sources

ROOT = Path(__file__).resolve().parents[1]
POLICY_ORDER = ["dtr", "dtr-eq", "dtr-local", "msps", "lru", "size", "random"]
RATIOS = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--logs", default=str(ROOT.parent / "shared" / "dtr-logs" / "logs.zip"))
    ap.add_argument("--semantics", default="membudget", choices=["membudget", "simrd"])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args()
    fungible = {name for name in POLICIES if make_policy(name).default_allocator == "fungible"}
    assert set(POLICY_ORDER) == fungible, "benchmark out of date with the DTR-family policies"
    sources = expand_sources([args.logs])
    t0 = time.perf_counter()
    results = sweep(sources, POLICY_ORDER, RATIOS, semantics=args.semantics)
    wall = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "dtr-logs" if args.semantics == "membudget" else "dtr-logs-simrd"
    plot_overhead(results, out / f"{stem}.png",
                  title=f"DTR logs, {args.semantics} semantics: slowdown vs budget ratio "
                        "(x: failed)")

    lines = [f"# DTR paper logs: {len(sources)} logs × {len(POLICY_ORDER)} policies × "
             f"{len(RATIOS)} ratios ({args.semantics} semantics)", "",
             f"Produced by `python benchmarks/dtr_logs.py --semantics {args.semantics}` on "
             f"{os.cpu_count()} cores. Cells: compute overhead (executed cost / baseline cost − "
             "1); OOM: nothing evictable was left; thrash: recomputation exceeded 1× the "
             "baseline cost (overhead limit 2×).", "", f"![plot]({stem}.png)", "",
             "## Baselines", "", "| trace | baseline cost (ms) | baseline peak (MB) |",
             "|---|---:|---:|"]
    seen = set()
    for r in results:
        if r.trace not in seen:
            seen.add(r.trace)
            lines.append(f"| {r.trace} | {r.baseline_cost / 1e6:.1f} | "
                         f"{r.baseline_peak_bytes / 1e6:.1f} |")
    lines += ["", "## Overhead", "", overhead_markdown(results), "", "## Speed", "",
              f"Whole sweep: {len(results)} runs in {wall:.1f} s of wall time.", "",
              "| policy | runs completed | median of per-run p50 search (µs) | "
              "worst per-run p99 (µs) | replay (executed ops/s, median) |",
              "|---|---:|---:|---:|---:|"]
    for policy in POLICY_ORDER:
        runs = [r for r in results if r.policy == policy]
        searched = [r for r in runs if r.search_us.get("count")]
        p50 = statistics.median(r.search_us["p50"] for r in searched) if searched else 0.0
        p99 = max((r.search_us["p99"] for r in searched), default=0.0)
        ops = statistics.median(r.ops_per_s for r in runs if r.ops_per_s)
        done = sum(r.status == "ok" for r in runs)
        lines.append(f"| {policy} | {done}/{len(runs)} | {p50:.1f} | {p99:.1f} | {ops:,.0f} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-(len(POLICY_ORDER) + 4):]))
    print(f"wrote {out / f'{stem}.md'} and {out / f'{stem}.png'}")


if __name__ == "__main__":
    main()
