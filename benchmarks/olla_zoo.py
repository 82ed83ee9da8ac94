"""OLLA's static plan on OLLA's models at batch 1 and 32: what reordering and offsets save.

Each model's training step (forward, backward, plain SGD as in OLLA's benchmarks: one update
per parameter) is captured under FakeTensorMode; `membudget.plan.planner.plan_trace` then
reorders its operators and packs every tensor in one arena, both checked by the validators.
Baselines: the recorded order with tensors freed at last use, and the recorded order on the
model of PyTorch's CUDA caching allocator. Writes docs/results/olla-zoo.md and olla-zoo.png.
Run: python benchmarks/olla_zoo.py [--models …] [--batches 1 32] [--time-limit S]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from membudget.plan.planner import plan_trace
from membudget.trace import load_trace
from membudget.trace.capture import cached_trace
from membudget.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
OLLA_MODELS = ["alexnet", "vgg-16", "googlenet", "mobilenet-v2", "efficientnet-b0", "vit-b16",
               "resnet3d-18", "xlm-r-base"]
PAPER = {1: (22.5, 30.4), 32: (10.1, 36.1)}  # OLLA: reordering %, total % (mean over models)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=OLLA_MODELS, metavar="MODEL")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--time-limit", type=float, default=30.0,
                    help="seconds per plan (half order, half offsets)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "olla-zoo.md"))
    args = ap.parse_args()
    out = Path(args.out)
    command = " ".join(["python", "benchmarks/olla_zoo.py", *sys.argv[1:]])
    t0 = time.perf_counter()
    rows = []
    for batch in args.batches:
        for name in args.models:
            trace = load_trace(cached_trace(name, batch, optimizer="sgd"))
            p = plan_trace(trace, args.time_limit)
            s = p.summary()
            s.update(model=name, batch=batch)
            rows.append(s)
            print(f"{name} b{batch}: recorded {format_bytes(p.recorded_peak)}, planned "
                  f"{format_bytes(p.max_live)} ({_pct(s['reduction_from_order'])}), arena "
                  f"{format_bytes(p.arena)} ({_pct(s['reduction_total'])}), "
                  f"{s['order_seconds']:.1f}+{s['pack_seconds']:.1f} s", file=sys.stderr)
    wall = time.perf_counter() - t0

    table = ["| model | batch | ops | recorded order | caching allocator | lower bound | "
             "planned order | reordering | arena | fragmentation | total | vs caching | "
             "order s (status) | offsets s (method) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for s in rows:
        caching = s["caching_allocator_peak"]
        table.append(
            f"| {s['model']} | {s['batch']} | {s['ops']:,} | {format_bytes(s['recorded_peak'])} "
            f"| {format_bytes(caching)} | {format_bytes(s['lower_bound'])} | "
            f"{format_bytes(s['planned_peak'])} | {_pct(s['reduction_from_order'])} | "
            f"{format_bytes(s['arena'])} | {_pct(s['fragmentation'])} | "
            f"{_pct(s['reduction_total'])} | {_pct(1 - s['arena'] / caching)} | "
            f"{s['order_seconds']:.1f} ({s['order_status']}, gap {_pct(s['order_gap'])}) | "
            f"{s['pack_seconds']:.1f} ({s['pack_method']}"
            f"{', optimal' if s['arena_optimal'] else ''}) |")
    summary = ["| batch | reordering (mean) | total vs recorded (mean) | total vs caching "
               "allocator (mean) | median solve s | paper: reordering / total |",
               "|---:|---:|---:|---:|---:|---|"]
    for batch in args.batches:
        at = [s for s in rows if s["batch"] == batch]
        paper = PAPER.get(batch)
        summary.append(
            f"| {batch} | {_pct(statistics.mean(s['reduction_from_order'] for s in at))} | "
            f"{_pct(statistics.mean(s['reduction_total'] for s in at))} | "
            f"{_pct(statistics.mean(1 - s['arena'] / s['caching_allocator_peak'] for s in at))}"
            f" | {statistics.median(s['order_seconds'] + s['pack_seconds'] for s in at):.1f} | "
            + (f"{paper[0]} % / {paper[1]} % |" if paper else "— |"))
    png = _plot(rows, out.with_suffix(".png"))
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
               f"Python {platform.python_version()}, torch {torch.__version__}")
    batches = " and ".join(map(str, args.batches))
    lines = [f"# OLLA's static plan on OLLA's models at batch {batches}",
             "", f"Produced by `{command}` on {date} ({machine}); wall time {wall:.0f} s, "
             f"{args.time_limit:g} s per plan (half for the order, half for the offsets).", "",
             "One training step per model (forward, backward, SGD with one update per "
             "parameter, as OLLA's benchmarks), captured under FakeTensorMode. Recorded order: "
             "the order PyTorch ran with tensors freed at last use (leaves — parameters and "
             "the batch — live throughout). Caching allocator: the recorded order replayed on "
             "our model of PyTorch's CUDA caching allocator (reserved bytes; tensors freed "
             "when released). Reordering: 1 − planned peak / recorded peak. Total: 1 − arena "
             "/ recorded peak. Every order and packing passed the validators.", "",
             "## Summary", "", *summary, "", f"![plan]({png.name})", "",
             "## Per model", "", *table, ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "date": date, "machine": machine, "rows": rows}, indent=1) + "\n")
    print("\n".join(summary))
    print(f"wall time {wall:.0f} s; wrote {out}, {png}")


def _plot(rows: list[dict], path: Path) -> Path:
    """Bars per model and batch: recorded order, caching allocator, planned order, arena."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{s['model']}\nb{s['batch']}" for s in rows]
    series = [("recorded order", "recorded_peak"), ("caching allocator", "caching_allocator_peak"),
              ("planned order", "planned_peak"), ("arena", "arena")]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 4.5))
    width = 0.2
    for k, (what, key) in enumerate(series):
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))],
               [s[key] / s["recorded_peak"] for s in rows], width, label=what)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("memory / recorded-order peak")
    ax.set_title("OLLA static plan: peak of each method relative to the recorded order")
    ax.legend(fontsize=8, ncol=4)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
