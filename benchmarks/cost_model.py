"""How good the roofline cost model (``membudget.cost``) is, in two checks.

(a) **Coop's Table 1.** Cost density (predicted time per MB of output, MB = 2^20 B) of forward
    fp32 ops on the ``rtx-2080ti`` spec, at ResNet-50 (batch 64) and BERT-Large (batch 8,
    seq 512) shapes, priced on meta tensors, against the paper's ranges (conv and matmul
    ≈ 33–89 µs/MB, layer and batch norm ≈ 4–5, ReLU and GELU ≈ 3.9).
(b) **Calibration on this CPU.** Small zoo models run one training step (forward + backward)
    under a dispatch mode that times every aten op with ``perf_counter_ns`` and predicts it
    with the measured ``cpu`` spec. The step runs once to warm up and then ``--repeats`` times;
    each op's measured time is its median over the repeats (the op sequence is the same every
    step). Reported: Spearman rank correlation of predicted vs measured per model and overall,
    and the median ratio predicted / measured per op class, plus a log-log scatter plot.

Run: python benchmarks/cost_model.py [--models resnet-50,gpt2,bilstm,alexnet] [--repeats 3]
     [--threads 1] [--out docs/results/cost-model.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from membudget.bench.report import git_state
from membudget.cost import CostModel, DeviceSpec, get_spec, known_specs, op_plan
from membudget.cost.devices import CPU, measure_cpu
from membudget.cost.model import FREE
from membudget.cost.reference import CASES, density
from membudget.models import build, get

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "results" / "cost-model.md"
DEFAULT_MODELS = "resnet-50,gpt2,bilstm,alexnet"
aten = torch.ops.aten

MATMUL = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
CONV = {aten.convolution, aten._convolution, aten.convolution_backward}
NORM = {aten.native_layer_norm, aten.native_layer_norm_backward, aten.native_batch_norm,
        aten.native_batch_norm_backward, aten._native_batch_norm_legit,
        aten._native_batch_norm_legit_no_training}
CLASSES = ("matmul", "conv", "attention", "norm", "pointwise", "reduction", "other memory",
           "view (free)")


def log(msg: str) -> None:
    print(msg, flush=True)


def op_class(func: torch._ops.OpOverload) -> str:
    """A coarse class for reporting: what kind of kernel the op runs."""
    packet = func._overloadpacket
    if op_plan(func).kind == FREE:
        return "view (free)"
    if packet in MATMUL:
        return "matmul"
    if packet in CONV:
        return "conv"
    if "attention" in packet.__name__:
        return "attention"
    if packet in NORM:
        return "norm"
    if torch.Tag.pointwise in func.tags:
        return "pointwise"
    if torch.Tag.reduction in func.tags or "softmax" in packet.__name__:
        return "reduction"
    return "other memory"


# ------------------------------------------------------------------------- (a) Table 1
def table1(spec: str) -> tuple[list[str], int, int]:
    """Markdown rows of Coop's Table 1 reproduction, and (canonical within ×2, canonical)."""
    model = CostModel(spec)
    lines = ["| op | model | shape | predicted µs | output MB | µs/MB | paper µs/MB | within ×2 |",
             "|---|---|---|---:|---:|---:|---|---|"]
    hits = total = 0
    for case in CASES:
        d = density(case, model)
        lo, hi = case.paper
        paper = f"{lo:g}" if lo == hi else f"{lo:g}–{hi:g}"
        mark = " (row's shape)" if case.canonical else ""
        lines.append(f"| {case.op}{mark} | {case.model} | {case.shape} | {d.seconds * 1e6:,.0f} "
                     f"| {d.out_mb:,.1f} | {d.us_per_mb:.1f} | {paper} | "
                     f"{'yes' if d.within_2x else 'no'} |")
        log(f"  {case.op:10s} {case.shape:55s} {d.us_per_mb:7.1f} µs/MB "
            f"(paper {paper}) {'ok' if d.within_2x else 'OUT'}")
        if case.canonical:
            total += 1
            hits += d.within_2x
    return lines, hits, total


# ------------------------------------------------------------------ (b) CPU calibration
class TimingMode(TorchDispatchMode):
    """Times every aten op (only the op itself) and predicts it with ``model``, and with
    ``model`` without its element rates (the ablation)."""

    def __init__(self, model: CostModel) -> None:
        super().__init__()
        self.model = model
        self.plain = CostModel(dataclasses.replace(model.spec, math_rates={}))
        self.ops: list[tuple[torch._ops.OpOverload, float, float, float]] = []

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        t0 = time.perf_counter_ns()
        out = func(*args, **kwargs)
        measured = (time.perf_counter_ns() - t0) * 1e-9
        self.ops.append((func, self.model.op_seconds(func, args, kwargs, out), measured,
                         self.plain.op_seconds(func, args, kwargs, out)))
        return out


@dataclass
class OpSample:
    model: str
    func: torch._ops.OpOverload
    cls: str
    predicted: float
    measured: float
    plain: float  # predicted without the spec's element rates


def calibrate(name: str, model: CostModel, repeats: int) -> tuple[list[OpSample], int]:
    """One warm-up step then ``repeats`` timed steps of zoo model ``name`` at its small batch;
    each op's measured time is the median over the timed steps."""
    entry = get(name)
    net, batch, loss = build(name, entry.small_batch)
    runs = []
    for _ in range(repeats + 1):
        net.zero_grad(set_to_none=True)
        mode = TimingMode(model)
        with mode:
            loss(net, batch).backward()
        runs.append(mode.ops)
    runs = runs[1:]
    first = runs[0]
    if any([op[0] for op in r] != [op[0] for op in first] for r in runs):
        raise RuntimeError(f"{name}: the op sequence changed between steps")
    samples = [OpSample(name, func, op_class(func), pred,
                        statistics.median(r[i][2] for r in runs), plain)
               for i, (func, pred, _, plain) in enumerate(first)]
    return samples, entry.small_batch


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks of ``x`` from 0, ties sharing their average rank (as Spearman's rho takes them)."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return (first + (counts - 1) / 2)[inverse]


def rho(samples: Sequence[OpSample]) -> float:
    """Spearman's rank correlation of predicted and measured times."""
    if len(samples) < 3:
        return float("nan")
    a = _ranks(np.array([s.predicted for s in samples]))
    b = _ranks(np.array([s.measured for s in samples]))
    return float(np.corrcoef(a, b)[0, 1])


def kernels(samples: Sequence[OpSample]) -> list[OpSample]:
    return [s for s in samples if s.predicted > 0]


def median_ratio(samples: Sequence[OpSample]) -> float:
    return statistics.median(s.predicted / s.measured for s in samples) if samples else float("nan")


def calibration_markdown(per_model: dict[str, tuple[list[OpSample], int]],
                         spec: DeviceSpec) -> list[str]:
    everything = [s for samples, _ in per_model.values() for s in samples]
    lines = [
        "| model | batch | aten ops | kernel ops | measured ms (sum of op medians) | "
        "predicted ms | predicted / measured | Spearman ρ, kernel ops | Spearman ρ, all ops |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, (samples, batch) in per_model.items():
        k = kernels(samples)
        meas = sum(s.measured for s in samples) * 1e3
        pred = sum(s.predicted for s in samples) * 1e3
        lines.append(f"| {name} | {batch} | {len(samples):,} | {len(k):,} | {meas:,.1f} | "
                     f"{pred:,.1f} | {pred / meas:.2f} | {rho(k):.3f} | {rho(samples):.3f} |")
    k = kernels(everything)
    meas = sum(s.measured for s in everything) * 1e3
    pred = sum(s.predicted for s in everything) * 1e3
    lines.append(f"| **all** | | {len(everything):,} | {len(k):,} | {meas:,.1f} | {pred:,.1f} | "
                 f"{pred / meas:.2f} | **{rho(k):.3f}** | **{rho(everything):.3f}** |")
    mean_rho = statistics.mean(rho(kernels(samples)) for samples, _ in per_model.values())
    lines += ["", "The pooled ρ weighs every op equally, so the model with the most ops "
              "(many small, similar ones, whose ranks are mostly timing noise) dominates it; the "
              f"mean of the per-model ρ over kernel ops is {mean_rho:.3f}."]
    rated = [s for s in everything if s.plain != s.predicted]
    if rated:
        def bytes_only(xs: list[OpSample]) -> list[OpSample]:
            return [dataclasses.replace(s, predicted=s.plain) for s in xs]

        lines += ["", "Ablation, on the same measurements: without the element rates (those "
                  f"ops timed by their bytes) the {len(rated):,} ops they price are predicted at "
                  f"a median {median_ratio(bytes_only(rated)):.2f}× their measured time, "
                  f"against {median_ratio(rated):.2f}× with them; pooled ρ over kernel ops "
                  f"{rho(bytes_only(k)):.3f}, against {rho(k):.3f}."]
    lines += ["", "Per op class, all models together (ratio = predicted / measured; a view's "
              "prediction is 0, so its row shows measured times only):", "",
              "| op class | ops | measured ms | predicted ms | median ratio | ratio p10–p90 | "
              "Spearman ρ | median measured µs |",
              "|---|---:|---:|---:|---:|---|---:|---:|"]
    by_class: dict[str, list[OpSample]] = defaultdict(list)
    for s in everything:
        by_class[s.cls].append(s)
    for cls in CLASSES:
        xs = by_class.get(cls, [])
        if not xs:
            continue
        meas_us = statistics.median(s.measured for s in xs) * 1e6
        if cls == "view (free)":
            lines.append(f"| {cls} | {len(xs):,} | {sum(s.measured for s in xs) * 1e3:,.1f} | "
                         f"0 | — | — | — | {meas_us:.1f} |")
            continue
        ratios = sorted(s.predicted / s.measured for s in xs)
        p10, p90 = ratios[len(ratios) // 10], ratios[(len(ratios) * 9) // 10]
        lines.append(
            f"| {cls} | {len(xs):,} | {sum(s.measured for s in xs) * 1e3:,.1f} | "
            f"{sum(s.predicted for s in xs) * 1e3:,.1f} | {median_ratio(xs):.2f} | "
            f"{p10:.2f}–{p90:.2f} | {rho(xs):.3f} | {meas_us:.1f} |")
    tiny = sum(s.measured < 3 * spec.launch_overhead for s in k)
    lines += ["", f"Launch overhead of the cpu spec: {spec.launch_overhead * 1e6:.2f} µs; "
              f"ops whose measured time is within 3× of it: {tiny:,} of {len(k):,} kernel ops."]
    return lines


def plot(per_model: dict[str, tuple[list[OpSample], int]], path: Path) -> None:
    """Log-log scatter of predicted vs measured op times, one panel per model."""
    names = list(per_model)
    cols = min(2, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 5 * rows), squeeze=False)
    colors = dict(zip(CLASSES, plt.get_cmap("tab10").colors, strict=False))
    for ax, name in zip(axes.flat, names, strict=False):
        k = kernels(per_model[name][0])
        for cls in CLASSES:
            xs = [s for s in k if s.cls == cls]
            if xs:
                ax.scatter([s.measured * 1e6 for s in xs], [s.predicted * 1e6 for s in xs],
                           s=8, alpha=0.6, color=colors[cls], label=f"{cls} ({len(xs)})")
        lo = min(min(s.measured, s.predicted) for s in k) * 1e6
        hi = max(max(s.measured, s.predicted) for s in k) * 1e6
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
        ax.set(xscale="log", yscale="log", xlabel="measured µs", ylabel="predicted µs",
               title=f"{name}: Spearman ρ = {rho(k):.2f}")
        ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle("Cost model on this CPU: each point is one aten op of one training step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- report
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def spec_markdown(cpu: DeviceSpec) -> list[str]:
    """The spec table; ``cpu`` is the measurement the calibration used."""
    lines = ["| spec | fp32 TFLOP/s | TF32 | FP16 | BF16 | FP64 | bandwidth GB/s | launch µs | "
             "FLOP/s eff. | bandwidth eff. |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def tf(x: float | None) -> str:
        return "—" if x is None else f"{x / 1e12:,.3g}"

    specs = [cpu if name == CPU else get_spec(name) for name in known_specs()]
    for s in specs:
        lines.append(f"| {s.name} | {tf(s.fp32_flops)} | {tf(s.tf32_flops)} | {tf(s.fp16_flops)} "
                     f"| {tf(s.bf16_flops)} | {tf(s.fp64_flops)} | {s.bandwidth / 1e9:,.1f} | "
                     f"{s.launch_overhead * 1e6:.2f} | {s.flops_efficiency:g} | "
                     f"{s.bandwidth_efficiency:g} |")
    lines += ["", "Sources:", ""]
    lines += [f"- `{s.name}`: {s.source}" for s in specs]
    rated = [s for s in specs if s.math_rates]
    for s in rated:
        lines += ["", f"Element rates of `{s.name}` (ops whose arithmetic, not their bytes, "
                  "bounds them; G elements/s, fp32): " + ", ".join(
                      f"{name} {rate / 1e9:.2f}" for name, rate in s.math_rates.items())]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS,
                    help=f"comma-separated zoo models (default {DEFAULT_MODELS})")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per model (default 3)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine a second "
                         "thread makes every parallel op wait for a descheduled thread)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"report (default {DEFAULT_OUT})")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    out = Path(args.out)
    png = out.with_name(out.stem + "-cpu.png")

    log("(a) Coop Table 1 on rtx-2080ti")
    t1_lines, hits, total = table1("rtx-2080ti")

    log(f"(b) calibration on the cpu spec ({args.threads} thread(s)), measured afresh")
    cpu = measure_cpu()
    model = CostModel(cpu)
    per_model: dict[str, tuple[list[OpSample], int]] = {}
    for name in (m.strip() for m in args.models.split(",") if m.strip()):
        t0 = time.perf_counter()
        per_model[name] = calibrate(name, model, args.repeats)
        k = kernels(per_model[name][0])
        log(f"  {name}: {len(per_model[name][0])} ops, Spearman ρ {rho(k):.3f} (kernel ops), "
            f"{time.perf_counter() - t0:.0f} s")
    cal_lines = calibration_markdown(per_model, cpu)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(per_model, png)
    wall = time.perf_counter() - t_start

    cmd = "python benchmarks/cost_model.py"
    if args.models != DEFAULT_MODELS:
        cmd += f" --models {args.models}"
    if args.repeats != 3:
        cmd += f" --repeats {args.repeats}"
    if args.threads != 1:
        cmd += f" --threads {args.threads}"
    lines = [
        "# Cost model: Coop's Table 1 and a CPU calibration", "",
        f"Produced by `{cmd}` on {datetime.date.today().isoformat()}: {cpu_name()}, "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} thread(s)), Python {platform.python_version()}, membudget "
        f"{git_state(ROOT)}. Wall time {wall:.0f} s. The machine is shared with other jobs, so "
        "measured times are noisy; ranks and medians are what to read.", "",
        "The model (`membudget.cost`): time = launch overhead + max(FLOPs / (peak matmul FLOP/s "
        "of the op's dtype × FLOP/s efficiency), bytes read and written / (bandwidth × "
        "bandwidth efficiency)). FLOPs come from `torch.utils.flop_counter` (matmuls, "
        "convolutions, attention); every other op is timed by its bytes, except that a spec "
        "with measured element rates (the `cpu` spec: tanh, exp, softmax, layer norm, ...) "
        "takes the larger of the bytes' time and output elements / the op's rate; views, in-place "
        "metadata changes, shape queries and bare allocations cost 0. fp32 follows PyTorch's "
        "CUDA defaults: convolutions in TF32 (`torch.backends.cudnn.allow_tf32`), matmuls in "
        "full fp32 (`torch.backends.cuda.matmul.allow_tf32` is off).", "",
        "## Device specs", "", *spec_markdown(cpu), "",
        "## (a) Coop Table 1 on `rtx-2080ti`", "",
        "Cost density = predicted time of the op's aten ops / output size (MB = 2^20 B), forward, "
        "fp32, priced on meta tensors. \"Within ×2\" means between half the paper's low end and "
        "twice its high end. The paper gives one number per op type; density grows with the "
        "reduction length K of a matmul or convolution (2·K FLOPs per output element), so a "
        "1×1 convolution over 64 channels or the K = 64 attention-score matmul is memory-bound "
        "and far below the range while the K = 4,096 FFN-down matmul is above it. The rows "
        "marked \"(row's shape)\" are the shapes each paper row is taken to stand for, and the "
        f"tests check them: {hits} of {total} within ×2.", "",
        *t1_lines, "",
        f"## (b) Calibration on this CPU (`cpu` spec, {args.repeats} timed steps per model)", "",
        "The `cpu` spec is measured afresh at the start of this part (`measure_cpu()`, the "
        "numbers in the spec table), not read from the cache, so that it and the op times "
        "share the machine's load. Each zoo model runs at its `small_batch`; an op's measured "
        "time is the median over the timed steps of `perf_counter_ns` around the op alone (in "
        "the dispatch mode, so it includes the dispatcher but not Python model code). "
        "\"Kernel ops\" are the ops the model gives a non-zero time (everything but views and "
        "metadata ops).", "",
        *cal_lines, "",
        f"![predicted vs measured]({png.name})", "",
        "## Caveats", "",
        "- The roofline ignores caches: on this CPU a tensor that fits in L2 moves faster than "
        "the measured 32 MiB copy, a weight matrix streamed from DRAM slower, and a fresh "
        "multi-MB output pays page faults; all spread the memory-bound ratios. CPU reductions, "
        "norms, `cat` and index ops also have fixed costs well above the 1-element add that sets "
        "the launch overhead, hence their low ratios.",
        "- On this shared machine the CPU's speed moves with other jobs' load: a spec measured "
        "in a quiet moment and op times taken in a busy one (or the reverse) shift every ratio "
        "together by up to ×3 from run to run, while the ranks (Spearman ρ) stay within a few "
        "hundredths. Read ranks and relative ratios between classes, not absolute ratios.",
        "- Batch norm and softmax read their input more than once on real hardware; the model "
        "counts every tensor once.",
        "- GPU efficiencies (0.85 of peak FLOP/s and bandwidth) are one number for all shapes; "
        "small or skinny matmuls and convolutions reach less, Winograd 3×3 convolutions can "
        "beat the FLOP count.",
        "- Views cost 0 (no kernel on a GPU); on the CPU they take a few microseconds each "
        "(the view row above).",
        "- Ops outside the FLOP registry are timed by bytes even where they compute a lot: "
        "`_cudnn_rnn` / `mkldnn_rnn_layer` (a fused `nn.LSTM`) are underestimated; the zoo's "
        "LSTMs are unrolled into matmuls, which are priced by FLOPs.",
    ]
    out.write_text("\n".join(lines) + "\n")
    log(f"wrote {out} and {png} in {wall:.0f} s")


if __name__ == "__main__":
    main()
