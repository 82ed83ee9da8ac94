"""Tables of sweep results: for the terminal (rich) and for docs (markdown)."""

from __future__ import annotations

import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from membudget.sim.budgets import BudgetLimits
from membudget.sim.simulate import SimResult


def git_state(root: Path) -> str:
    """Which code a benchmark ran: the commit of the repository at ``root``, and whether its
    ``src/`` had uncommitted changes (results files record it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root,
                               text=True, capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return f"commit {head}" + (" with uncommitted changes under src/" if dirty else "")


def cell(r: SimResult) -> str:
    """Overhead in percent for a completed run; otherwise the reason it did not complete."""
    if r.status == "ok":
        return f"{100 * r.overhead:.1f}%"
    return "OOM" if r.status == "oom" else "thrash"


def _grid(results: Sequence[SimResult]) -> tuple[list[float], dict[tuple[str, str],
                                                                      dict[float, SimResult]]]:
    ratios = sorted({r.ratio for r in results if r.ratio is not None}, reverse=True)
    rows: dict[tuple[str, str], dict[float, SimResult]] = {}
    for r in results:
        rows.setdefault((r.trace, r.method), {})[r.ratio] = r
    return ratios, rows


def overhead_table(results: Sequence[SimResult], title: str = "") -> Table:
    """Rows (trace, policy), one column per budget ratio: compute overhead or failure."""
    ratios, rows = _grid(results)
    table = Table(title=title or "compute overhead by budget ratio (OOM: no room; thrash: "
                                 "over the overhead limit)")
    table.add_column("trace")
    table.add_column("policy")
    for q in ratios:
        table.add_column(f"{q:g}", justify="right")
    for (trace, policy), by_ratio in rows.items():
        table.add_row(trace, policy, *(cell(by_ratio[q]) if q in by_ratio else "" for q in
                                       ratios))
    return table


def overhead_markdown(results: Sequence[SimResult]) -> str:
    """The same table as markdown."""
    ratios, rows = _grid(results)
    head = "| trace | policy | " + " | ".join(f"{q:g}" for q in ratios) + " |"
    sep = "|---|---|" + "---:|" * len(ratios)
    lines = [head, sep]
    for (trace, policy), by_ratio in rows.items():
        cells = (cell(by_ratio[q]) if q in by_ratio else "" for q in ratios)
        lines.append(f"| {trace} | {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def metric_rows(results: Sequence[SimResult]) -> list[tuple[str, str, str, str, str, str]]:
    """Per (trace, method), over its runs that had failed allocations: mean and max
    fragmentation, median p50 and worst p99 search latency, and the runs completed."""
    groups: dict[tuple[str, str], list[SimResult]] = {}
    for r in results:
        groups.setdefault((r.trace, r.method), []).append(r)
    rows = []
    for (trace, method), runs in groups.items():
        searched = [r for r in runs if r.fragmentation["count"]]
        frag_mean = _median([r.fragmentation["mean"] for r in searched])
        frag_max = max((r.fragmentation["max"] for r in searched), default=0.0)
        p50 = _median([r.search_us["p50"] for r in searched])
        p99 = max((r.search_us["p99"] for r in searched), default=0.0)
        done = sum(r.status == "ok" for r in runs)
        rows.append((trace, method, f"{100 * frag_mean:.1f}%", f"{100 * frag_max:.1f}%",
                     f"{p50:.1f} / {p99:.0f}", f"{done}/{len(runs)}"))
    return rows


METRIC_HEAD = ("trace", "method", "frag. mean", "frag. max", "search p50 / p99 µs",
               "completed")


def metrics_table(results: Sequence[SimResult], title: str = "") -> Table:
    """Fragmentation and search latency per (trace, method)."""
    table = Table(title=title or "fragmentation (free / pool bytes at failed allocations; "
                                 "median over runs of the mean, and max) and search latency")
    for i, h in enumerate(METRIC_HEAD):
        table.add_column(h, justify="right" if i > 1 else "left")
    for row in metric_rows(results):
        table.add_row(*row)
    return table


def metrics_markdown(results: Sequence[SimResult]) -> str:
    lines = ["| " + " | ".join(METRIC_HEAD) + " |", "|---|---|" + "---:|" * 4]
    lines += ["| " + " | ".join(row) + " |" for row in metric_rows(results)]
    return "\n".join(lines)


def _limit_cell(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def limits_table(found: Sequence[BudgetLimits], title: str = "") -> Table:
    """Minimum budget (smallest ratio that completes) and cutoff (largest with an eviction)."""
    table = Table(title=title or "minimum and cutoff budget ratio (bisection)")
    for h in ("trace", "method", "minimum", "cutoff", "runs"):
        table.add_column(h, justify="left" if h in ("trace", "method") else "right")
    for b in found:
        table.add_row(b.trace, b.method, _limit_cell(b.minimum), _limit_cell(b.cutoff),
                      str(b.runs))
    return table


def limits_markdown(found: Sequence[BudgetLimits]) -> str:
    lines = ["| trace | method | minimum | cutoff |", "|---|---|---:|---:|"]
    lines += [f"| {b.trace} | {b.method} | {_limit_cell(b.minimum)} | {_limit_cell(b.cutoff)} |"
              for b in found]
    return "\n".join(lines)


def _median_or_none(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def summary_markdown(results: Sequence[SimResult], found: Sequence[BudgetLimits],
                     methods: Sequence[str], ratios: Sequence[float] = (0.5, 0.3)) -> str:
    """One row per method: runs completed; median overhead at each of ``ratios`` over the
    traces where it completed; median per-run search p50 and mean fragmentation over the
    runs with failed allocations; median minimum ratio over the traces that have one."""
    head = ["method", "completed"]
    head += [f"overhead @ {q:g} (traces)" for q in ratios]
    head += ["search p50 µs", "frag. mean"]
    if found:
        head.append("minimum ratio (traces)")
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in methods:
        runs = [r for r in results if r.method == m]
        row = [m, f"{sum(r.status == 'ok' for r in runs)}/{len(runs)}"]
        for q in ratios:
            at = [r for r in runs if r.ratio == q]
            ok = [r.overhead for r in at if r.status == "ok"]
            row.append(f"{_pct(_median_or_none(ok))} ({len(ok)}/{len(at)})" if at else "—")
        p50 = _median_or_none([r.search_us["p50"] for r in runs if r.search_us["count"]])
        row.append("—" if p50 is None else f"{p50:.1f}")
        frag = [r.fragmentation["mean"] for r in runs if r.fragmentation["count"]]
        row.append(_pct(_median_or_none(frag)))
        if found:
            mins = [b.minimum for b in found if b.method == m and b.minimum is not None]
            total = sum(b.method == m for b in found)
            low = _median_or_none(mins)
            row.append(f"{'—' if low is None else f'{low:.2f}'} ({len(mins)}/{total})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
