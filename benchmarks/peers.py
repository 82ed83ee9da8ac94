"""membudget's live runtime against what a PyTorch user would pick instead, measured alike.

For each model (GPT-2, a ViT, a residual CNN; random init, dropout 0) one training step
(forward + backward) is run by every method, and each method's step gets:

- **real peak**: the most bytes live at once during the step, parameters, buffers and the
  batch included (they are live throughout; gradients of an earlier step are not: they are set
  to None first). ONE meter serves every row: the CPU allocator's own events as
  ``torch.profiler.profile(profile_memory=True)`` records them (every allocation and free made
  while it runs, with its bytes, in time order; the peak is the largest running sum) plus the
  bytes of the parameters, buffers and batch that were allocated before it started. It sees
  inside compiled graphs too. As a cross-check, the rows that run no compiled code are also
  measured by ``membudget.bench.meter.StorageMeter`` (a dispatch mode counting every live
  storage an op touched, entered outside everything, a membudget session included); the two
  are reported side by side.
- **time × eager**: paired interleaved rounds: in each round one eager step and one step of
  the method run back to back (eager first in even rounds, second in odd ones), and the
  method's time over its eager partner's is taken; the table gives the median over
  ``--rounds`` rounds and the min–max. Every method is warmed up first (compiled methods
  compile then). One intra-op thread by default (``--threads``): this shared machine
  disturbs one-thread steps far less. glibc is told to keep freed memory (as a device's
  caching allocator does; ``membudget.bench.malloc``), for every method alike.
- **grads = eager**: the loss and every parameter's gradient after one step compared with
  eager's: bitwise (``torch.equal``) for checkpointing and membudget, the max absolute
  difference for compiled code (its kernels sum in other orders).

Methods (rows): eager; per-block checkpointing (``torch.utils.checkpoint``, non-reentrant,
every transformer layer or residual block); selective checkpointing (the same blocks, with
``create_selective_checkpoint_contexts`` saving the outputs of matmuls, convolutions and
attention kernels and recomputing the rest); ``torch.compile`` (inductor, or ``aot_eager``
if inductor cannot compile here) with ``torch._functorch.config.activation_memory_budget``
at each of ``COMPILE_BUDGETS`` (a fresh compile per value); and membudget
(``with membudget.budget(B, **mode):`` around forward + backward) for each entry of
``MEMBUDGET_MODES``: with B found by a short search so that its real peak (same meter) is
at most, and as near as the search gets to, each peer's real peak, and at the smallest B
that completes (bisection; ``BudgetTooSmallError`` means too small).

Run: python benchmarks/peers.py [--quick] [--models gpt2,vit,cnn] [--rounds 7] [--threads 1]
[--compile-backend inductor] [--out docs/results/peers.md]   (the plot goes beside --out, .png)
Progress goes to stderr; the full run takes 20–30 minutes on two cores.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import membudget
from membudget.bench.malloc import keep_freed_memory
from membudget.bench.meter import StorageMeter
from membudget.bench.report import git_state
from membudget.core import COMPILED

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "results" / "peers.md"
DEFAULT_MODELS = "gpt2,vit,cnn"
MB = 1e6  # tables give decimal megabytes

# ---- MEMBUDGET VARIANTS: add a line here to measure another one. ----------------------
# ``label`` names its rows; ``kwargs`` go to ``membudget.budget(B, **kwargs)``; ``at_peers``:
# also run it at each peer's real peak (else only at its smallest completing budget);
# ``warmup``: steps each budget's session runs before one is measured (default: none in the
# searches, one before the rows' measurements), then a planning session's
# ``wait_for_plan()``. One session object per budget is entered once per step, as in a
# training loop. A variant whose kwargs ``membudget.budget`` does not accept (TypeError) is
# skipped, with a note in the report.
MEMBUDGET_MODES: list[dict[str, Any]] = [
    {"label": "dtr-eq", "kwargs": {"policy": "dtr-eq"}, "at_peers": True},
    {"label": "coop", "kwargs": {"policy": "coop"}, "at_peers": False},
    {"label": "planned", "kwargs": {"policy": "dtr-eq", "mode": "planned"}, "at_peers": True,
     "warmup": 1, "settle": 1},
]
COMPILE_BUDGETS = (1.0, 0.5, 0.1)
UNLIMITED = 10**11  # a budget nothing reaches: membudget without eviction
MATCH_TOL = 0.005  # a budget whose real peak is within this share below the target is kept
MATCH_TRIES = 10  # budgets tried per target
MIN_RESOLUTION = 0.01  # the smallest-budget bisection stops within this share of eager's peak
THRASH = 20.0  # a search step whose recomputation costs this × the step's ops is stopped

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module], torch.Tensor]


def log(msg: str) -> None:
    """Progress, to stderr (the run takes minutes)."""
    print(msg, file=sys.stderr, flush=True)


def mb(nbytes: float) -> str:
    return f"{nbytes / MB:,.1f}"


# ---------------------------------------------------------------------------- models
class BasicBlock(nn.Module):
    """A ResNet basic block, as torchvision writes it: conv-bn-relu, conv-bn, the shortcut
    added in place, relu (in place)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                   nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResCNN(nn.Module):
    """A small residual CNN: a conv-bn-relu stem, three stages of ``per_stage`` basic blocks
    (widths w, 2w, 4w; stride 2 into stages 2 and 3) in one ``nn.Sequential``, global average
    pooling and a linear head. ``block_fn``, when set, runs each block (``block_fn(block,
    x)``): per-block checkpointing is set there, as HF models do it per layer."""

    def __init__(self, width: int = 16, per_stage: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        blocks: list[nn.Module] = []
        cin = width
        for k, cout in enumerate((width, 2 * width, 4 * width)):
            for j in range(per_stage):
                blocks.append(BasicBlock(cin, cout, 2 if k > 0 and j == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)
        self.block_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x) if self.block_fn is None else self.block_fn(block, x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@dataclass
class Workload:
    """A model in train mode, its loss on a fixed batch, and how to turn a copy of it into
    per-block (selective) checkpointing: ``blockwise(model, context_fn)``, context_fn None
    for plain checkpointing."""

    name: str
    desc: str
    model: nn.Module
    batch: Batch
    loss: LossFn
    blockwise: Callable[[nn.Module, Callable[[], Any] | None], None]
    blocks: str  # what a "block" is, in words


def _hf_blockwise(model: nn.Module, context_fn: Callable[[], Any] | None) -> None:
    """transformers' own per-layer checkpointing, non-reentrant (``context_fn`` passed through
    to ``torch.utils.checkpoint.checkpoint``). transformers 5 renamed
    ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable`` (the old name is
    a deprecated alias of the same method); the new one is used where it exists."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    model.train()


def _cnn_blockwise(model: nn.Module, context_fn: Callable[[], Any] | None) -> None:
    """Each residual block through ``torch.utils.checkpoint.checkpoint``, non-reentrant."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    assert isinstance(model, ResCNN)
    model.block_fn = functools.partial(checkpoint, **kwargs)


def _hf_loss(batch: Batch) -> LossFn:
    return lambda m: m(**batch).loss


def build_gpt2() -> Workload:
    """GPT-2, 6 layers of width 256 (4 heads), vocabulary 8000, batch 8 × 256 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads, vocab, batch, seq = 6, 256, 4, 8000, 8, 256
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                     n_positions=seq, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").train()
    model.loss_type = "ForCausalLM"  # transformers cannot tell it from the class name
    ids = torch.randint(0, vocab, (batch, seq))
    inputs = {"input_ids": ids, "labels": ids}
    params = sum(p.numel() for p in model.parameters())
    return Workload("gpt2", f"GPT2LMHeadModel: {layers} layers, n_embd {width}, {heads} heads, "
                    f"vocabulary {vocab}, SDPA attention, dropout 0, {params / 1e6:.1f} M "
                    f"parameters; batch {batch} × {seq} tokens, labels = inputs",
                    model, inputs, _hf_loss(inputs), _hf_blockwise, "transformer layer")


def build_vit() -> Workload:
    """A small ViT: 6 layers, hidden 256 (4 heads, FFN 1024), 224×224 images in 16×16 patches
    (197 tokens), batch 8, 10 classes."""
    from transformers import ViTConfig, ViTForImageClassification

    layers, hidden, heads, ffn, image, patch, batch = 6, 256, 4, 1024, 224, 16, 8
    cfg = ViTConfig(image_size=image, patch_size=patch, hidden_size=hidden,
                    num_hidden_layers=layers, num_attention_heads=heads,
                    intermediate_size=ffn, num_labels=10, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    model = ViTForImageClassification._from_config(cfg, attn_implementation="sdpa").train()
    inputs = {"pixel_values": torch.randn(batch, 3, image, image),
              "labels": torch.randint(0, 10, (batch,))}
    params = sum(p.numel() for p in model.parameters())
    return Workload("vit", f"ViTForImageClassification: {layers} layers, hidden {hidden}, "
                    f"{heads} heads, FFN {ffn}, SDPA attention, dropout 0, "
                    f"{params / 1e6:.1f} M parameters; batch {batch} × 3×{image}×{image} "
                    f"(patch {patch}: {(image // patch) ** 2 + 1} tokens), 10 classes",
                    model, inputs, _hf_loss(inputs), _hf_blockwise, "transformer layer")


def build_cnn() -> Workload:
    """The residual CNN of this file, width 16, 3 blocks a stage, batch 48 × 3×64×64."""
    width, per_stage, batch, side = 16, 3, 48, 64
    model = ResCNN(width, per_stage).train()
    x, y = torch.randn(batch, 3, side, side), torch.randint(0, 10, (batch,))
    params = sum(p.numel() for p in model.parameters())
    return Workload("cnn", f"ResCNN (this file): a conv-bn-relu stem and 3 stages × "
                    f"{per_stage} basic blocks (conv-bn-relu, conv-bn, `out += identity`, "
                    f"in-place ReLU; widths {width}/{2 * width}/{4 * width}), "
                    f"{params / 1e6:.2f} M parameters; batch {batch} × 3×{side}×{side}, "
                    "10 classes", model, {"x": x, "y": y},
                    lambda m: F.cross_entropy(m(x), y), _cnn_blockwise, "residual block")


BUILDERS: dict[str, Callable[[], Workload]] = {
    "gpt2": build_gpt2, "vit": build_vit, "cnn": build_cnn}


# ---------------------------------------------------------------------------- selective policy
def _ops(*names: str) -> set[Any]:
    """Every overload of each named aten op that exists in this torch."""
    found: set[Any] = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        found.update(getattr(packet, o) for o in packet.overloads())
    return found


SAVED_OPS = _ops("mm", "addmm", "bmm", "convolution",
                 "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_fused_attention_overrideable")


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: keep what matmuls, convolutions and attention kernels made (the
    costly ops), recompute everything else in backward."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """The ``context_fn`` of ``checkpoint`` for selective checkpointing."""
    return create_selective_checkpoint_contexts(save_matmuls)


# ---------------------------------------------------------------------------- meters
def live_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def profiled_peak(run: Callable[[], Any]) -> tuple[Any, int, str]:
    """``run()`` under the profiler: its result, the largest running sum of the CPU
    allocator's events (allocations positive, frees negative, in time order) from the start
    (so at least 0), that is the most bytes allocated while it ran and alive at once, and
    the op the program called that made the allocation reaching it. Blocks allocated before
    are not in the sum (the allocator reports no free of them)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run()
    events: list[tuple[int, int, str]] = []
    stack = [(root, "") for root in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, op = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size, op or "(no op)"))
            continue
        if not op and node.name.startswith("aten::"):
            op = node.name  # the outermost aten op: the one the program (or autograd) called
        stack.extend((child, op) for child in node.children)
    events.sort(key=lambda e: e[0])
    running = peak = 0
    at = ""
    for _, nbytes, op in events:
        running += nbytes
        if running > peak:
            peak, at = running, op
    return out, peak, at


# ---------------------------------------------------------------------------- rows
@dataclass
class Row:
    """One method on one model: how to run a step, and what was measured."""

    key: str
    family: str  # eager | checkpoint | selective | compile | membudget
    label: str
    model: nn.Module  # whose parameters' gradients the step writes
    run: Callable[[], torch.Tensor] | None = None  # one step; returns the detached loss
    compiled: bool = False
    budget: int | None = None  # membudget's B
    mode: str = ""  # membudget's variant label
    targets: list[str] = field(default_factory=list)  # membudget at these peers' peak
    peak: int | None = None  # profiler meter, baseline included
    meter_peak: int | None = None  # StorageMeter
    peak_op: str = ""  # the op whose allocation reached the real peak
    ratios: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    versus: dict[str, list[float]] = field(default_factory=dict)  # target -> paired ratios
    exact: bool | None = None
    max_diff: float | None = None
    evictions: int | None = None
    remat_ops: int | None = None
    ops: int | None = None  # aten ops the session ran (first runs)
    replayed: bool = False  # a planned session's replayed step: evictions are drops
    note: str = ""
    failure: str | None = None
    failed_rounds: int = 0  # timed membudget steps that ran out (not in the ratios)
    session: Any = None  # the last membudget session run


def zero_grads(models: Iterable[nn.Module]) -> None:
    """No gradients, so none of an earlier step is live in the next."""
    for m in models:
        m.zero_grad(set_to_none=True)


def plain_step(model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
    """Forward and backward (RNG reseeded: no op here is random, but identical anyway)."""
    torch.manual_seed(1)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach()


class Bench:
    """Everything measured on one workload: the rows, and the eager reference."""

    def __init__(self, wl: Workload, rounds: int, backend: str) -> None:
        self.wl, self.rounds, self.backend = wl, rounds, backend
        self.models: list[nn.Module] = [wl.model]
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.baseline = 0
        self.ref_loss: torch.Tensor | None = None
        self.ref_grads: list[torch.Tensor | None] = []
        self.eager = self.add(Row("eager", "eager", "eager", wl.model,
                                  lambda: plain_step(wl.model, wl.loss)))
        self.unconstrained: dict[str, Row] = {}

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        if all(row.model is not m for m in self.models):
            self.models.append(row.model)
        return row

    # ------------------------------------------------------------------ measuring
    def baseline_bytes(self) -> int:
        """Parameters, buffers and the batch: live through every step, allocated before."""
        m = self.wl.model
        return live_bytes([*m.parameters(), *m.buffers(), *self.wl.batch.values()])

    def step(self, row: Row) -> torch.Tensor:
        """One step of ``row`` from no gradients (set outside the step)."""
        assert row.run is not None
        zero_grads(self.models)
        return row.run()

    def check(self, row: Row, loss: torch.Tensor) -> None:
        """Compare the step's loss and gradients with eager's."""
        assert self.ref_loss is not None
        grads = [p.grad for p in row.model.parameters()]
        exact = torch.equal(loss, self.ref_loss)
        diff = (loss - self.ref_loss).abs().item()
        for g, r in zip(grads, self.ref_grads, strict=True):
            if (g is None) != (r is None):
                exact, diff = False, float("inf")
            elif g is not None and r is not None:
                exact = exact and torch.equal(g, r)
                diff = max(diff, (g - r).abs().max().item())
        row.exact = exact if row.exact is None else row.exact and exact
        row.max_diff = diff if row.max_diff is None else max(row.max_diff, diff)

    def measure_memory(self, row: Row, meter: bool) -> None:
        """The row's real peak by the profiler (and by StorageMeter, entered outside
        everything, with ``meter``), on one step each; the loss and gradients checked."""
        zero_grads(self.models)
        gc.collect()
        loss, peak, row.peak_op = profiled_peak(lambda: self.step(row))
        row.peak = self.baseline + peak
        self.check(row, loss)
        if meter:
            zero_grads(self.models)
            gc.collect()
            with StorageMeter() as m:
                loss = self.step(row)
            row.meter_peak = m.peak_bytes
            self.check(row, loss)
        self.note_session(row)
        log(f"  {row.label}: real peak {mb(row.peak)} MB"
            + (f" (StorageMeter {mb(row.meter_peak)} MB)" if row.meter_peak else "")
            + f", grads = eager: {row.exact}"
            + ("" if row.exact else f" (max abs diff {row.max_diff:.3g})"))

    def note_session(self, row: Row) -> None:
        """The evictions and recomputations of the row's last membudget step."""
        if row.session is not None:
            st = row.session.stats
            row.evictions, row.remat_ops, row.ops = st.evictions, st.remat_ops, st.ops
            if st.replayed_ops:  # (a replayed step: its drops and recomputed ops)
                row.replayed = True
                row.evictions = st.replay_dropped + st.evictions
                row.remat_ops = st.replay_recomputed_ops + st.remat_ops
                row.ops = st.replayed_ops + st.ops

    def timed(self, row: Row) -> float:
        """Seconds of one step of ``row`` (gradients dropped and garbage collected first,
        outside the time)."""
        zero_grads(self.models)
        gc.collect()
        t0 = time.perf_counter()
        self.step(row)
        return time.perf_counter() - t0

    def pair(self, row: Row, k: int) -> None:
        """Round ``k`` for ``row``: an eager step and one of ``row`` back to back (eager
        first when ``k`` is even)."""
        if k % 2 == 0:
            te = self.timed(self.eager)
            tm = self.timed(row)
        else:
            tm = self.timed(row)
            te = self.timed(self.eager)
        row.times.append(tm)
        row.ratios.append(tm / te)

    def face(self, row: Row, peer: Row, k: int) -> None:
        """Round ``k`` of ``row`` against the peer at whose peak it runs: their steps back
        to back (the peer first when ``k`` is even), the ratio of their times."""
        if k % 2 == 0:
            tp = self.timed(peer)
            tm = self.timed(row)
        else:
            tm = self.timed(row)
            tp = self.timed(peer)
        row.versus.setdefault(peer.label, []).append(tm / tp)

    def rounds_for(self, rows: Sequence[Row]) -> None:
        """``self.rounds`` rounds, each pairing every row with an eager step of its own,
        then each membudget row with each peer (among ``rows``, not eager) at whose peak it
        runs: two methods compared in one pair, not through two pairings with eager."""
        rows = [r for r in rows if r.failure is None and r.run is not None]
        if not rows:
            return
        by_label = {r.label: r for r in rows if r is not self.eager}
        faced = [(r, by_label[name]) for r in rows if r.family == "membudget"
                 for name in r.targets if name in by_label]
        for k in range(self.rounds):
            done = []
            for row in rows:
                try:
                    self.pair(row, k)
                    done.append(f"{row.label} {row.ratios[-1]:.2f}×")
                except membudget.BudgetTooSmallError as e:  # near the smallest budget
                    row.failed_rounds += 1
                    done.append(f"{row.label} ran out ({e.op})")
            for row, peer in faced:
                try:
                    self.face(row, peer, k)
                    done.append(f"{row.label} / {peer.label} {row.versus[peer.label][-1]:.2f}×")
                except membudget.BudgetTooSmallError as e:
                    row.failed_rounds += 1
                    done.append(f"{row.label} against {peer.label} ran out ({e.op})")
            log(f"  round {k + 1}/{self.rounds}: " + ", ".join(done))

    # ------------------------------------------------------------------ methods
    def run_eager(self) -> None:
        log("  eager: warm-up and reference")
        wl = self.wl
        self.baseline = self.baseline_bytes()
        for _ in range(2):
            loss = self.step(self.eager)
        self.ref_loss = loss
        self.ref_grads = [None if p.grad is None else p.grad.detach().clone()
                          for p in wl.model.parameters()]
        self.measure_memory(self.eager, meter=True)

    def add_blockwise(self) -> list[Row]:
        """Per-block checkpointing and selective checkpointing, each on its own copy."""
        rows = []
        for family, label, ctx in (("checkpoint", "checkpoint (per block)", None),
                                   ("selective", "selective (SAC, per block)",
                                    selective_context)):
            model = copy.deepcopy(self.wl.model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                self.wl.blockwise(model, ctx)
            loss_fn = self.wl.loss
            row = self.add(Row(family, family, label, model,
                               functools.partial(plain_step, model, loss_fn)))
            self.step(row)  # warm-up
            self.measure_memory(row, meter=True)
            rows.append(row)
        return rows

    def run_compiled(self) -> list[Row]:
        """One row per activation memory budget: a fresh compile each, warmed up, measured
        and timed at once (the next ``torch._dynamo.reset()`` discards it)."""
        rows = []
        for b in COMPILE_BUDGETS:
            torch._dynamo.reset()
            row = self.add(Row(f"compile-{b:g}", "compile", f"compile {b:g}", self.wl.model,
                               compiled=True))
            compiled = torch.compile(self.wl.model, backend=self.backend)

            def run(compiled: Any = compiled, b: float = b) -> torch.Tensor:
                with torch._functorch.config.patch(activation_memory_budget=b):
                    return plain_step(compiled, self.wl.loss)

            row.run = run
            t0 = time.perf_counter()
            try:
                self.step(row)  # compiles forward and backward
            except Exception as e:
                if self.backend == "aot_eager":
                    raise
                traceback.print_exc()
                log(f"  {self.backend} failed ({type(e).__name__}); falling back to aot_eager")
                self.notes.append(f"`torch.compile(backend={self.backend!r})` failed here "
                                  f"({type(e).__name__}: {str(e)[:200]}); compiled rows use "
                                  "`aot_eager`.")
                self.backend = "aot_eager"
                self.rows.remove(row)
                return self.run_compiled()
            log(f"  compile {b:g} ({self.backend}): first step {time.perf_counter() - t0:.1f} s")
            self.step(row)
            row.label = f"compile {b:g} ({self.backend})"
            self.measure_memory(row, meter=False)
            self.rounds_for([row])
            rows.append(row)
        torch._dynamo.reset()
        return rows

    # ------------------------------------------------------------------ membudget
    def session_row(self, mode: dict[str, Any], budget: int, label: str) -> Row:
        """A membudget row: one session object per budget, entered once per step (as a
        training loop or ``@membudget.budget`` does; a planned variant needs it)."""
        row = Row(f"{mode['label']}@{budget}", "membudget", label, self.wl.model, budget=budget,
                  mode=mode["label"])

        def run() -> torch.Tensor:
            if row.session is None or row.session.budget_bytes != row.budget:
                row.session = membudget.budget(row.budget, **mode["kwargs"])
            with row.session:
                return plain_step(self.wl.model, self.wl.loss)

        row.run = run
        return row

    def prepare(self, row: Row, mode: dict[str, Any]) -> None:
        """The variant's warm-up steps at the row's budget (``warmup``, default 1), then,
        for a session that plans in the background, the wait for its plan and ``settle``
        steps that follow it (after one that follows it to its end, a planned session
        replays its steps: those are what is measured)."""
        for _ in range(mode.get("warmup", 1)):
            self.step(row)
        wait = getattr(row.session, "wait_for_plan", None)
        if wait is not None and getattr(row.session, "mode", "dynamic") == "planned":
            wait()
            for _ in range(mode.get("settle", 0)):
                self.step(row)

    def trial(self, mode: dict[str, Any], budget: int, limit: float | None = None
              ) -> tuple[int | None, str, Any]:
        """One membudget step at ``budget`` under the profiler, after the variant's
        ``warmup`` steps (default none here): (real peak or None, why it did not complete,
        the error or the session). ``limit``: stop recomputation past that cost (ns)."""
        row = self.session_row(mode, budget, "trial")
        try:
            if mode.get("warmup", 0):
                self.prepare(row, mode)
            zero_grads(self.models)
            gc.collect()

            def run() -> torch.Tensor:
                if row.session is None:
                    row.session = membudget.budget(budget, **mode["kwargs"])
                with row.session as session:
                    if limit is not None:
                        session.engine.remat_cost_limit = limit
                    return plain_step(self.wl.model, self.wl.loss)

            loss, peak, _ = profiled_peak(run)
        except membudget.BudgetTooSmallError as e:
            return None, (f"too small: `{e.op}` needed ≥ {mb(e.needed_bytes)} MB"
                          if e.needed_bytes > e.budget_bytes else
                          f"fragmented: `{e.op}` needed a {mb(e.request_bytes)} MB block"), e
        except membudget.Thrashed:
            return None, f"thrashed (recomputation over {THRASH:g}× the step's ops)", None
        self.check(row, loss)
        if not row.exact:
            log(f"    **gradients differ from eager at budget {mb(budget)} MB** "
                f"(max abs diff {row.max_diff:.3g})")
        return self.baseline + peak, "", row.session

    def unconstrained_row(self, mode: dict[str, Any]) -> Row | None:
        """The variant with no limit (its real peak; None if ``membudget.budget`` refuses
        the variant's kwargs)."""
        try:
            membudget.budget(UNLIMITED, **mode["kwargs"])
        except TypeError as e:
            note = (f"membudget variant `{mode['label']}` ({mode['kwargs']}) skipped: "
                    f"`membudget.budget` does not accept it here ({e}).")
            log("  " + note)
            self.notes.append(note)
            return None
        row = self.session_row(mode, UNLIMITED, f"membudget {mode['label']}, no limit")
        self.step(row)  # warm-up: sizes and costs of every op
        self.step(row)
        peak, _, session = self.trial(mode, UNLIMITED)
        row.peak, row.session = peak, session
        log(f"  membudget {mode['label']} without limit: real peak {mb(peak or 0)} MB, "
            f"engine peak {mb(session.stats.peak_bytes)} MB")
        self.unconstrained[mode["label"]] = row
        return row

    def match(self, mode: dict[str, Any], target: int, names: list[str]) -> Row:
        """membudget at the largest budget found whose real peak is ≤ ``target``: first the
        target itself, then each next budget moved by what the real peak missed the target
        by, down by at least ``MATCH_TOL`` of it (doubled while the peak stays over: a
        kernel's own scratch can hold the real peak still over a range of budgets), and
        kept strictly between the largest budget under the target and the least over it."""
        free = self.unconstrained[mode["label"]]
        assert free.peak is not None
        label = f"membudget {mode['label']} @ {' = '.join(names)} peak"
        if free.peak <= target:
            row = self.session_row(mode, target, label)
            row.note = "its peak without a limit is already below the target"
            log(f"  {label}: unlimited peak {mb(free.peak)} ≤ {mb(target)} MB, budget = target")
            return row
        log(f"  {label}: searching for a real peak ≤ {mb(target)} MB")
        under: tuple[int, int] | None = None  # (budget, real peak ≤ target), largest budget
        over: int | None = None  # least budget seen with a real peak above the target
        budget = target
        tried = {budget}
        down = max(1, int(MATCH_TOL * target))  # the least step down, doubled while over
        for _ in range(MATCH_TRIES):
            peak, why, _ = self.trial(mode, budget)
            log(f"    budget {mb(budget)} MB: "
                + (why if peak is None else f"real peak {mb(peak)} MB"))
            if peak is None:
                break  # too small here: every smaller budget is too
            if peak <= target:
                if under is None or budget > under[0]:
                    under = (budget, peak)
                if target - peak <= MATCH_TOL * target:
                    break
            elif over is None or budget < over:
                over = budget
            low = under[0] if under else 0
            if peak > target:
                nxt = budget - max(peak - target, down)
                down *= 2
            else:
                nxt = budget + (target - peak)
            if not (low < nxt and (over is None or nxt < over)):
                assert over is not None  # (a peak under the target moves the budget up)
                nxt = (low + over) // 2
            if nxt in tried or nxt <= 0:
                break
            budget = nxt
            tried.add(budget)
        if under is None:
            row = self.session_row(mode, budget, label)
            row.failure = f"no budget found with a real peak ≤ {mb(target)} MB"
            log(f"  {label}: {row.failure}")
            return row
        return self.session_row(mode, under[0], label)

    def smallest(self, mode: dict[str, Any], known_ok: int) -> Row:
        """Bisection for the smallest budget that completes (without thrashing), from one
        known to complete; a failure's needed bytes (a lower bound for the run) move the
        lower end up at once. Completion is assumed monotone in the budget."""
        free = self.unconstrained[mode["label"]]
        limit = THRASH * free.session.stats.op_seconds * 1e9
        assert self.eager.peak is not None
        resolution = MIN_RESOLUTION * self.eager.peak
        hi, lo = known_ok, 0
        while hi - lo > resolution:
            mid = (lo + hi) // 2 if lo else int(hi * 0.6)
            peak, why, err = self.trial(mode, mid, limit)
            log(f"    {mode['label']} budget {mb(mid)} MB: "
                + (why if peak is None else f"completes, real peak {mb(peak)} MB"))
            if peak is not None:
                hi = mid
            else:
                lo = mid
                needed = getattr(err, "needed_bytes", 0)
                if isinstance(err, membudget.BudgetTooSmallError) and needed > mid:
                    lo = max(lo, min(needed, hi) - 1)
        row = self.session_row(mode, hi, f"membudget {mode['label']}, smallest")
        row.note = f"bisection: completes at {mb(hi)} MB, not at {mb(lo)} MB"
        return row

    def confirm(self, row: Row, mode: dict[str, Any]) -> None:
        """Warm up and measure a membudget row at its budget. The same step at the same
        budget does not always complete (its evictions vary from run to run), so a smallest
        row that runs out now is raised by the search's resolution, up to 5 times."""
        assert self.eager.peak is not None and row.budget is not None
        found = row.budget
        for _ in range(6):
            try:
                self.prepare(row, mode)
                self.measure_memory(row, meter=True)
            except membudget.BudgetTooSmallError as e:
                log(f"  {row.label} at {mb(row.budget)} MB ran out when run again ({e.op})")
                if row.targets:
                    row.failure = f"ran out when run again at {mb(row.budget)} MB ({e.op})"
                    return
                row.budget += int(MIN_RESOLUTION * self.eager.peak)
                row.exact = row.max_diff = None
                continue
            if row.budget != found:
                row.note += (f"; it ran out when run again at {mb(found)} MB, raised to "
                             f"{mb(row.budget)} MB")
            if row.peak is not None and row.peak > row.budget:
                log(f"  note: {row.label}: real peak {mb(row.peak)} MB is above its budget "
                    f"{mb(row.budget)} MB")
            return
        row.failure = f"ran out when run again, up to {mb(row.budget)} MB"

    def run_membudget(self, peers: Sequence[Row]) -> list[Row]:
        """Each variant at each peer's real peak (``at_peers``; equal peaks share a row) and
        at its smallest completing budget, each measured with both meters."""
        rows: list[Row] = []
        for mode in MEMBUDGET_MODES:
            if self.unconstrained_row(mode) is None:
                continue
            smallest_ok = UNLIMITED
            if mode["at_peers"]:
                targets: list[tuple[int, list[str]]] = []
                for p in sorted((p for p in peers if p.peak), key=lambda p: -(p.peak or 0)):
                    assert p.peak is not None
                    if targets and abs(targets[-1][0] - p.peak) <= MATCH_TOL * p.peak:
                        targets[-1][1].append(p.label)
                    else:
                        targets.append((p.peak, [p.label]))
                for target, names in targets:
                    row = self.match(mode, target, names)
                    row.targets = names
                    rows.append(self.add(row))
                    if row.failure is None:
                        assert row.budget is not None
                        smallest_ok = min(smallest_ok, row.budget)
            if smallest_ok == UNLIMITED:
                free = self.unconstrained[mode["label"]]
                smallest_ok = free.session.stats.peak_bytes
                while self.trial(mode, smallest_ok)[0] is None:
                    smallest_ok = int(smallest_ok * 1.1)
            rows.append(self.add(self.smallest(mode, smallest_ok)))
        modes = {m["label"]: m for m in MEMBUDGET_MODES}
        for row in rows:
            if row.failure is None:
                self.confirm(row, modes[row.mode])
        return rows


def measure(name: str, rounds: int, backend: str) -> Bench:
    """Every row on one model: eager, the peers, compiled, then membudget, then the paired
    rounds of the rows not yet timed."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wl = BUILDERS[name]()
    log(f"\n== {name}: {wl.desc}")
    gc.collect()
    gc.freeze()  # what exists now is never collected: the collections before steps stay short
    bench = Bench(wl, rounds, backend)
    bench.run_eager()
    blockwise = bench.add_blockwise()
    compiled = bench.run_compiled()
    mem_rows = bench.run_membudget([bench.eager, *blockwise, *compiled])
    log(f"  timing: {rounds} paired rounds")
    bench.rounds_for([bench.eager, *blockwise, *mem_rows])
    return bench


# ---------------------------------------------------------------------------- report
def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def time_cell(row: Row) -> str:
    """Median [min–max] of the paired ratios; eager's are eager over eager (the noise)."""
    if not row.ratios:
        return "—"
    cell = f"{median(row.ratios):.2f} [{min(row.ratios):.2f}–{max(row.ratios):.2f}]"
    return f"1 (eager / eager: {cell})" if row.family == "eager" else cell


def grads_cell(row: Row) -> str:
    if row.exact is None:
        return "—"
    if row.exact:
        return "yes (bitwise)"
    if row.compiled:
        return f"no: max abs diff {row.max_diff:.2g}"
    return f"**NO** (max abs diff {row.max_diff:.3g})"


def table(bench: Bench) -> list[str]:
    """The model's table: one line per row, in the order measured."""
    eager = bench.eager.peak or 1
    lines = ["| method | budget MB | real peak MB | StorageMeter MB | peak / eager | time × eager: "
             "median [min–max] | step s (median) | grads = eager | evictions / remat ops | "
             "op at the real peak |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in bench.rows:
        budget = mb(r.budget) if r.budget is not None else "—"
        if r.failure is not None:
            lines.append(f"| {r.label} | {budget} | {r.failure} | | | | | | | |")
            continue
        peak = mb(r.peak) if r.peak is not None else "—"
        meter = mb(r.meter_peak) if r.meter_peak is not None else "(not seen)"
        share = f"{r.peak / eager:.2f}" if r.peak is not None else "—"
        secs = f"{median(r.times):.3f}" if r.times else "—"
        ev = f"{r.evictions:,} / {r.remat_ops:,}" if r.evictions is not None else "—"
        if r.replayed:
            ev += " (replayed: drops / recomputed ops)"
        label = r.label + (f" ({r.note})" if r.note and r.family == "membudget" else "")
        at = r.peak_op.removeprefix("aten::")
        if r.compiled and at == "(no op)":
            at = "(compiled code)"
        lines.append(f"| {label} | {budget} | {peak} | {meter} | {share} | {time_cell(r)} | "
                     f"{secs} | {grads_cell(r)} | {ev} | {at} |")
    return lines


def findings(bench: Bench) -> list[str]:
    """What the table says, in words computed from it: membudget at each peer's peak
    against that peer, membudget's lowest completing peak against each peer's, where a
    real peak exceeded a budget, and how the two meters compare."""
    eager_peak = bench.eager.peak or 1
    peers = {r.label: r for r in bench.rows
             if r.family != "membudget" and r.peak is not None}
    mem = [r for r in bench.rows if r.family == "membudget"]
    out: list[str] = []
    for r in mem:
        for name in r.targets:
            p = peers[name]
            assert p.peak is not None
            head = (f"At {p.label}'s real peak ({mb(p.peak)} MB, "
                    f"{p.peak / eager_peak:.2f} × eager's)")
            if r.failure is not None:
                out.append(f"{head}, membudget {r.mode} does not fit: {r.failure}.")
                continue
            if not (r.ratios and p.ratios):
                continue
            mt, pt = median(r.ratios), 1.0 if p is bench.eager else median(p.ratios)
            faced = r.versus.get(name)
            rel = (median(faced) if faced else mt / pt) - 1
            above = ""
            if r.peak is not None and r.peak > p.peak:
                above = (f"; measured again at that budget, its real peak came out "
                         f"{(r.peak - p.peak) / 1e3:,.0f} kB above the target")
            out.append(f"{head}, membudget {r.mode} (budget {mb(r.budget or 0)} MB, real peak "
                       f"{mb(r.peak or 0)} MB, {r.evictions or 0:,} "
                       f"{'values dropped' if r.replayed else 'evictions'}{above}) takes "
                       f"{mt:.2f}× eager's time against {p.label}'s {pt:.2f}×"
                       + (f"; paired back to back with {p.label}, {median(faced):.2f}× its "
                          f"time [{min(faced):.2f}–{max(faced):.2f}]" if faced else "")
                       + f": {abs(rel):.0%} {'slower' if rel > 0 else 'faster'} than "
                       f"{p.label}.")
    for r in mem:
        if r.targets or r.failure is not None or r.peak is None:
            continue
        cmp = [f"{p.label} {mb(p.peak)} MB ({r.peak / p.peak:.2f}×)"
               for p in peers.values() if p.family != "eager" and p.peak]
        t = f", at {median(r.ratios):.2f}× eager's time" if r.ratios else ""
        out.append(f"membudget {r.mode}'s lowest completing real peak is {mb(r.peak)} MB "
                   f"({r.peak / eager_peak:.2f} × eager's, budget {mb(r.budget or 0)} MB){t}; "
                   "as a multiple of each peer's real peak: " + "; ".join(cmp) + ".")
    for r in mem:
        if r.failure is None and r.peak is not None and r.budget is not None \
                and r.peak > r.budget:
            seen = ("" if r.meter_peak is None else
                    f"; StorageMeter saw {mb(r.meter_peak)} MB, "
                    + ("within" if r.meter_peak <= r.budget else "**also above**")
                    + " the budget")
            out.append(f"{r.label}: the real peak is {mb(r.peak - r.budget)} MB "
                       f"({r.peak / r.budget - 1:.0%}) above the budget of {mb(r.budget)} MB"
                       f"{seen}.")
        if r.failed_rounds:
            tried = len(r.ratios) + sum(map(len, r.versus.values())) + r.failed_rounds
            out.append(f"{r.label}: {r.failed_rounds} of its {tried} timed steps ran "
                       "out of budget (the same step at the same budget does not always "
                       "complete); its time is over the steps that completed.")
    free = [r for r in mem if r.evictions == 0 and r.ratios and r.ops]
    if free and bench.eager.times:
        r = free[0]
        assert r.ops is not None
        extra = (median(r.ratios) - 1) * median(bench.eager.times)
        out.append(f"Without evictions ({r.label}) membudget's step takes {median(r.ratios):.2f}×"
                   f" eager's time: {extra * 1e3:.0f} ms more than eager's median step, "
                   f"{extra / r.ops * 1e6:.0f} µs for each of the {r.ops:,} aten ops the "
                   "session ran (on this machine, under the load given above).")
    gaps = [(r.label, r.peak - r.meter_peak) for r in bench.rows
            if r.peak is not None and r.meter_peak is not None]
    if gaps:
        e = bench.eager
        assert e.peak is not None and e.meter_peak is not None
        out.append(f"The meters: on eager the profiler's peak is {mb(e.peak)} MB and "
                   f"StorageMeter's {mb(e.meter_peak)} MB "
                   f"({(e.peak - e.meter_peak) / e.peak:+.1%} of the profiler's). Over all rows "
                   "both measured, the profiler sees "
                   f"{mb(min(g for _, g in gaps))}–{mb(max(g for _, g in gaps))} MB more "
                   f"(largest: {max(gaps, key=lambda g: g[1])[0]}): what kernels allocate "
                   "for themselves, which no aten op returns and only the allocator sees (the "
                   "last column names the op running at each real peak). A budget bounds "
                   "what StorageMeter sees, not that.")
    return out


def plot(benches: Sequence[Bench], path: Path) -> None:
    """Step time × eager against real peak, one panel per model; membudget's points of one
    variant joined as a curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"eager": ("o", "black"), "checkpoint": ("s", "tab:blue"),
              "selective": ("D", "tab:green"), "compile": ("^", "tab:orange")}
    mem_styles = [("x", "tab:red"), ("*", "tab:purple"), ("P", "tab:brown"), ("v", "tab:pink")]
    fig, axes = plt.subplots(1, len(benches), figsize=(5.2 * len(benches), 4.4), squeeze=False)
    for ax, bench in zip(axes[0], benches, strict=True):
        done: set[str] = set()
        for r in bench.rows:
            if r.family == "membudget" or r.peak is None or not r.ratios:
                continue
            marker, color = styles[r.family]
            y = 1.0 if r.family == "eager" else median(r.ratios)  # eager's: its noise, as bars
            err = [[y - min(r.ratios)], [max(r.ratios) - y]]
            ax.errorbar(r.peak / MB, y, yerr=err, fmt=marker, color=color, capsize=2,
                        label=None if r.family in done else r.family)
            done.add(r.family)
            ax.annotate(r.label.split(" (")[0], (r.peak / MB, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=7, color=color)
        modes = list(dict.fromkeys(r.mode for r in bench.rows if r.family == "membudget"))
        for k, mode in enumerate(modes):
            pts = sorted((r.peak / MB, median(r.ratios), min(r.ratios), max(r.ratios))
                         for r in bench.rows if r.family == "membudget" and r.mode == mode
                         and r.peak is not None and r.ratios)
            if not pts:
                continue
            marker, color = mem_styles[k % len(mem_styles)]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.errorbar(xs, ys, yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                        fmt=marker + "-", color=color, capsize=2, label=f"membudget {mode}")
        ax.set_title(bench.wl.name)
        ax.set_xlabel("real peak (MB, parameters and batch included)")
        ax.set_ylabel("step time × eager (median, min–max)")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def loadavg() -> str:
    """The machine's load average: how much other work shared it."""
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report(benches: Sequence[Bench], args: argparse.Namespace, malloc: str, wall: float,
           plot_path: Path, load: tuple[str, str], state: str) -> list[str]:
    """The results page; ``state`` is the checkout's commit when the run started (what it
    imported and ran; the tree may be edited while it runs)."""
    import transformers

    backends = sorted({b.backend for b in benches})
    notes = [n for b in benches for n in b.notes]
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    saved = ", ".join(f"`{name}`" for name in sorted({str(op).rsplit(".", 1)[0]
                                                      for op in SAVED_OPS}))
    lines = [
        "# membudget against its peers" + (" (quick run)" if args.quick else ""), "",
        f"Produced by `{cmd}` on {datetime.datetime.now().isoformat(timespec='minutes')}: "
        f"{cpu_name()}, {platform.machine()}, {os.cpu_count()} cores (shared with other "
        f"work), torch {torch.__version__} with {torch.get_num_threads()} intra-op "
        f"thread(s), transformers {transformers.__version__}, Python "
        f"{platform.python_version()}, membudget {state} (core "
        f"{'compiled with mypyc' if COMPILED else 'interpreted'}). Wall time {wall / 60:.0f} "
        f"min; load average (1, 5, 15 min) {load[0]} at the start and {load[1]} at the end. "
        f"Memory: {malloc}. Every figure below was measured by this run.", "",
        "## What is measured", "",
        "One training step = forward + backward on a fixed batch, from no gradients "
        "(`zero_grad(set_to_none=True)` before every step, outside it). No optimizer step.", "",
        "- **real peak**: the most bytes live at once during the step, **parameters, buffers "
        "and the batch included** (they are live throughout). One meter for every row: the "
        "CPU allocator's events recorded by `torch.profiler.profile(profile_memory=True)` "
        "(each allocation positive, each free negative, in time order; the largest running "
        "sum), plus the bytes of the parameters, buffers and batch, allocated before it "
        "started. It sees what compiled graphs allocate, and kernels' own buffers. "
        "\"StorageMeter\" is the cross-check on every row that runs no compiled code: "
        "`membudget.bench.meter.StorageMeter`, a dispatch mode that counts every storage an "
        "aten op touched while it lives (parameters included once an op reads them), entered "
        "outside everything (around a membudget session too); it cannot see inside a compiled "
        "graph. MB = 10^6 bytes.",
        f"- **time × eager**: {args.rounds} paired rounds per row: an eager step and one of the "
        "row back to back, eager first in even rounds and second in odd ones; the median of "
        "the row's time over its partner's, and in brackets the smallest and largest ratio. "
        "The eager row is eager paired with eager: the noise floor of the pairing. Compiled "
        "rows are timed right after their compile (the next `torch._dynamo.reset()` discards "
        "it), the other rows in rounds that each pair every one of them once. \"step s\" is "
        "the row's own median step time. Every row is warmed up first.",
        "- **against a peer**: a membudget row at the real peak of per-block or selective "
        "checkpointing is also paired with that peer directly in each round (the peer first "
        "in even rounds), and \"What it says\" gives the median of those ratios: two "
        "methods compared in one pair rather than through two pairings with eager, whose "
        "noise adds up. (Compiled peers are timed only right after their compile; eager's "
        "row is the pairing with eager.)",
        "- **grads = eager**: the loss and every parameter's gradient of a measured step "
        "compared with eager's: bitwise (`torch.equal`) where the same kernels run; for "
        "compiled code, whose kernels sum in other orders, the max absolute difference.", "",
        "## Methods", "",
        "- **eager**: the model as it is.",
        "- **checkpoint (per block)**: `torch.utils.checkpoint.checkpoint(..., "
        "use_reentrant=False)` around every transformer layer (transformers' "
        "`activation_checkpointing_enable(activation_checkpointing_kwargs={\"use_reentrant\": "
        "False})`, the current name of `gradient_checkpointing_enable`) or every residual "
        "block of the CNN.",
        "- **selective (SAC, per block)**: the same blocks, with `context_fn=` "
        "`create_selective_checkpoint_contexts(policy)`, the policy `MUST_SAVE` for the "
        f"outputs of {saved} (every overload), `PREFER_RECOMPUTE` for everything else.",
        f"- **compile b**: `torch.compile(model, backend={', '.join(repr(b) for b in backends)})`"
        " with `torch._functorch.config.patch(activation_memory_budget=b)` around every "
        "compiled step (`torch._dynamo.reset()` and a fresh compile per b): AOTAutograd's "
        "min-cut partitioner saves a share b of its estimate of the activations' bytes and "
        "recomputes the rest in backward.",
        "- **membudget VARIANT @ X peak**: `with session:` around forward + backward, "
        "`session = membudget.budget(B, **variant)` made once per B and entered once per "
        "step (as a training loop, or `@membudget.budget` on the step function, does), "
        "B found by a short search so that its real peak (the same meter) is at "
        "most X's real peak and as close to it as the search got (first B = X's peak, then B "
        f"moved by what the real peak missed by, down by at least {MATCH_TOL:.1%} of X's peak, "
        f"doubled while the real peak stays above; at most {MATCH_TRIES} budgets; peers whose "
        "peaks are within "
        f"{MATCH_TOL:.1%} of each other share a row). Variants: "
        + "; ".join(f"`{m['label']}` = `{m['kwargs']}`" for m in MEMBUDGET_MODES) + ".",
        "- **membudget VARIANT, smallest**: the smallest B that completes, by bisection "
        f"(to {MIN_RESOLUTION:.0%} of eager's peak) from a B known to complete; "
        "`BudgetTooSmallError` (or recomputation costing over "
        f"{THRASH:g}× the step's ops) counts as not completing. A smallest budget that runs "
        "out when it is run again (the same step at the same budget does not always evict "
        "alike) is raised by that resolution until it completes.", "",
        *([f"- {n}" for n in notes] + [""] if notes else []),
        f"![step time × eager against real peak]({plot_path.name})", "",
    ]
    for b in benches:
        lines += [f"## {b.wl.name}", "", b.wl.desc + f". Blocks: each {b.wl.blocks}.", "",
                  f"Parameters, buffers and batch: {mb(b.baseline)} MB (in every peak). "
                  f"Eager step: {median(b.eager.times):.3f} s (median)." if b.eager.times
                  else "", "", *table(b), "", "What it says:", "",
                  *[f"- {s}" for s in findings(b)], ""]
    return lines


# ---------------------------------------------------------------------------- main
def malloc_setting(system: bool) -> str:
    if system:
        return "glibc's malloc as it is (`--system-malloc`)"
    if keep_freed_memory():
        return ("glibc's malloc told to keep freed memory (`mallopt(M_MMAP_MAX, 0)`, "
                "`mallopt(M_TRIM_THRESHOLD, 2^31 - 1)`), as a device's caching allocator "
                "does, for every method alike (it changes no byte counted here)")
    return "glibc's malloc as it is (`mallopt` was not available)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 3 rounds and only the first model")
    ap.add_argument("--models", default=DEFAULT_MODELS,
                    help=f"comma-separated, of {', '.join(BUILDERS)} (default {DEFAULT_MODELS})")
    ap.add_argument("--rounds", type=int, default=None,
                    help="paired rounds per row (default 7; quick 3)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend (default inductor; aot_eager if it fails)")
    ap.add_argument("--system-malloc", action="store_true",
                    help="leave glibc's malloc as it is (by default it keeps freed memory)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"report (default {DEFAULT_OUT}); "
                    "the plot is written beside it, with the suffix .png")
    args = ap.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in BUILDERS]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {', '.join(BUILDERS)}")
    if args.quick:
        models = models[:1]
    args.rounds = args.rounds or (3 if args.quick else 7)
    torch.set_num_threads(args.threads)
    malloc = malloc_setting(args.system_malloc)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()
    load_start, state = loadavg(), git_state(ROOT)
    benches = []
    backend = args.compile_backend
    for name in models:
        bench = measure(name, args.rounds, backend)
        backend = bench.backend  # a fallback sticks
        benches.append(bench)
    wall = time.perf_counter() - t0
    out = Path(args.out)
    plot_path = out.with_suffix(".png")
    plot(benches, plot_path)
    lines = report(benches, args, malloc, wall, plot_path, (load_start, loadavg()), state)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    log("\n" + "\n".join(lines))
    log(f"wrote {out} and {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
