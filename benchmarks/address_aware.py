"""The default policy against Coop, DTE and DTR on address-ordered pools, with the fungible
pool as the limit: all DTR paper logs and Coop's zoo at its paper batch sizes.

Every method runs at budget ratios 0.9…0.2 on a best-fit pool (each on its own variant:
the default keeps pinned storages at the top, Coop partitions by cost density, DTE and DTR
use plain best fit) and on the model of PyTorch's caching allocator; dtr on the fungible pool
(no addresses, so no fragmentation) is the limit. dtr-compact's ablations change it in one
respect each. Writes docs/results/address-aware.md, address-aware.png and address-aware.json.
Run: python benchmarks/address_aware.py [--quick] [--workers N]
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

from membudget.bench.plot import plot_overhead
from membudget.bench.report import overhead_markdown
from membudget.bench.sweep import sweep
from membudget.core import Engine
from membudget.core.policies import DEFAULT_POLICY
from membudget.sim.simulate import SimResult, simulate
from membudget.trace import expand_sources, load_trace
from membudget.trace.capture import cached_trace
from membudget.trace.format import Trace

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT.parent / "shared" / "dtr-logs" / "logs.zip"
ZOO = ["resnet-50", "inception-v3", "swin-t", "unet", "bilstm", "spos-supernet", "gpt2",
       "bert-large", "gpt3-2.7b"]
SPEC = "a100-80gb"
RATIOS = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
LIMIT = "dtr@fungible"
POOLS = {  # the methods compared on each address-ordered pool
    "best-fit": ["default", "coop", "dte@best-fit", "dtr@best-fit"],
    "torch-caching": ["default@torch-caching", "coop@torch-caching", "dte@torch-caching",
                      "dtr@torch-caching"],
}
ABLATIONS = {  # dtr-compact on its own pool (segregated best fit), changed in one respect
    "dtr@segregated": "no moves: DTR's choices alone on the same pool",
    "dtr-compact@best-fit": "pinned storages placed by best fit like the rest, not at the top",
    "dtr-compact@two-sided": "and Coop's cheap/expensive partition of the rest",
    "dtr-compact@size-sided": "the rest partitioned by size instead: storages larger than "
                              "the running geometric mean of sizes from the bottom, smaller "
                              "ones from the top",
    "dtr-compact@phase-sided": "segregated by lifetime class: storages made in backward "
                               "(gradients and their temporaries) packed from the top with "
                               "the pinned ones, forward's activations from the bottom",
    "dtr-compact-1run": "only the run with the fewest bytes to move is checked for room",
    "dtr-compact-noslide": "no run slid together; only the last resort, compacting the pool",
    "dtr-compact-lastslide": "a run slid together only when nothing is left to evict, "
                             "not once DTR's victims have cost the slide's price",
    "dtr-compact-window": "where no run can be emptied by moves, Coop's cheapest window "
                          "(scored with DTR's exact e*) is evicted instead of DTR's victim",
    "dtr-compact-moves": "moves are never weighed against evicting Coop's cheapest covering "
                         "window: a run is emptied by moves wherever one can be",
    "dtr-compact-share1": "the window is weighed at its whole recomputation cost "
                          "(remat_share 1), not a tenth of it",
}
TOLERANCE = 1.10  # the target: at most this times the limit's overhead
UNBOUNDED = 1 << 62  # a budget no step reaches


def load(quick: bool) -> list[Trace]:
    """The DTR logs and the zoo's traces (captured once, cached on disk); zoo traces are
    named ``zoo:model`` (a DTR log of the same model keeps its plain name)."""
    logs = [load_trace(s) for s in expand_sources([str(LOGS)])]
    models = ZOO
    if quick:
        logs = sorted(logs, key=lambda t: len(t.events))[:2]
        models = ["gpt2"]
    zoo = []
    for name in models:
        trace = load_trace(cached_trace(name, spec=SPEC))
        trace.header["model"] = f"zoo:{name}"
        zoo.append(trace)
        print(f"loaded zoo:{name}", file=sys.stderr)
    return logs + zoo


def minimum_ratio(runs: list[SimResult]) -> float | None:
    """The smallest ratio of the grid at which the run completed (None: none did)."""
    ok = [r.ratio for r in runs if r.status == "ok" and r.ratio is not None]
    return min(ok) if ok else None


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def columns(results: list[SimResult], method: str, traces: list[str],
            ratios: list[float]) -> dict[str, float | None]:
    """One method's summary columns: runs completed, median overhead per ratio (over the
    traces where it completed), median minimum ratio, median fragmentation."""
    runs = [r for r in results if r.method == method]
    out: dict[str, float | None] = {"completed": float(sum(r.status == "ok" for r in runs))}
    for q in ratios:
        out[f"{q:g}"] = _median([r.overhead for r in runs if r.ratio == q and r.status == "ok"])
    mins = [m for t in traces if (m := minimum_ratio([r for r in runs if r.trace == t]))]
    out["minimum ratio"] = _median(mins)
    out["frag."] = _median([r.fragmentation["mean"] for r in runs if r.fragmentation["count"]])
    return out


def summary(results: list[SimResult], methods: list[str], traces: list[str],
            ratios: list[float]) -> str:
    """The summary table of ``methods``: runs completed, median overhead per ratio (traces
    completed), median minimum ratio of the grid, median fragmentation at failed
    allocations."""
    head = ["method", "completed", *[f"{q:g}" for q in ratios], "min. ratio", "frag."]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in methods:
        runs = [r for r in results if r.method == m]
        c = columns(results, m, traces, ratios)
        row = [m, f"{sum(r.status == 'ok' for r in runs)}/{len(runs)}"]
        for q in ratios:
            n = sum(r.status == "ok" for r in runs if r.ratio == q)
            row.append(f"{_pct(c[f'{q:g}'])} ({n})")
        low = c["minimum ratio"]
        row += ["—" if low is None else f"{low:.2f}", _pct(c["frag."])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def against_limit(results: list[SimResult], method: str) -> tuple[int, int, int, list[str]]:
    """How ``method`` fares against the limit cell by cell: of the cells the limit completed
    (their number last but one), those it completed too, those within TOLERANCE × the
    limit's overhead, and the misses."""
    limit = {(r.trace, r.ratio): r for r in results if r.method == LIMIT}
    done = within = total = 0
    misses = []
    for r in results:
        if r.method != method:
            continue
        ref = limit[(r.trace, r.ratio)]
        if ref.status != "ok":
            continue
        total += 1
        if r.status != "ok":
            misses.append(f"{r.trace}@{r.ratio:g}: {r.status} (limit {_pct(ref.overhead)})")
            continue
        done += 1
        if r.overhead <= TOLERANCE * ref.overhead:
            within += 1
        else:
            misses.append(f"{r.trace}@{r.ratio:g}: {_pct(r.overhead)} vs {_pct(ref.overhead)} "
                          f"({r.overhead / ref.overhead:.2f}×)")
    return done, within, total, misses


def limit_line(results: list[SimResult], method: str) -> str:
    """The cells of the limit ``method`` completed, and those within the target."""
    done, within, total, _ = against_limit(results, method)
    return (f"completed {done} of the {total} cells the limit completed; {within} of them at "
            f"no more than {TOLERANCE:.2f}× its overhead.")


def beats(results: list[SimResult], method: str, rivals: list[str], traces: list[str],
          ratios: list[float]) -> list[str]:
    """Each summary column in which ``method`` is not at least as good as every rival
    (more runs completed; lower median overhead, minimum ratio and fragmentation)."""
    mine = columns(results, method, traces, ratios)
    lost = []
    for rival in rivals:
        theirs = columns(results, rival, traces, ratios)
        for col, x in mine.items():
            y = theirs[col]
            if y is None:
                continue
            if x is None or (x < y if col == "completed" else x > y):
                lost.append(f"{col} (vs {rival})")
    return lost


def verdict(results: list[SimResult], ablation: str) -> str:
    """One sentence on what an ablation shows: the limit's cells it completed and those
    within the target, against the default's, and cell by cell which costs less."""
    d0, w0, _, _ = against_limit(results, "default")
    d1, w1, _, _ = against_limit(results, ablation)
    pairs = _pairs(results, ablation, "default")
    lower, higher = sum(a < b for a, b in pairs), sum(a > b for a, b in pairs)
    cells = (f" Cell by cell, of the {len(pairs)} both completed, it costs less in {lower} "
             f"and more in {higher}.")
    if (d1, w1) == (d0, w0):
        return "On these traces it makes no difference to the target." + cells
    if d1 <= d0 and w1 <= w0:
        return (f"What the default does instead is worth {d0 - d1} completed cells and "
                f"{w0 - w1} more within the target here." + cells)
    if d1 >= d0 and w1 >= w0:
        return (f"{d1 - d0} more completed cells and {w1 - w0} more within the target than "
                "the default." + cells)
    return (f"A trade: {d1 - d0:+d} completed cells and {w1 - w0:+d} within the target "
            "against the default." + cells)


def _pairs(results: list[SimResult], method: str, rival: str) -> list[tuple[float, float]]:
    """(overhead of ``method``, overhead of ``rival``) in every cell both completed."""
    mine = {(r.trace, r.ratio): r.overhead for r in results
            if r.method == method and r.status == "ok"}
    return [(mine[(r.trace, r.ratio)], r.overhead) for r in results
            if r.method == rival and r.status == "ok" and (r.trace, r.ratio) in mine]


def paired(results: list[SimResult], method: str, rivals: list[str]) -> str:
    """``method`` against each rival cell by cell, over the cells both completed (medians of
    different sets of completed traces can mislead): how many cells, in how many its
    overhead is lower or equal, and the median ratio of the two overheads."""
    lines = ["| against | cells both completed | `" + method + "` lower or equal | "
             "median overhead ratio |", "|---|---:|---:|---:|"]
    for rival in rivals:
        pairs = _pairs(results, method, rival)
        ratios = [a / b for a, b in pairs if b > 0]
        lower = sum(a <= b for a, b in pairs)
        med = _median(ratios)
        lines.append(f"| {rival} | {len(pairs)} | {lower} | "
                     f"{'—' if med is None else f'{med:.2f}×'} |")
    return "\n".join(lines)


def reserved_ratios(traces: list[Trace]) -> dict[str, float]:
    """Per trace: the most bytes the torch-caching pool (PyTorch's caching allocator)
    reserves in a run with no budget, over the most bytes live at once: what the pool costs
    before any policy acts (whole segments, a 20 MiB one for a request above 1 MiB)."""
    out = {}
    for t in traces:
        engines: list[Engine] = []
        r = simulate(t, "dtr", budget=UNBOUNDED, allocator="torch-caching",
                     on_engine=engines.append)
        out[t.name] = engines[0].allocator.peak_reserved / r.baseline_peak_bytes
    return out


def reservation(misses: list[str], reserved: dict[str, float]) -> tuple[str, str]:
    """The torch-caching pool's own reservation per trace, beside the cells outside the
    target there (``misses``, as :func:`against_limit` names them): one sentence on the
    traces for which the pool reserves more than a budget of 0.9 of the peak holds, and
    the table of every trace."""
    outside = {name: sum(m.startswith(f"{name}@") for m in misses) for name in reserved}
    tight = [name for name, ratio in reserved.items() if ratio > 1 / 0.9]
    sentence = (f"The {len(tight)} of {len(reserved)} traces past it hold "
                f"{sum(outside[name] for name in tight)} of the {len(misses)} cells outside "
                "the target.")
    lines = ["| trace | reserved / live, no budget | cells outside the target |",
             "|---|---:|---:|"]
    for name, ratio in sorted(reserved.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {ratio:.3f} | {outside[name]} |")
    return sentence, "\n".join(lines)


def last_run(stem: Path) -> tuple[dict, list[SimResult], list[str], list[float]]:
    """The JSON a run wrote beside its page ``stem``.md: the whole object, its results, the
    traces and the ratios (largest first)."""
    raw = json.loads(Path(f"{stem}.json").read_text())
    results = [SimResult(**r) for r in raw["results"]]
    names = list(dict.fromkeys(r.trace for r in results))
    ratios = sorted({r.ratio for r in results if r.ratio is not None}, reverse=True)
    return raw, results, names, ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, help="processes (default: all cores)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "address-aware.md"))
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the 2 smallest logs and zoo:gpt2 at 0.7, 0.5, 0.3")
    ap.add_argument("--replot", action="store_true",
                    help="rewrite the page and plot from the JSON of the last run")
    args = ap.parse_args()
    ratios = [0.7, 0.5, 0.3] if args.quick else RATIOS
    out = Path(args.out)
    stem = out.with_suffix("")
    command = " ".join(["python", "benchmarks/address_aware.py", *sys.argv[1:]])

    if args.replot:
        raw, results, names, ratios = last_run(stem)
        command, date, machine, wall = raw["command"], raw["date"], raw["machine"], raw["wall"]
        reserved = raw.get("reserved") or reserved_ratios(load(args.quick))
    else:
        t0 = time.perf_counter()
        traces = load(args.quick)
        reserved = reserved_ratios(traces)
        names = [t.name for t in traces]
        methods = list(dict.fromkeys([LIMIT, *POOLS["best-fit"], *POOLS["torch-caching"],
                                      *ABLATIONS]))
        print(f"{len(traces)} traces × {len(methods)} methods × {len(ratios)} ratios",
              file=sys.stderr)
        results = sweep(traces, methods, ratios, workers=args.workers)
        wall = time.perf_counter() - t0
        date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
                   f"Python {platform.python_version()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot_overhead([r for r in results if r.method in (LIMIT, *POOLS["best-fit"])],
                        f"{stem}.png", title="best-fit pool: slowdown vs budget ratio, "
                                             "with dtr on the fungible pool (x: failed)")
    lines = [
        "# Address-aware eviction: the default against Coop, DTE and DTR, with the fungible "
        "pool as the limit", "",
        f"Produced by `{command}` on {date} ({machine}). Wall time {wall:.0f} s for "
        f"{len(results)} runs.", "",
        f"Traces: the DTR paper's {sum(not n.startswith('zoo:') for n in names)} logs "
        f"(Titan V timings) and Coop's zoo at its paper batch sizes "
        f"({', '.join(n for n in names if n.startswith('zoo:'))}; one training step with "
        f"AdamW, priced on `{SPEC}`). `default` is `{DEFAULT_POLICY}`: DTR's choices, with "
        "fragmentation undone by moving live tensors (a move is priced as one read and one "
        "write of its bytes at the trace's device bandwidth, Titan V for the logs, plus the "
        "device's launch overhead once per batch of independent moves and once per slide, "
        "and counts in the overhead). In the best-fit rows each method runs on its own variant "
        "of the pool: `default` keeps pinned storages at the top (`segregated`), Coop "
        "partitions the rest by cost density (`two-sided`), dte and dtr use plain best "
        "fit. Cells: compute overhead (executed cost / baseline cost − 1, moves "
        "included); a failed run is OOM (nothing evictable was left) or thrash (over 2×). "
        "Minimum ratio: the smallest ratio of the grid each trace completed at (median over "
        "traces). Fragmentation: free bytes / pool at failed allocations (median of the "
        "runs' means).", ""]
    for pool, methods_of in POOLS.items():
        default = methods_of[0]
        *_, misses = against_limit(results, default)
        lost = beats(results, default, methods_of[1:3], names, ratios)
        lines += [f"## {pool} pool", "", summary(results, [LIMIT, *methods_of], names, ratios),
                  "", f"`{default}` {limit_line(results, default)}", ""]
        if misses:
            lines += ["Cells outside the target:", "", *[f"- {m}" for m in misses], ""]
        if pool == "torch-caching":
            sentence, table = reservation(misses, reserved)
            lines += [
                "What the pool itself reserves: with no budget, PyTorch's caching allocator "
                "(this model of it) reserves up to the first column's multiple of the most "
                "bytes live at once, in whole segments (2 MiB for requests up to 1 MiB, 20 "
                "MiB for those up to 10 MiB). Where it passes 1 / 0.9 = 1.11, a budget of 0.9 "
                "of the peak is below what the pool reserves for a step that evicts nothing, "
                "and every method pays for the pool before the policy chooses. "
                + sentence + " (Computed when this page was written, from the same "
                "traces.)", "", table, ""]
        lines += [(f"`{default}` is at least as good as coop and dte in every column."
                   if not lost else
                   f"Columns where `{default}` is not at least as good as coop and dte: "
                   + ", ".join(lost) + " (medians over the traces each completed)."), "",
                  "Cell by cell:", "", paired(results, default, methods_of[1:]), ""]
    lines += ["![best-fit overhead](" + png.name + ")", "", "## Ablations", "",
              f"Each row changes `default` ({DEFAULT_POLICY} on a segregated best-fit pool) "
              "in one respect.", "",
              summary(results, [LIMIT, "default", *ABLATIONS], names, ratios), ""]
    lines += [f"- `default`: {limit_line(results, 'default')}"]
    lines += [f"- `{m}` ({what}): {limit_line(results, m)} {verdict(results, m)}"
              for m, what in ABLATIONS.items()]
    lines += ["", "## Overhead, every run", "", overhead_markdown(results), "",
              f"Raw results: [{stem.name}.json]({stem.name}.json)."]
    out.write_text("\n".join(lines) + "\n")
    Path(f"{stem}.json").write_text(json.dumps(
        {"command": command, "date": date, "machine": machine, "wall": wall,
         "reserved": reserved, "results": [r.to_json() for r in results]}, indent=1) + "\n")
    print("\n".join(lines[:40]))
    print(f"wall time {wall:.0f} s; wrote {out}, {stem}.json, {png}")


if __name__ == "__main__":
    main()
