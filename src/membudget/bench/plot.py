"""Plots of sweep results: overhead against budget ratio (one line per method, a panel a
trace), fragmentation at failed allocations, and eviction-search latency."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from membudget.outputs import replacing
from membudget.sim.simulate import SimResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` whole or not at all (PNG unless its suffix names a format)."""
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix[1:] or "png")
    plt.close(fig)
    return path


def _legend_layout(entries: int, width: float) -> tuple[int, float]:
    """Columns and height (inches) of a legend of ``entries`` under a ``width``-inch figure."""
    ncol = max(1, min(entries, int(width // 2.0)))
    return ncol, 0.3 * math.ceil(entries / ncol) + 0.15


def _legend_below(fig: Any, ax: Any, ncol: int, height: float) -> float:
    """Put ``ax``'s legend under the figure; return the figure fraction it takes."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False, fontsize=9)
    return height / fig.get_figheight()


def plot_overhead(results: Sequence[SimResult], path: str | Path, title: str = "") -> Path:
    """Draw slowdown (executed / baseline cost) against budget ratio; a failed run is an x
    on the top edge of its panel. Returns the path written."""
    plt = _pyplot()
    traces = list(dict.fromkeys(r.trace for r in results))
    policies = list(dict.fromkeys(r.method for r in results))
    cols = min(4, len(traces))
    rows = math.ceil(len(traces) / cols)
    ncol, legend_h = _legend_layout(len(policies), 4.4 * cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.8 * rows + 0.5 + legend_h),
                             squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, trace in zip(axes.flat, traces, strict=False):
        top = 1.0
        for k, policy in enumerate(policies):
            runs = sorted((r for r in results if r.trace == trace and r.method == policy),
                          key=lambda r: r.ratio or 0)
            ok = [r for r in runs if r.status == "ok"]
            top = max([top, *(1 + r.overhead for r in ok)])
            ax.plot([r.ratio for r in ok], [1 + r.overhead for r in ok], marker="o", ms=3,
                    color=colors(k % 10), label=policy)
        # Failed runs: one row of x marks per policy above the curves.
        step = (top - 1) * 0.06 + 0.01
        ymax = top + step * (len(policies) + 1)
        for k, policy in enumerate(policies):
            failed = [r.ratio for r in results
                      if r.trace == trace and r.method == policy and r.status != "ok"]
            ax.plot(failed, [top + step * (k + 1)] * len(failed), "x", ms=4,
                    color=colors(k % 10))
        ax.set_title(trace, fontsize=10)
        ax.set_xlabel("budget ratio")
        ax.set_ylabel("slowdown (× baseline cost)")
        ax.set_ylim(0.98, ymax)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(traces):]:
        ax.axis("off")
    bottom = _legend_below(fig, axes.flat[0], ncol, legend_h)
    fig.suptitle(title or "overhead vs budget (x above the curves: failed — OOM or over the "
                          "overhead limit)")
    fig.tight_layout(rect=(0, bottom, 1, 1 - 0.4 / fig.get_figheight()))
    return _save(fig, path)


def plot_fragmentation(results: Sequence[SimResult], path: str | Path, title: str = "") -> Path:
    """Grouped bars, a group per trace and a bar per method: the median over the runs with
    failed allocations of the mean fragmentation (free / pool bytes), with a thin mark up to
    the max over those runs. A method with no such run has no bar. Returns the path written."""
    plt = _pyplot()
    traces = list(dict.fromkeys(r.trace for r in results))
    methods = list(dict.fromkeys(r.method for r in results))
    colors = plt.get_cmap("tab10")
    width = 0.8 / max(1, len(methods))
    width_in = max(6.0, 1.5 * len(traces) + 1.5)
    ncol, legend_h = _legend_layout(len(methods), width_in)
    fig, ax = plt.subplots(figsize=(width_in, 4.2 + legend_h))
    for k, method in enumerate(methods):
        xs, heights, tops = [], [], []
        for i, trace in enumerate(traces):
            runs = [r for r in results if r.trace == trace and r.method == method
                    and r.fragmentation["count"] > 0]
            if runs:
                xs.append(i - 0.4 + width * (k + 0.5))
                heights.append(100 * statistics.median(r.fragmentation["mean"] for r in runs))
                tops.append(100 * max(r.fragmentation["max"] for r in runs))
        ax.bar(xs, heights, width, color=colors(k % 10), label=method)
        above = [t - h for t, h in zip(tops, heights, strict=True)]
        ax.errorbar(xs, heights, yerr=[[0.0] * len(xs), above], fmt="none", ecolor="black",
                    elinewidth=0.6, capsize=1.5)
    ax.set_xticks(range(len(traces)), traces, rotation=20, ha="right", fontsize=9)
    ax.set_ylabel("% of pool free at failed allocations")
    ax.set_ylim(0, None)
    ax.grid(axis="y", alpha=0.3)
    bottom = _legend_below(fig, ax, ncol, legend_h)
    ax.set_title(title or "fragmentation: median over runs of the mean (bar), max (mark)",
                 fontsize=10)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return _save(fig, path)


def plot_search_latency(results: Sequence[SimResult], path: str | Path,
                        title: str = "") -> Path:
    """Per method, a box plot (log scale) of the per-run p50 eviction-search latency over the
    runs with failed allocations, with the median per-run p99 as a triangle. Returns the path
    written."""
    plt = _pyplot()
    methods = list(dict.fromkeys(r.method for r in results))
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(methods) + 1.5), 4.2))
    label = "median p99"  # on the first triangle drawn only
    for k, method in enumerate(methods):
        runs = [r for r in results if r.method == method and r.search_us["count"] > 0]
        p50 = [max(r.search_us["p50"], 1e-3) for r in runs]  # log axis: keep zeros visible
        if not p50:
            continue
        box = ax.boxplot([p50], positions=[k], widths=0.6, patch_artist=True,
                         flierprops={"markersize": 2}, medianprops={"color": "black"})
        box["boxes"][0].set(facecolor=colors(k % 10), alpha=0.7)
        ax.plot([k], [statistics.median(r.search_us["p99"] for r in runs)], "^", ms=5,
                color="black", label=label)
        label = "_nolegend_"
    ax.set_xticks(range(len(methods)), methods, rotation=20, ha="right", fontsize=9)
    ax.set_xlim(-0.6, len(methods) - 0.4)
    ax.set_yscale("log")
    ax.set_ylabel("search latency per failed allocation (µs)")
    ax.grid(axis="y", which="both", alpha=0.3)
    if label != "median p99":
        ax.legend(fontsize=8, frameon=False)
    ax.set_title(title or "eviction search latency: per-run p50 (box), median p99 (▲)",
                 fontsize=10)
    fig.tight_layout()
    return _save(fig, path)
