"""DTR, DTE and Coop on the Coop paper's models at its batch sizes, priced on an A100 80 GB.

Each model's training step (forward, backward, AdamW) is captured under FakeTensorMode
(`membudget trace MODEL --fake`, cached on disk), every op priced by the `a100-80gb` cost
model; the simulator then replays each trace under budgets of 0.9…0.3 × its unconstrained
peak with dtr, dte and coop (each on its paper's pool). Writes docs/results/zoo.md, zoo.png
(overhead against ratio, one panel per model) and zoo.json.
Run: python benchmarks/zoo_sweep.py [--models …] [--ratios …] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

from membudget.bench.plot import plot_overhead
from membudget.bench.report import metrics_markdown, overhead_markdown, summary_markdown
from membudget.bench.sweep import sweep
from membudget.trace import load_trace
from membudget.trace.capture import cached_trace
from membudget.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
COOP_MODELS = ["resnet-50", "inception-v3", "swin-t", "unet", "bilstm", "spos-supernet", "gpt2",
               "bert-large", "gpt3-2.7b"]
METHODS = ["dtr", "dte", "coop"]
RATIOS = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
SPEC = "a100-80gb"
QUICK_MODELS = ["gpt2", "bert-large"]
QUICK_RATIOS = [0.7, 0.5]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", metavar="MODEL")
    ap.add_argument("--methods", nargs="+", default=METHODS, metavar="METHOD")
    ap.add_argument("--ratios", nargs="+", type=float, metavar="RATIO")
    ap.add_argument("--spec", default=SPEC, help="device spec pricing the ops")
    ap.add_argument("--workers", type=int, help="processes (default: all cores)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "zoo.md"))
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {', '.join(QUICK_MODELS)} at {QUICK_RATIOS}")
    args = ap.parse_args()
    names = args.models or (QUICK_MODELS if args.quick else COOP_MODELS)
    ratios = args.ratios or (QUICK_RATIOS if args.quick else RATIOS)
    out = Path(args.out)
    stem = out.with_suffix("")
    command = " ".join(["python", "benchmarks/zoo_sweep.py", *sys.argv[1:]])

    t0 = time.perf_counter()
    traces, rows = [], []
    for name in names:
        t = time.perf_counter()
        path = cached_trace(name, spec=args.spec)
        trace = load_trace(path)
        head = trace.header
        traces.append(trace)
        calls = sum(ev[0] == "call" for ev in trace.events)
        cost = sum(ev[7] for ev in trace.events if ev[0] == "call") / 1e6
        rows.append(f"| {name} | {head['batch']} | {head['params'] / 1e6:,.1f} M | {calls:,} | "
                    f"{cost:,.1f} ms | {time.perf_counter() - t:.1f} s |")
        print(f"captured {name}: {calls:,} ops, {cost:,.1f} ms on {args.spec}", file=sys.stderr)
    t_capture = time.perf_counter() - t0
    print(f"{len(traces)} models × {len(args.methods)} methods × {len(ratios)} ratios",
          file=sys.stderr)
    results = sweep(traces, args.methods, ratios, workers=args.workers)
    wall = time.perf_counter() - t0
    peaks = {r.trace: r.baseline_peak_bytes for r in results}

    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot_overhead(results, f"{stem}.png",
                        title=f"Coop's models on {args.spec} (fake capture): slowdown vs "
                              "budget ratio (x: failed)")
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
               f"Python {platform.python_version()}, torch {torch.__version__}, "
               f"transformers {transformers.__version__}")
    lines = [f"# Coop's models at their paper batch sizes on {args.spec}", "",
             f"Produced by `{command}` on {date} ({machine}). Wall time {wall:.0f} s "
             f"(captures {t_capture:.0f} s, the rest the sweep).", "",
             "Each trace is one training step (forward, backward, fused AdamW update) captured "
             f"under FakeTensorMode with the `{args.spec}` cost model; parameters, their "
             "AdamW state and the batch are pinned for the whole step. A budget ratio is the "
             "budget over that trace's unconstrained peak (tensors freed at last use), so the "
             "pinned state is inside it: it sets how low a ratio can go. Cells: compute "
             "overhead (executed op cost / unconstrained op cost − 1); OOM: nothing evictable "
             "was left; thrash: over the overhead limit (2×).", "",
             "| model | batch | params | ops | step on the spec | capture |",
             "|---|---:|---:|---:|---:|---:|", *rows, "",
             "Unconstrained peaks: " + ", ".join(f"{t} {format_bytes(p)}"
                                                 for t, p in peaks.items()) + ".", "",
             "## Summary", "", summary_markdown(results, [], args.methods, (0.7, 0.5, 0.3)),
             "", f"![overhead]({png.name})", "",
             "## Overhead", "", overhead_markdown(results), "",
             "## Fragmentation and search latency", "", metrics_markdown(results), "",
             f"Raw results: [{stem.name}.json]({stem.name}.json)."]
    out.write_text("\n".join(lines) + "\n")
    Path(f"{stem}.json").write_text(json.dumps(
        {"command": command, "date": date, "machine": machine, "spec": args.spec,
         "results": [r.to_json() for r in results]}, indent=1) + "\n")
    print(overhead_markdown(results))
    print(f"wall time {wall:.0f} s; wrote {out}, {stem}.json, {png}")


if __name__ == "__main__":
    main()
