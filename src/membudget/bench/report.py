"""Tables of sweep results: for the terminal (rich) and for docs (markdown)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from membudget.sim.simulate import SimResult


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
        rows.setdefault((r.trace, r.policy), {})[r.ratio] = r
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
