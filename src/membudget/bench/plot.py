"""Plots of sweep results: overhead against budget ratio, one line per policy, a panel a trace."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from membudget.sim.simulate import SimResult


def plot_overhead(results: Sequence[SimResult], path: str | Path, title: str = "") -> Path:
    """Draw slowdown (executed / baseline cost) against budget ratio; a failed run is an x
    on the top edge of its panel. Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in results))
    policies = list(dict.fromkeys(r.method for r in results))
    cols = min(4, len(traces))
    rows = math.ceil(len(traces) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.8 * rows + 0.9), squeeze=False)
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
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(policies), frameon=False)
    fig.suptitle(title or "overhead vs budget (x above the curves: failed — OOM or over the "
                          "overhead limit)")
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
