"""The ``membudget`` command line: import and capture traces, simulate, sweep, plan, pack, demo."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import ProgressColumn, Task
from rich.text import Text

from membudget.errors import MembudgetError
from membudget.outputs import check_output, write_text
from membudget.plan.interrupt import EXIT_CODE
from membudget.units import format_bytes, parse_bytes

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="Train under a memory budget, and compare the methods for it.")
import_app = typer.Typer(no_args_is_help=True, help="Convert other formats into membudget traces.")
app.add_typer(import_app, name="import")

# Tables stay whole when the output is a file or a pipe (rich would wrap at 80 columns).
# Markup only where a line asks for it, and no emoji codes: names and paths from the input may
# hold brackets, and "file:100:" is a line number, not an emoji.
out = Console(width=None if sys.stdout.isatty() else 200, markup=False, emoji=False)
err = Console(stderr=True, markup=False, emoji=False)


def _floats(text: str, what: str) -> list[float]:
    """Comma-separated finite numbers > 0 (budget ratios), at least one."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MembudgetError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise MembudgetError(f"{what} is empty; give at least one number")
    for v in values:
        _positive(v, what)
    return values


def _names(text: str, what: str = "the list") -> list[str]:
    """Comma-separated names, at least one."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise MembudgetError(f"{what} is empty; give at least one name")
    return names


def _limit(value: float) -> float | None:
    """An --overhead-limit: None for inf; at least 1 (the program's own ops), never NaN."""
    if not value >= 1:
        raise MembudgetError(f"--overhead-limit must be at least 1 (× the unconstrained cost) "
                             f"or inf, got {value}")
    return None if value == float("inf") else value


def _positive(value: float | None, option: str) -> float | None:
    """``value`` if it is None or a finite number > 0; else a clear error naming ``option``."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise MembudgetError(f"{option} must be a finite number > 0, got {value}")
    return value


def _budget(ratio: float | None, budget: str | None) -> int | None:
    """The budget in bytes from ``--budget`` (None when ``--ratio`` is given instead), once
    exactly one of them is given and it is valid."""
    if (ratio is None) == (budget is None):
        raise MembudgetError("give exactly one of --ratio and --budget")
    _positive(ratio, "--ratio")
    try:
        return None if budget is None else parse_bytes(budget)
    except ValueError as e:
        raise MembudgetError(str(e)) from None


@contextmanager
def _no_result_at_ctrl_c() -> Iterator[None]:
    """Ctrl-C before a solve has a result (or a second one during it): one line, exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        err.print("interrupted before any valid result")
        raise typer.Exit(EXIT_CODE) from None


def _ratio(value: float | None) -> str:
    return "none" if value is None else f"{value:.2f}"


POLICY_HELP = "Eviction policy (default: dtr-compact, see the README)."
ALLOCATOR_HELP = ("Memory pool: fungible, best-fit, segregated, two-sided, size-sided, "
                  "phase-sided or torch-caching (default: the policy's own; dtr-compact: "
                  "segregated, coop: two-sided, dte/megengine: best-fit, else fungible).")
INPLACE_HELP = ("In-place writes: cow (copy-on-write) or remat (recomputable in-place; "
                "default for coop).")
SWAP_HELP = ("Where evicted values go: off (dropped and recomputed), only (copied to host "
             "memory and back) or both (whichever is cheaper to undo).")
# the trace a command reads, and its budget given one way or the other (read by _budget)
TraceArgument = Annotated[str, typer.Argument(help="A membudget trace or a DTR log "
                                                   "(archive.zip::member reads inside a zip).")]
RatioOption = Annotated[float | None, typer.Option(help="Budget as a fraction of the "
                                                        "unconstrained peak.")]
BudgetOption = Annotated[str | None, typer.Option(help="Budget in bytes (units allowed: "
                                                       "'8GB', '1.5GiB').")]


@import_app.command("dtr-log")
def import_dtr_log(
    log: Annotated[str, typer.Argument(help="A DTR simulator log (or archive.zip::member).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Trace to write (.gz to "
                                                                 "compress).")],
) -> None:
    """Convert a DTR paper simulator log into a membudget trace."""
    from membudget.trace import read_dtr_log, write_trace

    check_output(output, [log])
    trace = read_dtr_log(log)
    n = write_trace(output, trace.header, trace.events)
    err.print(f"wrote {n} events of {trace.name} to {output}")


@app.command()
def simulate(
    trace: TraceArgument,
    policy: Annotated[str, typer.Option(help=POLICY_HELP)] = "default",
    allocator: Annotated[str | None, typer.Option(help=ALLOCATOR_HELP)] = None,
    inplace: Annotated[str | None, typer.Option(help=INPLACE_HELP)] = None,
    swap: Annotated[str, typer.Option(help=SWAP_HELP)] = "off",
    ratio: RatioOption = None,
    budget: BudgetOption = None,
    semantics: Annotated[str, typer.Option(help="membudget, or simrd for the DTR paper's "
                                                "simulator accounting.")] = "membudget",
    overhead_limit: Annotated[float, typer.Option(help="Give up ('thrashed') once executed "
                                                       "cost exceeds this × baseline; inf "
                                                       "disables.")] = 2.0,
    seed: Annotated[int, typer.Option(help="Seed of the randomized policies.")] = 0,
    min_budget: Annotated[bool, typer.Option("--min-budget", help="Also bisect the minimum "
                                             "and the cutoff budget ratio (to 1%).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Replay TRACE under a budget with one policy and report what it cost."""
    from membudget.sim import simulate as run
    from membudget.sim.budgets import budget_limits
    from membudget.sim.simulate import measure_baseline
    from membudget.trace import load_trace

    nbytes = _budget(ratio, budget)
    limit = _limit(overhead_limit)
    tr = load_trace(trace)
    base = measure_baseline(tr)
    result = run(tr, policy, ratio=ratio, budget=nbytes, semantics=semantics,
                 overhead_limit=limit, seed=seed, allocator=allocator,
                 inplace=inplace, baseline=base, swap=swap)
    limits = None
    if min_budget:
        with err.status("bisecting the minimum and cutoff budgets"):
            limits = budget_limits(tr, policy, allocator=allocator, inplace=inplace,
                                   semantics=semantics, overhead_limit=limit,
                                   baseline=base, seed=seed, swap=swap)
    if as_json:
        obj = result.to_json()
        if limits is not None:
            obj["budget_limits"] = limits.to_json()
        print(json.dumps(obj))
        if result.status != "ok":  # as in text mode
            raise typer.Exit(1)
        return
    s = result.search_us
    f = result.fragmentation
    out.print(f"[bold]{escape(result.trace)}[/] · {result.policy} on {result.allocator}, "
              f"in-place {result.inplace}, swap {result.swap} · {semantics} semantics",
              markup=True)
    out.print(f"status        {result.status}" + (f" — {result.message}" if result.message
                                                 else ""))
    out.print(f"budget        {format_bytes(result.budget_bytes)} "
              f"(baseline peak {format_bytes(result.baseline_peak_bytes)})")
    out.print(f"peak          {format_bytes(result.peak_bytes)}")
    if result.status == "ok":
        out.print(f"overhead      {100 * result.overhead:.2f}% of baseline cost "
                  f"{result.baseline_cost:.4g}")
    else:  # a partial run: its overhead says nothing of a complete one
        base = result.baseline_cost or 1.0
        out.print(f"overhead      none: the run stopped after executing "
                  f"{100 * result.executed_cost / base:.1f}% of baseline cost "
                  f"{result.baseline_cost:.4g} (recomputation: "
                  f"{100 * result.remat_cost / base:.1f}% of the baseline cost)")
    out.print(f"evictions     {result.evictions} (+{result.eager_evictions} on release), "
              f"remat ops {result.remat_ops}")
    x = result.extra
    if result.swap != "off":
        out.print(f"swaps         {x['swap_outs']} out, {x['swap_ins']} in, "
                  f"{format_bytes(x['swapped_bytes'])} copied to host ({x['backups']} backed "
                  f"up and {x['prefetches']} brought back ahead; {x['shelved']} released there), "
                  f"waits {x['swap_stall']:.4g}, "
                  "host peak "
                  f"{format_bytes(x['host_peak'])}")
    out.print(f"search        p50 {s['p50']:.1f} µs, p99 {s['p99']:.1f} µs, max {s['max']:.1f} "
              f"µs over {s.get('count', 0)} failed allocations")
    out.print(f"fragmentation mean {100 * f['mean']:.1f}%, max {100 * f['max']:.1f}% of the pool "
              "free at failed allocations")
    out.print(f"replay        {result.wall_s:.2f} s, {result.ops_per_s:,.0f} ops/s")
    if limits is not None:
        out.print(f"min budget    {_ratio(limits.minimum)} · cutoff {_ratio(limits.cutoff)} "
                  f"(bisection to {limits.tolerance:g}, {limits.runs} runs)")
    if result.status != "ok":
        raise typer.Exit(1)


@app.command()
def optimum(
    trace: TraceArgument,
    ratio: RatioOption = None,
    budget: BudgetOption = None,
    time_limit: Annotated[float, typer.Option(help="Seconds for the whole search (about).")]
    = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plan_out: Annotated[Path | None, typer.Option(help="Write the best schedule as an "
                                                       "eviction plan (JSON).")] = None,
) -> None:
    """The least recomputation any schedule of TRACE needs under a budget: a proven lower
    bound and the best schedule found, with the gap between them.

    - **Bounds**: a gap relaxation (every size) and Checkmate's MILP (Jain et al., MLSys'20;
      with memory relaxed so that its dual bound is a bound), both solved with HiGHS; the
      MILP runs on steps small enough for it (see the README).
    - **Schedules**: the DTR family's decisions, Checkmate's schedule and the relaxation's,
      each run by the simulator as an eviction plan (on the fungible pool, copy-on-write),
      so the overhead is the simulator's: executed cost / baseline cost - 1.

    "optimal" when they meet; otherwise the gap is (overhead - bound) / overhead. Exit 1
    when no schedule fits (with the least budget the bound admits). Ctrl-C stops the
    solvers: the best found so far, labelled interrupted, exit 130."""
    from membudget.plan.optimum import CHECKMATE_MAX_VARIABLES, BudgetInfeasible
    from membudget.plan.optimum import optimum as solve
    from membudget.trace import load_trace

    nbytes = _budget(ratio, budget)
    _positive(time_limit, "--time-limit")
    if plan_out is not None:
        check_output(plan_out, [trace])
    try:
        with _no_result_at_ctrl_c():
            tr = load_trace(trace)
            with err.status(escape(f"optimum of {tr.name}")) as status:
                r = solve(tr, budget=nbytes, ratio=ratio, time_limit=time_limit,
                          progress=lambda m: status.update(escape(f"optimum of {tr.name}: "
                                                                  f"{m}")))
    except BudgetInfeasible as e:
        if as_json:
            print(json.dumps({"status": "infeasible", "budget_bytes": e.budget,
                              "min_budget_bytes": e.minimum, "message": str(e)}))
        else:
            _print_error(str(e))
        raise typer.Exit(1) from None
    if plan_out is not None and r.plan is not None:
        r.plan.save(plan_out)
    if as_json:
        print(json.dumps(r.to_json()))
    else:
        pct = lambda x: "—" if x is None else f"{100 * x:.2f}%"  # noqa: E731
        out.print(f"[bold]{escape(r.trace)}[/] · budget {format_bytes(r.budget_bytes)} "
                  f"(baseline peak {format_bytes(r.baseline_peak_bytes)})", markup=True)
        out.print(f"status       {r.status}" + (
            " (interrupted: the best found so far)" if r.interrupted
            else " (time limit reached)" if r.timed_out else ""))
        out.print(f"overhead     {pct(r.overhead)}  (best schedule: {r.best or 'none'})")
        skipped = ("; Checkmate's MILP not run: "
                   f"{r.checkmate_variables:,} variables, above {CHECKMATE_MAX_VARIABLES:,}"
                   if r.checkmate_variables > CHECKMATE_MAX_VARIABLES else "")
        out.print(f"lower bound  {pct(r.lower_bound)}  ("
                  + ", ".join(f"{k} {pct(v)}" for k, v in r.bounds.items()) + skipped + ")")
        out.print(f"gap          {pct(r.gap)}")
        out.print("schedules    " + ", ".join(
            f"{c.source} {pct(c.overhead) if c.overhead is not None else c.status}"
            for c in r.candidates))
        out.print(f"time         {r.seconds:.1f} s")
        if plan_out is not None and r.plan is not None:
            out.print(f"wrote        {plan_out}")
    if r.interrupted:
        raise typer.Exit(EXIT_CODE)
    if r.overhead is None:
        raise typer.Exit(1)


@app.command()
def layout(
    trace: TraceArgument,
    ratio: RatioOption = None,
    budget: BudgetOption = None,
    policy: Annotated[str, typer.Option(help="Policy whose schedule is laid out (its run "
                                             "on the fungible pool).")] = "dtr",
    time_limit: Annotated[float, typer.Option(help="Seconds for each packing.")] = 5.0,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="The lifetimes and "
                                                "their offsets as a MiniMalloc solution "
                                                "CSV; written only if they fit.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Planned tensor locations for a step that repeats: run POLICY on the fungible pool
    (no addresses), log every storage's lifetime (made, evicted, recomputed, freed) and
    pack them into an arena of the budget's bytes, checked by the independent validator.

    If they fit, every later step can run that schedule with each storage at its offset:
    the fungible pool's overhead on address-ordered memory, no fragmentation. If not, the
    run is repeated 1, 2 and 4 % below the budget. Exit 0 if a layout fits, else 1."""
    from membudget.plan.minimalloc_csv import write_csv
    from membudget.plan.run_layout import check_policy, lay_out
    from membudget.trace import load_trace

    nbytes = _budget(ratio, budget)
    _positive(time_limit, "--time-limit")
    check_policy(policy)
    if output is not None:
        check_output(output, [trace])
    with _no_result_at_ctrl_c():
        tr = load_trace(trace)
        with err.status(escape(f"laying out {tr.name}")) as status:
            lay = lay_out(tr, budget=nbytes, ratio=ratio, policy=policy, time_limit=time_limit,
                          progress=lambda m: status.update(escape(f"laying out {tr.name}: "
                                                                  f"{m}")))
    p, run = lay.packing, lay.run
    if output is not None and lay.fits:
        assert lay.problem is not None and p is not None
        write_csv(output, lay.problem.with_offsets(p.offsets))
    if as_json:
        print(json.dumps({
            "trace": tr.name, "budget_bytes": lay.budget, "run_budget_bytes": lay.run_budget,
            "status": run.status, "overhead": run.overhead if run.status == "ok" else None,
            "fits": lay.fits, "height": None if p is None else p.height,
            "max_load": None if p is None else p.max_load,
            "buffers": None if p is None else len(p.offsets),
            "method": None if p is None else p.method,
            "interrupted": p is not None and p.interrupted,
            "tried": [{"run_budget_bytes": b, "height": h} for b, h in lay.tried]}))
    else:
        out.print(f"[bold]{escape(tr.name)}[/] · budget {format_bytes(lay.budget)} · "
                  f"{escape(policy)} on the fungible pool", markup=True)
        for b, h in lay.tried:
            out.print(f"run at {format_bytes(b)}: " + (
                "did not complete" if h is None else
                f"packed in {format_bytes(h)} ({h / lay.budget:.2%} of the budget)"))
        if run.status != "ok":
            out.print(f"status    {run.status}: no schedule to lay out")
        else:
            out.print(f"overhead  {100 * run.overhead:.2f}% (run at "
                      f"{format_bytes(lay.run_budget)})")
        if p is not None:
            out.print(f"layout    {len(p.offsets):,} lifetimes, height {p.height:,} B, max "
                      f"load {p.max_load:,} B, by {p.method}"
                      + (" (interrupted: the best so far)" if p.interrupted else ""))
        out.print("fits the budget" if lay.fits else "does NOT fit the budget")
        if output is not None:
            err.print(f"wrote {output}" if lay.fits else
                      f"did not write {output}: no layout fits the budget")
    if p is not None and p.interrupted:
        raise typer.Exit(EXIT_CODE)
    if not lay.fits:
        raise typer.Exit(1)


@app.command()
def sweep(
    traces: Annotated[list[str], typer.Argument(help="Traces or DTR logs; a .zip stands for "
                                                     "all its logs.")],
    policies: Annotated[str, typer.Option(help="Comma-separated methods: policy[@allocator]"
                                               "[+inplace], or coop-no-partition, coop-cow, "
                                               "coop-no-window.")] =
        "dtr,dtr-eq,msps,lru,size",
    allocator: Annotated[str | None, typer.Option(help=ALLOCATOR_HELP)] = None,
    inplace: Annotated[str | None, typer.Option(help=INPLACE_HELP)] = None,
    swap: Annotated[str, typer.Option(help="Comma-separated swap modes, each method run "
                                           "under each: " + SWAP_HELP)] = "off",
    ratios: Annotated[str, typer.Option(help="Comma-separated budget ratios.")] =
        "0.9,0.7,0.5,0.4,0.3,0.2",
    semantics: Annotated[str, typer.Option(help="membudget or simrd.")] = "membudget",
    overhead_limit: Annotated[float, typer.Option(help="Thrash limit (× baseline cost).")] = 2.0,
    workers: Annotated[int, typer.Option(min=0, help="Processes (default: all "
                                                     "cores).")] = 0,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of overhead vs ratio.")] = None,
    min_budget: Annotated[bool, typer.Option("--min-budget", help="Also bisect each method's "
                                             "minimum and cutoff budget.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write all results as "
                                                                 "JSON.")] = None,
    batch: Annotated[int | None, typer.Option(help="Batch size of zoo models given by name "
                                              "(default: each paper's).")] = None,
    device_spec: Annotated[str, typer.Option(help="Device spec pricing the ops of zoo models "
                                             "given by name.")] = "a100-80gb",
) -> None:
    """Simulate several methods at several budget ratios on several traces. A zoo model's
    name stands for a fake capture of its training step, made on first use and cached."""
    from membudget.bench.report import limits_table, metrics_table, overhead_table
    from membudget.bench.sweep import limits as bisect
    from membudget.bench.sweep import sweep as run
    from membudget.sim.method import Method
    from membudget.trace import expand_sources

    methods = [Method.parse(m, allocator, inplace) for m in _names(policies, "--policies")]
    swaps = _names(swap, "--swap")
    ratio_list = _floats(ratios, "--ratios")
    limit = _limit(overhead_limit)
    if json_out:
        check_output(json_out, traces)
    if plot:
        check_output(plot, [*traces, *([json_out] if json_out else [])])
    sources = expand_sources(traces)
    if not all(Path(t).exists() or "::" in t for t in sources):
        from membudget.trace.capture import zoo_sources

        with _capture_progress("capturing zoo models") as progress:
            sources = zoo_sources(sources, batch, device_spec, progress)
    results = run(sources, methods, ratio_list, semantics=semantics, overhead_limit=limit,
                  workers=workers or None, console=err, swaps=swaps)
    out.print(overhead_table(results))
    out.print(metrics_table(results))
    found = []
    if min_budget:
        found = bisect(sources, methods, semantics=semantics, overhead_limit=limit,
                       workers=workers or None, console=err, swaps=swaps)
        out.print(limits_table(found))
    if json_out:
        write_text(json_out, json.dumps({"runs": [r.to_json() for r in results],
                                         "budget_limits": [b.to_json() for b in found]},
                                        indent=1))
        err.print(f"wrote {json_out}")
    if plot:
        from membudget.bench.plot import plot_overhead

        err.print(f"wrote {plot_overhead(results, plot)}")


@app.command()
def timeline(
    trace: Annotated[str, typer.Argument(help="A membudget trace or a DTR log.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="PNG to write.")],
    policy: Annotated[str, typer.Option(help=POLICY_HELP)] = "default",
    allocator: Annotated[str | None, typer.Option(help=ALLOCATOR_HELP + " A fungible pool "
                                                  "has no addresses: best-fit stands in.")]
        = None,
    inplace: Annotated[str | None, typer.Option(help=INPLACE_HELP)] = None,
    ratio: Annotated[float, typer.Option(help="Budget as a fraction of the unconstrained "
                                              "peak.")] = 0.5,
    snapshot: Annotated[Path | None, typer.Option(help="Also write PyTorch's memory-snapshot "
                                                       "pickle (open it at "
                                                       "pytorch.org/memory_viz).")] = None,
) -> None:
    """Draw the pool over time (address vs executed ops) for one simulated run."""
    from membudget.core.policies import make_policy
    from membudget.sim import simulate as run
    from membudget.sim.timeline import Recorder, plot_timeline, write_snapshot
    from membudget.trace import load_trace

    _positive(ratio, "--ratio")
    check_output(output, [trace])
    if snapshot:
        check_output(snapshot, [trace, output])

    if allocator is None and make_policy(policy).default_allocator == "fungible":
        allocator = "best-fit"
    recorders: list[Recorder] = []
    tr = load_trace(trace)
    result = run(tr, policy, ratio=ratio, allocator=allocator, inplace=inplace,
                 on_engine=lambda engine: recorders.append(Recorder(engine)))
    rec = recorders[0]
    title = (f"{result.trace}: {result.policy} on {result.allocator} at ratio {ratio:g} — "
             f"{result.status}, overhead {100 * result.overhead:.1f}%")
    err.print(f"wrote {plot_timeline(rec, output, title=title)}")
    if snapshot:
        err.print(f"wrote {write_snapshot(rec, snapshot)}")
    if result.status != "ok":
        err.print(f"the run ended {result.status}: {result.message}")
        raise typer.Exit(1)


@app.command("models")
def models_cmd() -> None:
    """List the zoo: each model's paper, parameter count and default (paper) batch size."""
    from rich.table import Table

    from membudget.models import get, names, param_count

    table = Table(title="membudget zoo (membudget trace MODEL to capture one training step)")
    for col in ("model", "params", "batch", "small batch", "paper", "what"):
        table.add_column(col, justify="right" if col in ("params", "batch", "small batch")
                         else "left")
    for name in names():
        e = get(name)
        table.add_row(name, f"{param_count(name) / 1e6:,.1f} M", str(e.batch),
                      str(e.small_batch), e.paper, e.description)
    out.print(table)


@app.command()
def trace(
    model: Annotated[str, typer.Argument(help="A zoo model (membudget models lists them).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Trace to write (.gz to "
                                                                 "compress).")],
    batch: Annotated[int | None, typer.Option(help="Batch size (default: the paper's).")]
        = None,
    device_spec: Annotated[str | None, typer.Option(help="Price each op on this device "
                                                    "(a100-80gb, a100-40gb, h100, rtx-2080ti, "
                                                    "titan-v, cpu); default: a100-80gb with "
                                                    "--fake, measured times live.")] = None,
    fake: Annotated[bool, typer.Option("--fake", help="Capture under FakeTensorMode: nothing "
                                       "is allocated, any size fits.")] = False,
    device: Annotated[str | None, typer.Option(help="Device of a live capture (default "
                                               "cpu).")] = None,
    optimizer: Annotated[str, typer.Option(help="Optimizer of a captured step: adamw (fused, "
                                           "one update after every gradient) or sgd (one "
                                           "update per parameter, as OLLA's "
                                           "benchmarks).")] = "adamw",
) -> None:
    """Record one training step (forward, backward, AdamW step) of a zoo model as a trace."""
    from membudget.trace.capture import capture_step

    check_output(output)
    with _capture_progress(f"{model} at batch {batch or 'paper'}") as progress:
        c = capture_step(model, batch, fake=fake, spec=device_spec, path=output,
                         device=device, optimizer=optimizer, progress=progress)
    out.print(f"wrote {c.ops:,} ops of {c.model} (batch {c.batch}, "
              f"{'fake' if c.fake else 'live'}, costs: {c.spec or 'measured'}) to {c.path}: "
              f"unconstrained peak {format_bytes(c.peak_bytes)}, "
              f"{c.param_count / 1e6:,.1f} M parameters, {c.seconds:.1f} s, "
              f"max RSS {format_bytes(c.max_rss_bytes)}")


@contextmanager
def _capture_progress(what: str) -> Iterator[Callable[[str, Any], None]]:
    """A spinner naming the step's phase and counting the ops recorded so far; yields the
    callback a capture reports its phases to."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    ops = _OpsColumn()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), ops, TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task(what)

        def tell(phase: str, session: Any) -> None:
            ops.session = session
            bar.update(task, description=f"{what}: {phase}")

        yield tell


class _OpsColumn(ProgressColumn):
    """The ops recorded so far by the session being captured (redrawn 10 times a second)."""

    session: Any = None

    def render(self, task: Task) -> Text:
        engine = getattr(self.session, "engine", None)
        return Text(f"{engine.stats.ops:,} ops" if engine is not None else "")


@app.command()
def plan(
    source: Annotated[str, typer.Argument(help="A trace, a DTR log, or a zoo model (captured "
                                               "under FakeTensorMode, cached).")],
    time_limit: Annotated[float, typer.Option(help="Seconds for the whole plan (half for the "
                                              "order, half for the offsets).")] = 30.0,
    solver: Annotated[str | None, typer.Option(help="Order solver: cpsat (default), highs or "
                                               "greedy.")] = None,
    batch: Annotated[int | None, typer.Option(help="Batch size of a zoo model (default: its "
                                              "paper's).")] = None,
    device_spec: Annotated[str, typer.Option(help="Device spec pricing a zoo model's "
                                             "ops.")] = "a100-80gb",
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the plan "
                                                "(order, offsets, figures) as JSON.")] = None,
    optimizer: Annotated[str, typer.Option(help="Optimizer of a captured step: adamw (fused, "
                                           "one update after every gradient) or sgd (one "
                                           "update per parameter, as OLLA's "
                                           "benchmarks).")] = "adamw",
    export_problem: Annotated[Path | None, typer.Option(
        help="Write the step's offset problem in the recorded order as a MiniMalloc CSV "
             "(id,lower,upper,size; half-open lifetimes) for `membudget pack`, and exit "
             "without planning.")] = None,
) -> None:
    """Plan one step statically (OLLA): reorder its operators and place every tensor in one
    arena; print the recorded-order peak, planned peak, arena, lower bound and solve times.
    Ctrl-C stops the search: the best plan so far, labelled interrupted, exit 130."""
    from rich.table import Table

    from membudget.plan.order import SOLVERS
    from membudget.plan.planner import plan_trace
    from membudget.trace import load_trace

    _positive(time_limit, "--time-limit")
    if solver is not None and solver not in SOLVERS:
        raise MembudgetError(f"unknown --solver {solver!r}; known: {', '.join(SOLVERS)}")
    for target in (output, export_problem):
        if target is not None:
            check_output(target, [source])
    path = source
    with _no_result_at_ctrl_c():
        if not (Path(source).exists() or "::" in source):
            from membudget.trace.capture import zoo_sources

            with _capture_progress(f"capturing {source}") as progress:
                path = zoo_sources([source], batch, device_spec, progress, optimizer)[0]
        trace = load_trace(path)
        if export_problem is not None:
            from membudget.plan.graph import from_trace
            from membudget.plan.minimalloc_csv import write_csv
            from membudget.plan.planner import location_problem

            problem = location_problem(from_trace(trace))
            write_csv(export_problem, problem)
            out.print(f"wrote {len(problem):,} buffers of {trace.name} (recorded order, max "
                      f"load {format_bytes(problem.max_load())}) to {export_problem}")
            return
        with err.status(escape(f"planning {trace.name} ({time_limit:g} s)")) as status:
            p = plan_trace(trace, time_limit, solver, progress=lambda stage: status.update(
                escape(f"planning {trace.name}: {stage}")))
    s = p.summary()
    table = Table(title=f"static plan of {trace.name} ({s['ops']:,} ops)" + (
        ", interrupted: the best plan found so far" if p.interrupted else ""))
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("vs recorded order", justify="right")
    table.add_column("how", justify="left")
    rec = p.recorded_peak

    def row(what: str, value: int | None, how: str) -> None:
        if value is not None:
            table.add_row(what, format_bytes(value), f"{value / rec - 1:+.1%}", how)

    row("recorded order (freed at last use)", rec, "the order PyTorch ran")
    row("caching allocator, recorded order", p.caching_peak, "reserved segments")
    row("lower bound", p.order.lower_bound, "largest single-op working set + leaves")
    row("planned order", p.order.peak,
        f"{p.order.solver} {p.order.status}, gap {p.order.gap:.2%}, {p.order.seconds:.1f} s")
    row("arena", p.arena, f"{p.packing.method}, {p.packing.seconds:.1f} s, fragmentation "
                          f"{p.fragmentation:.2%}"
                          + (", proven optimal" if p.packing.proven_optimal else ""))
    out.print(table)
    for m in s["messages"]:
        err.print(m)
    if output:
        write_text(output, json.dumps({**s, "order": p.order.order,
                                       "offsets": p.packing.offsets}, indent=1))
        err.print(f"wrote {output}")
    if p.interrupted:
        raise typer.Exit(EXIT_CODE)


@app.command()
def pack(
    problem: Annotated[Path, typer.Argument(help="A MiniMalloc CSV: id,lower,upper,size "
                                                 "(half-open lifetimes).")],
    capacity: Annotated[int | None, typer.Option(min=0, help="Arena bytes every buffer must "
                                                 "fit in (exit 1 if not); default: minimise "
                                                 "the height.")] = None,
    time_limit: Annotated[float, typer.Option(min=0, help="Seconds for the whole run, greedy "
                                              "packers included (honoured within about "
                                              "2 s).")] = 10.0,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Solution CSV (adds "
                                                "an offset column); with --capacity, "
                                                "written only if the packing fits.")] = None,
    write_unfit: Annotated[bool, typer.Option(help="With --capacity and -o: write the best "
                                              "packing even when it does not fit.")] = False,
) -> None:
    """Give every buffer of a MiniMalloc problem an offset; the packing is checked by the
    independent validator.

    What runs: buffers of size 0 go at offset 0 and buffers live throughout are stacked
    at the bottom. Then greedy packers (13 orders and fit rules, the first always, the
    others within a quarter of the time limit, until one reaches the max-load bound) pack
    the rest, and the problem is split
    into independent parts at the times no buffer crosses. Each part above the max-load
    bound (or the capacity) is searched with the time left: up to 1,000 buffers by CP-SAT
    racing a canonical search (MiniMalloc's, by restarts and by discrepancies), which can
    prove a height optimal; above that by windowed CP-SAT, which re-packs the top of the
    packing window by window and proves nothing. Ctrl-C stops the search: the best packing
    so far is printed and written, labelled interrupted, exit 130.
    """
    from membudget.plan.pack import pack_file

    _positive(time_limit, "--time-limit")
    _positive(capacity, "--capacity")
    if output is not None:
        check_output(output, [problem])
    with _no_result_at_ctrl_c(), err.status(escape(f"packing {problem}")) as status:
        result, code = pack_file(problem, capacity=capacity, time_limit=time_limit,
                                 out=output, write_unfit=write_unfit,
                                 progress=lambda m: status.update(
                                     escape(f"packing {problem}: {m}")))
    fits = "" if capacity is None else (f", fits {capacity:,}" if result.fits else
                                        f", does NOT fit {capacity:,}")
    proof = "proven optimal" if result.proven_optimal else f"gap {result.gap:.3%}"
    out.print(f"height {result.height:,} (lower bound {result.lower_bound:,}{fits}; {proof}) "
              f"by {result.method} in {result.seconds:.1f} s"
              + (" (interrupted: the best packing so far)" if result.interrupted else ""))
    err.print(result.message)
    if output and (result.fits or write_unfit):
        err.print(f"wrote {output}" + ("" if result.fits else
                                       f" (does NOT fit capacity {capacity:,})"))
    elif output:
        err.print(f"did not write {output}: the packing does not fit the capacity "
                  "(--write-unfit writes it anyway)")
    raise typer.Exit(code)


@app.command()
def demo(
    ratio: Annotated[float, typer.Option(help="Budget as a fraction of the unconstrained "
                                              "peak.")] = 0.4,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 5,
    policy: Annotated[str, typer.Option(help="Eviction policy.")] = "dtr",
) -> None:
    """Train a small GPT-2 under a budget beside an unconstrained run and compare them."""
    from membudget.core.policies import make_policy
    from membudget.demo import demo_table, run_demo

    make_policy(policy)  # an unknown one is refused before any work
    _positive(ratio, "--ratio")
    if steps < 1:
        raise MembudgetError(f"--steps must be at least 1, got {steps}")
    err.print(f"[bold]membudget demo[/]: a GPT-2 config from transformers (random init, no "
              f"download), {steps} AdamW steps, once without a budget and once under "
              f"{ratio:g} × its peak with {escape(policy)}", markup=True)
    plain, limited, budget = run_demo(ratio, steps, policy, console=err)
    out.print(demo_table(plain, limited, budget, policy, ratio))
    worst = max(r.peak_bytes for r in limited)
    slow = sum(r.seconds for r in limited) / sum(r.seconds for r in plain)
    same = all(a.loss == b.loss for a, b in zip(plain, limited, strict=True))
    out.print(f"peak {format_bytes(worst)} within the budget of {format_bytes(budget)}: "
              f"{'yes' if worst <= budget else 'NO'}; losses identical: "
              f"{'yes' if same else 'NO'}; wall time {slow:.2f}× the unconstrained run")
    if worst > budget or not same:
        raise typer.Exit(1)


# typer's usage error (its own click's, in recent typer): the base of typer.BadParameter
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def main() -> None:
    """Entry point: a bad option or a membudget error becomes one clear line on stderr and
    exit status 2 (Ctrl-C outside a solve: typer exits with 130)."""
    try:
        code = app(standalone_mode=False)
    except _UsageError as e:  # an option typer could not parse, or out of its range
        message = e.format_message().strip()
        if not message:  # no arguments: typer has printed the help
            sys.exit(2)
        ctx = getattr(e, "ctx", None)
        _error(message + (f" (see {ctx.command_path} --help)" if ctx is not None else ""))
    except MembudgetError as e:
        _error(str(e))
    sys.exit(code if isinstance(code, int) else 0)


def _error(message: str) -> None:
    """Print ``message`` as an error and exit with status 2."""
    _print_error(message)
    sys.exit(2)


def _print_error(message: str) -> None:
    """Print ``message`` on stderr as one ``error:`` line, however long."""
    err.print(f"[red]error:[/] {escape(' '.join(message.split()))}", markup=True,
              highlight=False, soft_wrap=True)


if __name__ == "__main__":
    main()
