"""Swapping to host memory beside recomputation, on Coop's zoo at its paper batch sizes.

Each model's training step (captured under FakeTensorMode, cached on disk) is priced on an A100
80 GB, whose host link is PCIe 4.0 x16, and on an H100 (PCIe 5.0 x16). The simulator replays
it with the default policy at budget ratios 0.7…0.05 three ways: recomputation only (swap off),
host copies only, and both (a victim goes to the host where its copies cost less than
rebuilding it). Host copies run on copy streams that overlap the ops; the overhead counts the
ops' waits for them.
Runs past 2× the unconstrained cost count as not completing. The DTR paper's logs (a TITAN V
on PCIe 3.0) follow for comparison. Writes docs/results/swap.md, swap-*.png and swap.json.
Run: python benchmarks/swap.py [--quick] [--workers N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

from membudget.bench.plot import plot_overhead
from membudget.bench.report import git_state, overhead_markdown
from membudget.bench.sweep import sweep
from membudget.cost.devices import HOST_LINK_EFF, get_spec
from membudget.sim.budgets import op_floor
from membudget.sim.simulate import SimResult
from membudget.trace import expand_sources, load_trace
from membudget.trace.capture import cached_trace

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT.parent / "shared" / "dtr-logs" / "logs.zip"
LOGS_SPEC = "titan-v"  # the GPU of the DTR paper's logs, named in their traces' header
ZOO = ["resnet-50", "inception-v3", "swin-t", "unet", "bilstm", "spos-supernet", "gpt2",
       "bert-large", "gpt3-2.7b"]
SPECS = ["a100-80gb", "h100"]
MODES = ["off", "only", "both"]
RATIOS = [0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05]
POLICY = "default"
QUICK = (["gpt2", "resnet-50"], [0.5, 0.3, 0.2])


def by(results: list[SimResult]) -> dict[tuple[str, str, float], SimResult]:
    return {(r.trace, r.swap, r.ratio): r for r in results}  # type: ignore[misc]


def lowest(runs: dict, trace: str, mode: str, ratios: list[float]) -> float | None:
    """The lowest ratio at which the run completes (None: none does)."""
    ok = [r for r in ratios if runs[trace, mode, r].status == "ok"]
    return min(ok) if ok else None


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _over(r: SimResult) -> str:
    return f"{100 * r.overhead:.1f}%" if r.status == "ok" else r.status


def spec_section(spec: str, results: list[SimResult], ratios: list[float],
                 floors: dict[str, int], title: str = "") -> tuple[str, int, int, int]:
    """The summary table of one device and how many traces meet each half of the target;
    ``floors``: each trace's largest op (bytes), below which no run completes."""
    runs = by(results)
    traces = list(dict.fromkeys(r.trace for r in results))
    mid = 0.5 if 0.5 in ratios else ratios[0]
    rows = ["| model | one op alone | off @0.5 | only @0.5 | both @0.5 | lowest off | "
            "lowest only | lowest both | both at its lowest: waits / recomputation | target |",
            "|---|---:|---|---|---|---|---|---|---|---|"]
    lower = cheaper = reachable = 0
    for t in traces:
        floor = floors[t] / runs[t, "off", mid].baseline_peak_bytes
        lo = {m: lowest(runs, t, m, ratios) for m in MODES}
        off_mid, both_mid = runs[t, "off", mid], runs[t, "both", mid]
        is_lower = lo["both"] is not None and (lo["off"] is None
                                               or lo["both"] <= lo["off"] - 0.1 + 1e-9)
        is_cheaper = both_mid.status == "ok" and (off_mid.status != "ok"
                                                 or both_mid.overhead <= off_mid.overhead)
        lower += is_lower
        cheaper += is_cheaper
        split = "—"
        if lo["both"] is not None:
            b = runs[t, "both", lo["both"]]
            split = (f"{100 * b.extra['swap_stall'] / b.baseline_cost:.1f}% / "
                     f"{100 * b.remat_cost / b.baseline_cost:.1f}%")
        # the ratio the target asks for, below the largest op: no method can complete there
        out_of_reach = lo["off"] is not None and lo["off"] - 0.1 + 1e-9 < floor
        reachable += not out_of_reach
        verdict = ("met" if is_lower and is_cheaper else
                   ("out of reach" if out_of_reach else "not lower by 0.1") if is_cheaper else
                   "costlier at 0.5" if is_lower else "neither")
        rows.append(f"| {t} | {floor:.3f} | {_over(off_mid)} | {_over(runs[t, 'only', mid])} | "
                    f"{_over(both_mid)} | {_ratio(lo['off'])} | {_ratio(lo['only'])} | "
                    f"{_ratio(lo['both'])} | {split} | {verdict} |")
    dev = get_spec(spec)
    head = (f"## {title or spec}: host link {dev.host_link}, "
            f"{dev.host_bandwidth / 1e9:.1f} GB/s rated each way, "
            f"{dev.host_link_rate() / 1e9:.1f} GB/s priced "
            f"({100 * HOST_LINK_EFF:.0f} %)\n\n"
            f"With both, {lower} of {len(traces)} models complete at a ratio at least 0.1 "
            f"below recomputation alone ({len(traces) - reachable} cannot: one op alone "
            f"needs more), and {cheaper} of {len(traces)} cost no more at {mid:g}.\n\n")
    return head + "\n".join(rows), lower, cheaper, len(traces)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    ap.add_argument("--workers", type=int, help="processes (default: all cores)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "swap.md"))
    args = ap.parse_args()
    names, ratios = QUICK if args.quick else (ZOO, RATIOS)
    out = Path(args.out)
    command = " ".join(["python", "benchmarks/swap.py", *sys.argv[1:]])
    t0 = time.perf_counter()
    sections, everything = [], []
    groups = [(spec, spec, [load_trace(cached_trace(m, spec=spec)) for m in names])
              for spec in SPECS]
    if not args.quick:
        groups.append(("dtr-logs", f"DTR paper logs ({LOGS_SPEC})",
                       [load_trace(s) for s in expand_sources([str(LOGS)])]))
    for name, title, traces in groups:
        spec = LOGS_SPEC if name == "dtr-logs" else name
        floors = {tr.name: op_floor(tr) for tr in traces}
        results = sweep(traces, [POLICY], ratios, workers=args.workers, swaps=MODES)
        everything += [{**r.to_json(), "spec": spec} for r in results]
        text, *_ = spec_section(spec, results, ratios, floors, title)
        png = plot_overhead(results, out.with_name(f"{out.stem}-{name}.png"),
                            f"Swap and recomputation: {title} (default policy)")
        sections.append(f"{text}\n\n![overhead against ratio]({png.name})\n\n"
                        f"### Overhead at every ratio ({title})\n\n"
                        f"{overhead_markdown(results)}")
    wall = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(everything, indent=1))
    out.write_text(
        "# Swap to host memory beside recomputation\n\n"
        f"`{command}` — {datetime.date.today()}, {git_state(ROOT)}, {platform.machine()}, "
        f"{wall:.0f} s.\n\n"
        "The default policy (dtr-compact) on Coop's zoo at its paper batch sizes, each step "
        "priced on the device named. **off**: victims are dropped and recomputed. **only**: "
        "they are copied to host memory and back, never recomputed. **both**: each goes to "
        "the host where its copies (the wait for its copy out, behind the copies queued "
        "ahead of it and none once a backup has finished, and the copy in) cost less than "
        "rebuilding it (its op, the evicted ancestors it needs made again and the swapped "
        "ones copied back), else it is dropped; a value the program releases (only the "
        "recomputation of a dropped descendant can read it again) goes to the host, rather "
        "than being dropped, where its host copy has finished and copying it back costs "
        "less than rebuilding it. Copies run on two copy streams (one each way) "
        "beside the ops: once memory first runs short, the idle link backs up the oldest "
        "values ahead of need, so a victim with a finished copy leaves without a wait, and "
        "while the link back is idle the swapped value made last is brought back ahead of "
        "need if a block is free for it with as much again to spare (no eviction is made "
        "for a guess, and until an op reads it, it goes back to the host, with no copy, "
        "before anything is evicted to make room); an op waits only for a copy it needs "
        "that has not finished. The "
        "overhead is (ops + recomputations + moves + waits for copies) / the unconstrained "
        "cost − 1; runs "
        "past 2× count as thrashed. Lowest: the lowest ratio of "
        f"{', '.join(f'{r:g}' for r in ratios)} that completes. Pinned storages "
        "(parameters, optimizer state, gradients held for the optimizer) go to the host "
        "too when swapping is on: the simulated device owns their bytes. **One op alone**: "
        "the most bytes one op holds at once (its inputs and outputs), as a ratio of the "
        "peak: no method completes below it, so where it lies above 0.1 below "
        "recomputation's lowest ratio the target is out of reach.\n\n"
        "Target: with both, every model completes at a ratio at least 0.1 lower than "
        "recomputation alone, at no more overhead at 0.5.\n\n"
        + "\n\n".join(sections) + "\n")
    print(f"wrote {out} in {wall:.0f} s")


if __name__ == "__main__":
    main()
