"""Static checkpointing baselines against DTR-eq, in the same simulator.

For each trace (the DTR paper's 8 logs, and fake captures of a few zoo models, whose headers
record their blocks) and each baseline that applies — Chen's √n, per-block, Megatron's
selective recomputation (transformers), the activation-budget knapsack ("min-cut") at a
half and a fifth of the saved activation bytes, with and without fusion-aware costs — the
baseline's eviction plan is simulated with an unlimited budget: its peak and its overhead
are the plan's. DTR-eq then runs with that peak as its budget. Writes
docs/results/baselines.md (and, with --json FILE, the raw rows).
Run: python benchmarks/baselines.py [--quick] [--models …] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from membudget.bench.report import git_state
from membudget.errors import MembudgetError
from membudget.sim import keepsets, measure_baseline, simulate
from membudget.sim.baselines import header_blocks, plan_from_keep, run_plan, unheld_at_peak
from membudget.trace import expand_sources, load_trace
from membudget.trace.capture import capture_step
from membudget.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
ZOO = [("gpt2", 8), ("bert-large", 4), ("resnet-50", 32)]  # (model, batch): small, fake
KNAPSACK = [0.5, 0.2]  # min-cut budgets: fractions of the saved activation bytes
QUICK_LOGS = ["resnet32", "transformer"]


def methods(g: keepsets.StepGraph, blocks: list[tuple[int, int]] | None
            ) -> list[tuple[str, Any]]:
    """(name, a function making the keep set) for each baseline of the table."""
    saved = sum(v.nbytes for v in g.saved())
    out: list[tuple[str, Any]] = [("chen-sqrt", lambda: keepsets.chen_sqrt(g)),
                                  ("per-block", lambda: keepsets.per_block(g, blocks)),
                                  ("selective", lambda: keepsets.selective(g))]
    for f in KNAPSACK:
        for fused in (False, True):
            out.append((f"min-cut {f:g}" + (" fused" if fused else ""),
                        lambda f=f, fused=fused: keepsets.min_cut(g, int(f * saved), fused)))
    return out


def run_trace(source: str) -> dict[str, Any]:
    """Every baseline on one trace: a row per baseline (or why it does not apply)."""
    t0 = time.perf_counter()
    trace = load_trace(source)
    g = keepsets.StepGraph(trace)
    base = measure_baseline(trace)
    blocks = header_blocks(trace)
    floor = run_plan(trace, plan_from_keep(trace, g, keepsets.all_forward(g), "none"), base)
    rows = []
    for name, make in methods(g, blocks):
        row: dict[str, Any] = {"baseline": name}
        try:
            t = time.perf_counter()
            keep = make()
            plan = plan_from_keep(trace, g, keep.keep, name)
            row["plan_s"] = time.perf_counter() - t
        except MembudgetError as e:
            row["error"] = str(e).split(": ", 1)[-1]
            rows.append(row)
            continue
        r = run_plan(trace, plan, base)
        dtr = simulate(trace, "dtr-eq", budget=r.peak_bytes, baseline=base)
        _, unheld = unheld_at_peak(trace, plan)
        row.update(info={k: v for k, v in keep.info.items() if k != "cuts"},
                   kept=len(keep.keep), evictions=plan.evictions, status=r.status,
                   peak_bytes=r.peak_bytes, peak_ratio=r.peak_bytes / base.peak_bytes,
                   overhead=r.overhead, remat_ops=r.remat_ops,
                   unheld_ratio=unheld / base.peak_bytes,
                   dtr_status=dtr.status, dtr_overhead=dtr.overhead)
        rows.append(row)
    return {"trace": trace.name, "source": source, "calls": g.calls,
            "forward_calls": g.boundary, "boundary": g.boundary_source,
            "blocks": "header" if blocks else "inferred",
            "baseline_peak_bytes": base.peak_bytes, "baseline_cost": base.cost,
            "forward_share": keepsets.forward_cost(g) / base.cost,
            "saved_bytes": sum(v.nbytes for v in g.saved()),
            "no_plan_peak_ratio": floor.peak_bytes / base.peak_bytes,
            "rows": rows, "wall_s": time.perf_counter() - t0}


def _how(row: dict[str, Any]) -> str:
    info = row.get("info", {})
    name = row["baseline"]
    if name == "chen-sqrt":
        return (f"{info['segments']} segments; {info['activations']} activations, "
                f"{info['candidates']} cuts of width {info['width']}")
    if name == "per-block":
        return f"{info['blocks']} blocks ({info['block_source']})"
    if name == "selective":
        return f"{info['cores']} cores, {format_bytes(info['core_bytes'])} evicted"
    est = info["estimated_recompute"] / 1e6
    return (f"saves {format_bytes(info['saved_bytes'])} of {info['items']} activations "
            f"({info['saved']} kept); knapsack estimate {est:.2f} ms"
            + ("" if info["optimal"] else ", not proved optimal"))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _dtr(row: dict[str, Any]) -> str:
    return _pct(row["dtr_overhead"]) if row["dtr_status"] == "ok" else row["dtr_status"]


def markdown(results: list[dict[str, Any]], command: str, wall: float) -> str:
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
               f"Python {platform.python_version()}")
    lines = [
        "# Static checkpointing baselines against DTR-eq", "",
        f"Produced by `{command}` on {date} ({machine}; {git_state(ROOT)}). "
        f"Wall time {wall:.0f} s.", "",
        "Each baseline is a set of forward values to keep; every other forward value the "
        "program still holds is evicted right after its last forward read, the engine "
        "recomputes what the backward reads from the nearest values still resident, and a "
        "value it recomputed is evicted again after its last read (`membudget.sim.baselines`). "
        "The plan runs with an unlimited budget, so **peak** (over the unconstrained peak: "
        "tensors freed at last use) and **overhead** (executed op cost / unconstrained op "
        "cost − 1) are the plan's, measured by the simulator. **DTR-eq** is DTR-eq's "
        "overhead with that peak as its budget (thrashed: recomputation beyond 1× the "
        "baseline cost; oom: it could not fit). **Unheld**: of the peak, the recomputed "
        "values the program no longer holds (intermediates on the way to what the backward "
        "read), over the unconstrained peak: a plan evicts only between calls, so they stay "
        "until the call ends, where a checkpointing runtime frees each as soon as the "
        "recomputation has used it (`unheld_at_peak`; a diagnostic replay, the peak itself is "
        "the simulator's).", "",
        "How each keeps (`membudget.sim.keepsets`):", "",
        "- **chen-sqrt**: the forward's n saved activations cut into about √n segments of "
        "equal forward cost, each cut at a gap that only a few values cross (preferably one: "
        "an articulation point; values read across more than an eighth of the forward — "
        "an encoder's memory, U-Net skips, DenseNet features — are carried and kept); the "
        "values crossing the chosen cuts are kept.",
        "- **per-block**: inside each block, keep only what leaves it; everything outside "
        "blocks (stem, head, loss) kept. Blocks: the zoo traces' `blocks` header (module "
        "forward hooks at capture: the children of an `nn.ModuleList`/`nn.Sequential` with "
        "two or more of one type, innermost); the DTR logs' inferred from the repeating op "
        "sequences between cuts.",
        "- **selective** (Megatron SAR): keep everything except, for each softmax fed by a "
        "matmul (QKᵀ, through scaling, masking and views) and feeding a matmul (PV, "
        "through dropout), the values on the paths between the two matmuls.",
        "- **min-cut f** (the knapsack of torch.compile's `activation_memory_budget`): of the "
        "activations the program holds into the backward, save the set of most total "
        "recompute cost (each its own op's cost) within f × their bytes, solved exactly "
        "(SCIP); **fused**: pointwise ops cost 0 (they would fuse). The knapsack ignores "
        "that recomputing a value needs its inputs; the simulator does not.", "",
        "## Traces", "",
        "| trace | calls (forward) | boundary | forward share of cost | saved activations "
        "| unconstrained peak | peak of no plan |",
        "|---|---:|---|---:|---:|---:|---:|"]
    for res in results:
        lines.append(
            f"| {res['trace']} | {res['calls']:,} ({res['forward_calls']:,}) | "
            f"{res['boundary']} | {_pct(res['forward_share'])} | "
            f"{format_bytes(res['saved_bytes'])} | {format_bytes(res['baseline_peak_bytes'])} "
            f"| {res['no_plan_peak_ratio']:.3f} |")
    lines += ["", "## Results", "",
              "| trace | baseline | peak ratio | unheld | overhead | DTR-eq at that peak | how |",
              "|---|---|---:|---:|---:|---:|---|"]
    for res in results:
        for row in res["rows"]:
            if "error" in row:
                lines.append(f"| {res['trace']} | {row['baseline']} | – | – | – | – | "
                             f"n/a: {row['error']} |")
                continue
            lines.append(f"| {res['trace']} | {row['baseline']} | {row['peak_ratio']:.3f} | "
                         f"{row['unheld_ratio']:.3f} | {_pct(row['overhead'])} | {_dtr(row)} | "
                         f"{_how(row)} |")
    lines += [
        "", "## Notes", "",
        "- A peak ratio above 1 is a recomputation chain: one backward read makes the engine "
        "recompute a run of evicted values back to a kept one, all resident at once. The "
        "knapsack, which prices each value by its own op alone, evicts exactly such runs "
        "(a ResNet's residual sums and ReLUs, an LSTM's pointwise cell under `fused`); "
        "**unheld** is the part of it a checkpointing runtime would free during the "
        "recomputation.",
        "- `unroll_gan` has no phase marker: the boundary is its first `*backward*` op, so "
        "its \"forward\" is the first 60 of 6,024 calls (an unrolled GAN step runs many "
        "forward and backward passes) and no baseline changes much there. Its peak with no "
        "plan is 1.029: under any budget the engine keeps released leaves resident, where "
        "the unconstrained baseline frees them.",
        "- Per-block on the DTR logs uses blocks inferred from repeated op sequences; on "
        "`treelstm` (a tree, no layers) and `unroll_gan` that finds little.",
        "- Only values the program holds into the backward can be kept (the engine drops a "
        "released value at once), so cuts and block inputs are placed at held values; "
        "where a block's input is not held (a MobileNet residual sum read only by a pad), "
        "per-block keeps the held values computed from it instead."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logs", default=str(ROOT.parent / "shared" / "dtr-logs" / "logs.zip"))
    ap.add_argument("--models", nargs="*", metavar="MODEL:BATCH",
                    help="zoo models to capture (fake), default "
                         + " ".join(f"{m}:{b}" for m, b in ZOO))
    ap.add_argument("--workers", type=int, help="processes (default: all cores)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "baselines.md"))
    ap.add_argument("--json", metavar="FILE", help="also write the raw results there")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {', '.join(QUICK_LOGS)} and gpt2 only")
    args = ap.parse_args()
    zoo = ([(m, int(b)) for m, b in (x.split(":") for x in args.models)]
           if args.models is not None else ZOO[:1] if args.quick else ZOO)
    command = " ".join(["python", "benchmarks/baselines.py", *sys.argv[1:]])
    out = Path(args.out)
    t0 = time.perf_counter()
    sources = expand_sources([args.logs]) if Path(args.logs).is_file() else []
    if args.quick:
        sources = [s for s in sources if any(f"/{n}-" in s for n in QUICK_LOGS)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, batch in zoo:  # captured here: the cached captures predate the header
            path = Path(tmp) / f"{name}-b{batch}.jsonl.gz"
            capture_step(name, batch, fake=True, path=path)
            sources.append(str(path))
            print(f"captured {name} at batch {batch}", file=sys.stderr)
        with ProcessPoolExecutor(args.workers) as pool:
            results = list(pool.map(run_trace, sources))
    for res in results:
        print(f"{res['trace']}: {res['wall_s']:.1f} s", file=sys.stderr)
    wall = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(results, command, wall)
    out.write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "results": results},
                                              indent=1, default=str) + "\n")
    print(text)
    print(f"wall time {wall:.0f} s; wrote {out}" + (f" and {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
