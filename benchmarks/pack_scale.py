"""Static packing at production scale: `membudget.plan.pack` on the zoo's largest steps, the
MiniMalloc challenging suite and perfect packings made here, each against the max-load
bound and the best greedy order.

Writes docs/results/pack-scale.md and prints each row as it comes. Each problem is packed
in a fresh process so that its peak RSS is its own. The zoo problems are the recorded
order of a fake-captured step at the paper's batch (`membudget plan MODEL
--export-problem`); the MiniMalloc files are read from the shared folder beside the
repository; the perfect packings (`membudget.plan.packing.perfect`) tile a rectangle, so
their optimum is the bound.
Run: python benchmarks/pack_scale.py [--time-limit 60] [--shared ../shared/minimalloc]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ZOO = ("bert-large", "gpt3-2.7b", "resnet-1202", "bilstm")
SUITE = "ABCDEFGHIJK"
PERFECT = ((150, 1), (200, 2), (250, 3), (300, 4), (1000, 5), (3000, 6), (20000, 7))


def one(source: str, time_limit: float) -> dict:
    """Pack one problem (a CSV path, or ``perfect:N:SEED``) in this process."""
    from membudget.plan.minimalloc_csv import read_csv
    from membudget.plan.pack import pack
    from membudget.plan.packing.perfect import perfect_problem
    from membudget.plan.validate import validate

    if source.startswith("perfect:"):
        _, n, seed = source.split(":")
        problem = perfect_problem(int(n), int(seed))
    else:
        problem = read_csv(source)
    r = pack(problem, time_limit=time_limit)
    assert validate(problem, r.offsets) == r.height
    name, greedy = min(r.greedy, key=lambda g: g[1])
    return {"buffers": len(problem), "bound": r.max_load, "lower": r.lower_bound,
            "height": r.height, "seconds": r.seconds, "optimal": r.proven_optimal,
            "method": r.method, "searched": r.searched, "greedy": greedy,
            "greedy_name": name,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def export_zoo(folder: Path) -> dict[str, Path]:
    """The zoo's recorded-order problems as MiniMalloc CSVs (captured once, then cached)."""
    out = {}
    for model in ZOO:
        path = folder / f"{model}.csv"
        subprocess.run([sys.executable, "-m", "membudget.cli", "plan", model,
                        "--export-problem", str(path)], check=True, stdout=subprocess.DEVNULL)
        out[model] = path
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--shared", default=str(ROOT.parent / "shared" / "minimalloc"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "pack-scale.md"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.time_limit)))
        return
    import numpy as np
    import ortools

    load = os.getloadavg()
    lines = [
        "# Static packing at production scale", "",
        f"Produced by `python benchmarks/pack_scale.py --time-limit {args.time_limit:g}` on "
        f"{datetime.date.today()}: {platform.machine()}, {os.cpu_count()} cores (load "
        f"average {load[0]:.1f} at start), Python {platform.python_version()}, numpy "
        f"{np.__version__}, OR-Tools {ortools.__version__}.", "",
        "Each problem is packed by `membudget.plan.pack.pack(problem, time_limit=...)` "
        "(what `membudget pack` runs) in a fresh process, minimising the height; every "
        "packing is re-checked by the independent validator. **bound** is the max load (no "
        "packing is lower); **gap** is the height above the best proven lower bound; "
        "**best greedy** is the lowest of the greedy portfolio's packers, named in the last "
        "column. Peak RSS is the process's own, Python, numpy and OR-Tools included.", "",
        "Problems: the zoo's largest steps at the paper's batch in the recorded order "
        "(`membudget plan MODEL --export-problem X.csv`; parameters and other buffers live "
        "throughout are stacked below the rest before any search); MiniMalloc's challenging "
        "suite (`shared/minimalloc`, minimised rather than fitted to 1 MiB); perfect "
        "packings made here (`membudget.plan.packing.perfect`: a rectangle cut at random, "
        "so the optimum is the bound).", "",
        "| problem | buffers | bound (B) | height (B) | gap | proven | time (s) | peak RSS "
        "| found by | best greedy vs bound | best greedy order |",
        "|---|---:|---:|---:|---:|:-:|---:|---:|---|---:|---|"]
    print("\n".join(lines), flush=True)
    sources: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        sources += [(f"zoo {m}", str(p)) for m, p in export_zoo(Path(tmp)).items()]
        shared = Path(args.shared)
        sources += [(f"MiniMalloc {n}", str(shared / f"{n}.1048576.csv")) for n in SUITE
                    if (shared / f"{n}.1048576.csv").is_file()]
        sources += [(f"perfect {n} (seed {s})", f"perfect:{n}:{s}") for n, s in PERFECT]
        within, worst_over = 0, 0.0
        for label, source in sources:
            done = subprocess.run([sys.executable, __file__, "--one", source,
                                   "--time-limit", str(args.time_limit)],
                                  check=True, capture_output=True, text=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            gap = r["height"] / r["lower"] - 1
            within += gap <= 0.001 or r["optimal"]
            worst_over = max(worst_over, r["seconds"] - args.time_limit)
            lines.append(
                f"| {label} | {r['buffers']:,} | {r['bound']:,} | {r['height']:,} | "
                f"{gap:.3%} | {'yes' if r['optimal'] else 'no'} | {r['seconds']:.1f} | "
                f"{r['rss'] / 2**20:,.0f} MiB | {r['method']} | "
                f"{r['greedy'] / r['bound'] - 1:+.3%} | {r['greedy_name']} |")
            print(lines[-1], flush=True)
    lines += ["", f"Within 0.1 % of the bound or proven optimal: {within} of {len(sources)}. "
              f"Longest overrun of the time limit: {max(worst_over, 0):.1f} s."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
