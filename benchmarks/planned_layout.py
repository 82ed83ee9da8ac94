"""Planned tensor locations for a repeated step, against the default on address-ordered
memory, with the fungible pool as the limit: the traces and ratios of address_aware.py.

A training loop repeats one step. ``planned layout`` runs DTR on the fungible pool once,
packs every storage's lifetime into an arena of the budget's bytes (membudget.plan.run_layout,
checked by the independent validator) and, where the packing fits, runs that schedule from
then on: the limit's overhead on real addresses. Where no packing fits at the budget or at
1, 2 or 4 % below it (the run made there), or where the default costs less, the step stays
with the default. Writes docs/results/planned-layout.md and planned-layout.json.
Run: python benchmarks/planned_layout.py [--quick] [--workers N] [--time-limit S]
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
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from address_aware import (
    LIMIT,
    RATIOS,
    against_limit,
    beats,
    last_run,
    limit_line,
    load,
    paired,
    summary,
)

from membudget.bench.report import git_state
from membudget.bench.sweep import sweep
from membudget.plan.run_layout import SHRINKS, lay_out
from membudget.sim.simulate import SimResult, measure_baseline
from membudget.trace.format import Trace

ROOT = Path(__file__).resolve().parents[1]
PLANNED = "planned layout"
RIVALS = ["coop", "dte@best-fit"]
_TRACES: list[Trace] = []


def _init(quick: bool) -> None:
    _TRACES[:] = load(quick)


def _layout(job: tuple[int, list[float], float]) -> list[dict]:
    """Lay out one trace's runs at each ratio (a worker's job)."""
    k, ratios, time_limit = job
    trace = _TRACES[k]
    base = measure_baseline(trace)
    out = []
    for q in ratios:
        t0 = time.perf_counter()
        lay = lay_out(trace, ratio=q, baseline=base, time_limit=time_limit)
        p = lay.packing
        out.append({"trace": trace.name, "ratio": q, "fits": lay.fits,
                    "run": lay.run.to_json(), "run_budget": lay.run_budget,
                    "tried": lay.tried, "height": None if p is None else p.height,
                    "max_load": None if p is None else p.max_load,
                    "buffers": None if p is None else len(p.offsets),
                    "method": None if p is None else p.method,
                    "seconds": time.perf_counter() - t0})
        print(f"{trace.name}@{q:g}: fits {lay.fits} {lay.tried}", file=sys.stderr, flush=True)
    return out


def combine(results: list[SimResult], layouts: list[dict]) -> list[SimResult]:
    """The planned-layout method's runs: the laid-out schedule where it fits and costs no
    more than the default, else the default's own run."""
    default = {(r.trace, r.ratio): r for r in results if r.method == "default"}
    out = []
    for lay in layouts:
        d = default[(lay["trace"], lay["ratio"])]
        run = SimResult(**lay["run"])
        use = lay["fits"] and (d.status != "ok" or run.overhead <= d.overhead)
        chosen = run if use else d
        out.append(replace(chosen, method=PLANNED, ratio=lay["ratio"],
                           extra={**chosen.extra, "laid_out": use, "fits": lay["fits"]}))
    return out


def gain(results: list[SimResult]) -> str:
    """Over the cells where the layout was used: the default's and the planned layout's
    median overhead as a multiple of the limit's."""
    by = {(r.method, r.trace, r.ratio): r for r in results}
    used = [r for r in results if r.method == PLANNED and r.extra["laid_out"]]
    pairs = [(by[("default", r.trace, r.ratio)], r, by[(LIMIT, r.trace, r.ratio)])
             for r in used]
    pairs = [(d, r, lim) for d, r, lim in pairs
             if d.status == "ok" and lim.status == "ok" and lim.overhead > 0]
    if not pairs:
        return ""
    d = statistics.median(d.overhead / lim.overhead for d, _, lim in pairs)
    p = statistics.median(r.overhead / lim.overhead for _, r, lim in pairs)
    return (f"In the {len(pairs)} of them the default completed too, its median overhead is "
            f"{d:.2f}× the limit's and the planned layout's {p:.2f}×.")


def cells(layouts: list[dict], results: list[SimResult]) -> str:
    """Every cell: the limit, the default, whether a layout fits (at which run budget, the
    packing's height against the budget) and what the planned layout costs."""
    by = {(r.method, r.trace, r.ratio): r for r in results}
    lines = ["| trace | ratio | limit | default | layout: run budget / budget (the last tried "
             "where none fits) | height / budget | lifetimes | packed by | planned layout |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]

    def pct(r: SimResult) -> str:
        return f"{100 * r.overhead:.1f}%" if r.status == "ok" else r.status

    for lay in layouts:
        key = (lay["trace"], lay["ratio"])
        budget = int(by[(LIMIT, *key)].budget_bytes)
        height = lay["height"]
        mine = by[(PLANNED, *key)]
        used = "" if not mine.extra["laid_out"] else " (laid out)"
        lines.append(
            f"| {lay['trace']} | {lay['ratio']:g} | {pct(by[(LIMIT, *key)])} | "
            f"{pct(by[('default', *key)])} | "
            f"{lay['run_budget'] / budget:.2f} | "
            f"{'—' if height is None else f'{height / budget:.4f}'} | "
            f"{lay['buffers'] or '—'} | {lay['method'] or '—'} | {pct(mine)}{used} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--time-limit", type=float, default=5.0,
                    help="seconds for each packing (default 5)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "planned-layout.md"))
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the 2 smallest logs and zoo:gpt2 at 0.7, 0.5, 0.3")
    ap.add_argument("--replot", action="store_true",
                    help="rewrite the page from the JSON of the last run")
    args = ap.parse_args()
    ratios = [0.7, 0.5, 0.3] if args.quick else RATIOS
    out = Path(args.out)
    stem = out.with_suffix("")
    command = " ".join(["python", "benchmarks/planned_layout.py", *sys.argv[1:]])
    if args.replot:
        raw, results, names, ratios = last_run(stem)
        command, date, machine, wall = raw["command"], raw["date"], raw["machine"], raw["wall"]
        layouts, time_limit, code = raw["layouts"], raw["time_limit"], raw["code"]
    else:
        t0 = time.perf_counter()
        traces = load(args.quick)
        names = [t.name for t in traces]
        results = sweep(traces, [LIMIT, "default", *RIVALS], ratios, workers=args.workers)
        jobs = [(k, ratios, args.time_limit) for k in range(len(traces))]
        with ProcessPoolExecutor(args.workers, initializer=_init,
                                 initargs=(args.quick,)) as ex:
            layouts = [lay for out_k in ex.map(_layout, jobs) for lay in out_k]
        results += combine(results, layouts)
        wall = time.perf_counter() - t0
        date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
                   f"Python {platform.python_version()}")
        time_limit = args.time_limit
        code = git_state(ROOT)
    fits = sum(lay["fits"] for lay in layouts)
    used = sum(r.extra["laid_out"] for r in results if r.method == PLANNED)
    *_, misses = against_limit(results, PLANNED)
    lost = beats(results, PLANNED, RIVALS, names, ratios)
    lines = [
        "# Planned tensor locations for a repeated step: DTR's schedule at OLLA's offsets", "",
        f"Produced by `{command}` on {date} ({machine}, {code}). Wall time {wall:.0f} s.", "",
        "The traces and ratios of [address-aware.md](address-aware.md) (the DTR paper's logs "
        "and Coop's zoo at its paper batch sizes), on the best-fit pool: an arena of the "
        "budget's bytes. **planned layout** is for a step that repeats, as a training "
        "loop's does: DTR runs it once on the fungible pool (no addresses), every storage's "
        "lifetime (made, evicted, recomputed, freed) is logged and packed into the budget's "
        f"bytes ({time_limit:g} s per packing; `membudget.plan.run_layout`, each packing "
        "checked by the independent validator), and where the packing fits, every later "
        "step runs that schedule with each storage at its planned offset: the limit's "
        "overhead, with no fragmentation, no moves and no evictions beyond DTR's. Where no "
        "packing fits, DTR is run again "
        + ", ".join(f"{100 * s:g} %" for s in SHRINKS[1:]) + " below the budget (more "
        "recomputation, easier lifetimes); where none fits or the default costs less, the "
        "step stays with the default (`dtr-compact` on its segregated pool, as in "
        "address-aware.md). The first step of a run is always the default's: these figures "
        "are the steady state.", "",
        f"A packing fitted in {fits} of the {len(layouts)} cells; the planned layout was "
        f"used in {used}. {gain(results)}", "",
        "## best-fit pool", "",
        summary(results, [LIMIT, "default", PLANNED, *RIVALS], names, ratios), "",
        f"- `default` {limit_line(results, 'default')}",
        f"- `{PLANNED}` {limit_line(results, PLANNED)}", ""]
    if misses:
        lines += [f"Cells where `{PLANNED}` is outside the target:", "",
                  *[f"- {m}" for m in misses], ""]
    lines += [(f"`{PLANNED}` is at least as good as coop and dte in every column."
               if not lost else
               f"Columns where `{PLANNED}` is not at least as good as coop and dte: "
               + ", ".join(lost) + " (medians over the traces each completed)."), "",
              "Cell by cell:", "", paired(results, PLANNED, ["default", *RIVALS]), "",
              "## Every cell", "", cells(layouts, results), "",
              f"Raw results: [{stem.name}.json]({stem.name}.json)."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    Path(f"{stem}.json").write_text(json.dumps(
        {"command": command, "date": date, "machine": machine, "wall": wall,
         "code": code, "time_limit": time_limit, "layouts": layouts,
         "results": [r.to_json() for r in results]}, indent=1) + "\n")
    print("\n".join(lines[:24]))
    print(f"wall time {wall:.0f} s; wrote {out}, {stem}.json")


if __name__ == "__main__":
    main()
