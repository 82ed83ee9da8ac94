"""How small a budget real training steps complete in, and what fills memory when one fails.

Models that are not in membudget's zoo nor its tests, built at random init from
``transformers`` configs (no downloads: ``HF_HUB_OFFLINE=1``) or small modules of this file:

- ``qwen2-sdpa``: Qwen2 causal LM with SDPA attention (grouped-query heads);
- ``vit-dropout``: ViTForImageClassification, small, with hidden and attention dropout 0.1
  (the zoo's ViT-B/16 has none);
- ``t5``: T5 encoder-decoder (dropout 0.1, relative position biases);
- ``cnn-inplace``: a residual CNN of this file with ``nn.ReLU(inplace=True)``, batch norm and
  ``out += identity``;
- ``lstm-lm``: an ``nn.LSTM`` language model (the default oneDNN kernel, not unrolled);
- ``mistral-bf16``: a Mistral (Llama-like) causal LM trained under
  ``torch.autocast("cpu", dtype=torch.bfloat16)``;
- ``bart``: Bart encoder-decoder with SDPA attention and dropout 0.1.

One step is forward, backward and ``torch.optim.AdamW(foreach=True).step()``, all in ONE
session. The optimizer state is made first by an unlimited step outside any session; the
model's and optimizer's state are then snapshotted and loaded back (outside any session)
before every attempt, and the RNG reseeded, so every attempt runs the same step. In each
session the parameters, buffers and optimizer state are adopted (``session.adopt``) as it
starts: the program holds them for the whole step, as in steady training.

The reference peak is ``session.stats.peak_bytes`` of that step in a session without a limit
(``membudget.budget(10**11)``); ratio = budget / that peak. For each policy (dtr-eq, coop) the
smallest completing ratio is bisected on a 0.02 grid in [0.05, 1.0] (assuming that a larger
budget completes whenever a smaller one does). An attempt whose wall time exceeds 20× the
unlimited step's counts as "thrashed" and as failing; as a safety net the engine's
``remat_cost_limit`` also stops one whose recomputation costs over 50× the step's own ops
(engine-priced). "overhead" is ``remat_seconds / op_seconds`` at the smallest completing ratio.

At the failing ratio just below it, ``BudgetTooSmallError`` is caught inside the session and
the engine's resident storages (found with ``gc.get_objects()``: the compiled records are
tracked by the collector) are broken down: parameters, gradients (the storages of the
``p.grad`` wrappers), optimizer state (exp_avg, exp_avg_sq, step), inputs and other leaves
(buffers included), other pinned storages (by producing op), and non-pinned resident ones,
which at the failure were all locked by the failing op or its recomputation chain (by
producing op). "pinned+locked" is their sum (= the error's ``unevictable_bytes``, checked),
the "floor" what of it is parameters, gradients and optimizer state, and "excess" the rest;
the failing op's inputs are found through its compute path (the ``ComputePath`` whose op is
the error's ``op``).

Run: python benchmarks/live_models.py [--quick] [--models a,b] [--out docs/results/live-models.md]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from torch import nn

import membudget
from membudget.bench.malloc import keep_freed_memory
from membudget.bench.report import git_state
from membudget.core import COMPILED
from membudget.core.records import ComputePath, Storage
from membudget.runtime.session import Session, SessionStats
from membudget.runtime.tensor import RematTensor

MiB = 2**20
UNLIMITED = 10**11
POLICIES = ("dtr-eq", "coop")
GRID = [k / 100 for k in range(5, 100, 2)] + [1.0]  # 0.05, 0.07, ... 0.99, 1.0
THRASH_WALL = 20.0  # an attempt slower than this × the unlimited step counts as thrashed
THRASH_COST = 50.0  # the engine stops one whose recomputation costs this × the step's ops
LOSS = Callable[[nn.Module], torch.Tensor]
FLOOR = ("params", "grads", "opt state")  # what the program holds through the whole step
BEYOND = ("locked", "other pinned", "inputs/leaves")  # the rest of what is resident


# ---------------------------------------------------------------------------- models
class Block(nn.Module):
    """A residual basic block: in-place ReLUs and an in-place ``+=`` of the shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                   nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class InplaceCNN(nn.Module):
    """A small ResNet-like classifier: a stem and three stages of two blocks each."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        layers: list[nn.Module] = []
        cin = width
        for k, cout in enumerate((width, 2 * width, 4 * width)):
            layers += [Block(cin, cout, 1 if k == 0 else 2), Block(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LSTMLM(nn.Module):
    """An embedding, a 2-layer ``nn.LSTM`` (oneDNN on CPU) and a vocabulary projection."""

    def __init__(self, vocab: int, dim: int, hidden: int, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, hidden, num_layers=layers, batch_first=True, dropout=0.1)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(tokens))
        return self.out(h)


@dataclass
class Built:
    """A built model: the module, its loss on its batch (made once, before any session) and
    its sizes in words."""

    model: nn.Module
    loss: LOSS
    sizes: str


@dataclass
class ModelSpec:
    """A model to measure: ``build(quick)`` makes it (smaller with ``quick``)."""

    name: str
    what: str
    build: Callable[[bool], Built]
    autocast: bool = False


def _tokens(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def _causal_lm(cls_name: str, config_name: str, quick: bool, **extra: Any) -> Built:
    """A Llama-family causal LM (Qwen2, Mistral) with SDPA attention, labels = inputs."""
    import transformers

    layers, batch, seq = (2, 4, 128) if quick else (4, 8, 256)
    cfg = getattr(transformers, config_name)(
        vocab_size=4000, hidden_size=128, intermediate_size=384, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **extra)
    model = getattr(transformers, cls_name)._from_config(cfg, attn_implementation="sdpa")
    ids = _tokens(batch, seq, cfg.vocab_size)
    return Built(model, lambda m: m(input_ids=ids, labels=ids).loss,
                 f"{layers} layers, hidden 128, FFN 384, 4 heads / 2 KV heads, vocabulary 4000; "
                 f"batch {batch} × {seq} tokens")


def build_qwen2(quick: bool) -> Built:
    return _causal_lm("Qwen2ForCausalLM", "Qwen2Config", quick)


def build_mistral(quick: bool) -> Built:
    return _causal_lm("MistralForCausalLM", "MistralConfig", quick, sliding_window=None)


def build_vit(quick: bool) -> Built:
    from transformers import ViTConfig, ViTForImageClassification

    layers, batch = (2, 8) if quick else (4, 32)
    cfg = ViTConfig(image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=layers,
                    num_attention_heads=4, intermediate_size=384, num_labels=10,
                    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = ViTForImageClassification._from_config(cfg, attn_implementation="eager")
    x = torch.randn(batch, 3, 64, 64)
    y = torch.randint(0, 10, (batch,))
    return Built(model, lambda m: m(pixel_values=x, labels=y).loss,
                 f"{layers} layers, hidden 128, FFN 384, 4 heads, eager attention, hidden and "
                 f"attention dropout 0.1; batch {batch} × 3×64×64 (patch 8: 65 tokens), "
                 "10 classes")


def _seq2seq_batch(quick: bool, vocab: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    batch = 4 if quick else 8
    return batch, _tokens(batch, 128, vocab), _tokens(batch, 64, vocab)


def build_t5(quick: bool) -> Built:
    from transformers import T5Config, T5ForConditionalGeneration

    layers = 2 if quick else 3
    cfg = T5Config(vocab_size=4000, d_model=128, d_kv=32, d_ff=384, num_layers=layers,
                   num_decoder_layers=layers, num_heads=4, dropout_rate=0.1,
                   decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration._from_config(cfg)
    batch, src, tgt = _seq2seq_batch(quick, cfg.vocab_size)
    return Built(model, lambda m: m(input_ids=src, labels=tgt).loss,
                 f"{layers}+{layers} layers, d_model 128, FFN 384, 4 heads, dropout 0.1, "
                 f"vocabulary 4000; batch {batch}, 128 source → 64 target tokens")


def build_bart(quick: bool) -> Built:
    from transformers import BartConfig, BartForConditionalGeneration

    layers = 2 if quick else 3
    cfg = BartConfig(vocab_size=4000, d_model=128, encoder_layers=layers,
                     decoder_layers=layers, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=384, decoder_ffn_dim=384,
                     max_position_embeddings=256, dropout=0.1, attention_dropout=0.1)
    model = BartForConditionalGeneration._from_config(cfg, attn_implementation="sdpa")
    batch, src, tgt = _seq2seq_batch(quick, cfg.vocab_size)
    return Built(model, lambda m: m(input_ids=src, labels=tgt).loss,
                 f"{layers}+{layers} layers, d_model 128, FFN 384, 4 heads, SDPA, dropout and "
                 f"attention dropout 0.1, vocabulary 4000; batch {batch}, 128 source → 64 "
                 "target tokens")


def build_cnn(quick: bool) -> Built:
    width, batch, side = (16, 8, 32) if quick else (32, 16, 64)
    model = InplaceCNN(width=width)
    x = torch.randn(batch, 3, side, side)
    y = torch.randint(0, 10, (batch,))
    return Built(model, lambda m: F.cross_entropy(m(x), y),
                 f"stem + 3 stages × 2 basic blocks, widths {width}/{2 * width}/{4 * width}; "
                 f"batch {batch} × 3×{side}×{side}, 10 classes")


def build_lstm(quick: bool) -> Built:
    vocab, hidden, batch, steps = 4000, 128 if quick else 256, 8 if quick else 16, \
        32 if quick else 64
    model = LSTMLM(vocab, 128, hidden)
    tokens = _tokens(batch, steps + 1, vocab)
    inp, target = tokens[:, :-1], tokens[:, 1:]
    return Built(model, lambda m: F.cross_entropy(m(inp).flatten(0, 1), target.flatten()),
                 f"embedding 128, 2 layers of hidden {hidden} (dropout 0.1 between them), "
                 f"vocabulary {vocab}; batch {batch} × {steps} steps")


MODELS = [
    ModelSpec("qwen2-sdpa", "Qwen2ForCausalLM, SDPA attention", build_qwen2),
    ModelSpec("vit-dropout", "ViTForImageClassification with dropout (the zoo's ViT-B/16 "
              "has none)", build_vit),
    ModelSpec("t5", "T5ForConditionalGeneration (relative position biases)", build_t5),
    ModelSpec("cnn-inplace", "residual CNN of this file: nn.ReLU(inplace=True), BatchNorm, "
              "`out += identity`", build_cnn),
    ModelSpec("lstm-lm", "nn.LSTM language model (oneDNN kernel, not unrolled)", build_lstm),
    ModelSpec("mistral-bf16", "MistralForCausalLM (Llama-like), SDPA, trained under "
              "torch.autocast(\"cpu\", dtype=torch.bfloat16)", build_mistral, autocast=True),
    ModelSpec("bart", "BartForConditionalGeneration, SDPA attention", build_bart),
]


# ---------------------------------------------------------------------------- one step
class Case:
    """A model, its optimizer and its batch, with the state every attempt starts from."""

    def __init__(self, spec: ModelSpec, quick: bool) -> None:
        torch.manual_seed(0)
        self.spec = spec
        built = spec.build(quick)
        self.model, self.loss, self.sizes = built.model, built.loss, built.sizes
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        self.phase = "-"
        self.step()  # makes the optimizer state
        self.model_state = copy.deepcopy(self.model.state_dict())
        self.opt_state = copy.deepcopy(self.opt.state_dict())

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def reset(self) -> None:
        """Load the snapshot (outside any session), drop the gradients, reseed the RNG."""
        self.model.load_state_dict(self.model_state)
        self.opt.load_state_dict(copy.deepcopy(self.opt_state))
        self.opt.zero_grad(set_to_none=True)
        torch.manual_seed(1)

    def state(self) -> list[torch.Tensor]:
        """What the program holds for the whole step: parameters, buffers, optimizer state."""
        opt_state = [v for st in self.opt.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor)]
        return [*self.model.parameters(), *self.model.buffers(), *opt_state]

    def step(self) -> None:
        """Forward, backward and the AdamW step (``phase`` says which is running)."""
        self.phase = "forward"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.spec.autocast):
            loss = self.loss(self.model)
        self.phase = "backward"
        loss.backward()
        del loss
        self.phase = "optimizer"
        self.opt.step()
        self.phase = "-"


# ---------------------------------------------------------------------------- failures
@dataclass
class Failure:
    """What the engine held when an op could not fit (bytes by category)."""

    op: str
    phase: str
    remat: bool  # the op that failed was a recomputation
    request: int
    needed: int
    unevictable: int
    budget: int
    largest_free: int  # the largest free block the pool could give (< request: fragmentation)
    resident: int  # the sum over the resident storages found
    records_seen: bool  # gc.get_objects() found the engine's Storage records
    parts: dict[str, int] = field(default_factory=dict)
    other_pinned: Counter[str] = field(default_factory=Counter)
    locked: Counter[str] = field(default_factory=Counter)
    locked_items: list[tuple[int, str]] = field(default_factory=list)  # (bytes, op and shape)
    op_inputs: int = -1  # resident bytes of the failing op's input storages (-1: not found)
    op_inputs_extra: int = -1  # of which outside the floor (not params, grads, opt state)
    # the excess beyond the op's inputs by category: "locked" (inputs of the ops waiting on
    # this one), "other pinned", "inputs/leaves"
    beyond: Counter[str] = field(default_factory=Counter)

    @property
    def floor(self) -> int:
        return sum(self.parts.get(k, 0) for k in FLOOR)

    @property
    def pinned_locked(self) -> int:
        return self.resident

    @property
    def excess(self) -> int:
        return self.resident - self.floor

    @property
    def beyond_inputs(self) -> int:
        """The excess that is not the failing op's own inputs (those outside the floor)."""
        return self.excess - max(self.op_inputs_extra, 0)

    @property
    def fragmented(self) -> bool:
        """The budget had room for the request, but not in one block."""
        return self.needed <= self.budget


def op_name(op: object) -> str:
    """``aten.mm.default`` -> ``mm``."""
    text = str(op)
    parts = text.split(".")
    if len(parts) == 3 and parts[0] == "aten":
        return parts[1] if parts[2] == "default" else f"{parts[1]}.{parts[2]}"
    return text


def producer_name(s: Storage) -> str:
    """The op that made ``s`` (its base tensor's producer), or "leaf"."""
    if not s.tensors:
        return "?"
    p = s.tensors[0].producer
    return "leaf" if p is None else op_name(p.op)


def shape_of(s: Storage) -> str:
    """The shape and dtype of the base tensor of ``s``, as ``[4, 65, 65] float32``."""
    meta = s.tensors[0].meta if s.tensors else None
    if not isinstance(meta, tuple):
        return "(not run yet)"
    return f"[{', '.join(map(str, meta[0]))}] {str(meta[3]).removeprefix('torch.')}"


def engine_records() -> Iterator[object]:
    """Every object the cyclic collector tracks (the compiled records included)."""
    return iter(gc.get_objects())


def leaf_categories(session: Session, case: Case) -> dict[Storage, str]:
    """The category of each storage the program's state lives in."""
    params = {id(p) for p in case.model.parameters()}
    state = {id(v) for st in case.opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor)}
    kind: dict[Storage, str] = {}
    handles: dict[int, Any] = {}
    for plain, h in session.leaves.by_view.values():
        handles[id(plain)] = h
        cat = "params" if id(plain) in params else "opt state" if id(plain) in state else \
            "inputs/leaves"
        kind.setdefault(h.storage, cat)
    for p in case.model.parameters():
        g = p.grad
        if g is None:
            continue
        h = g._ref.handle if type(g) is RematTensor else handles.get(id(g))
        if h is not None:
            kind[h.storage] = "grads"
    return kind


def breakdown(session: Session, case: Case, e: membudget.BudgetTooSmallError) -> Failure:
    """What was resident when ``e`` was raised (called inside the session, see the module)."""
    kind = leaf_categories(session, case)
    storages: list[Storage] = []
    paths: list[ComputePath] = []
    for o in engine_records():
        t = type(o)
        if t is Storage:
            storages.append(o)  # type: ignore[arg-type]
        elif t is ComputePath and o.op is e.op:  # type: ignore[attr-defined]
            paths.append(o)  # type: ignore[arg-type]
    f = Failure(op_name(e.op), case.phase, False, e.request_bytes, e.needed_bytes,
                e.unevictable_bytes, int(e.budget_bytes), int(e.largest_free_bytes), 0,
                bool(storages))
    parts: Counter[str] = Counter()
    outside: dict[Storage, str] = {}  # resident storages outside the floor, by category
    for s in storages:
        if not s.resident or s.nbytes == 0:
            continue
        f.resident += s.nbytes
        cat = kind.get(s)
        if cat is None:
            cat = "other pinned" if s.pinned else "locked"
        parts[cat] += s.nbytes
        if cat not in FLOOR:
            outside[s] = cat
        if cat == "other pinned":
            f.other_pinned[producer_name(s)] += s.nbytes
        elif cat == "locked":
            own = s.tensors and s.tensors[0].producer is not None \
                and s.tensors[0].producer.op is e.op
            name = producer_name(s) + (" (its own outputs)" if own else "")
            f.locked[name] += s.nbytes
            f.locked_items.append((s.nbytes, f"{name} {shape_of(s)}"))
    f.parts = dict(parts)
    f.locked_items.sort(reverse=True)
    if paths:
        path = paths[-1]
        f.remat = any(t.storage.evicted for t in path.outputs or ())
        ins = {t.storage for t in path.inputs if t.storage.resident}
        f.op_inputs = sum(s.nbytes for s in ins)
        f.op_inputs_extra = sum(s.nbytes for s in ins if kind.get(s) not in FLOOR)
        for s, cat in outside.items():
            if s not in ins:
                f.beyond[cat] += s.nbytes
    return f


# ---------------------------------------------------------------------------- attempts
@dataclass
class Attempt:
    """One step under one budget."""

    ratio: float
    ok: bool
    wall: float
    overhead: float = 0.0  # remat_seconds / op_seconds
    thrashed: bool = False
    stopped: bool = False  # the engine's remat_cost_limit stopped it
    failure: Failure | None = None


def run_step(case: Case, budget: int, policy: str, cost_limit: float | None = None
             ) -> tuple[SessionStats, float, Failure | None, bool]:
    """One step in one session: its stats, wall time, failure breakdown (if it ran out) and
    whether the recomputation cost limit stopped it."""
    case.reset()
    collect()
    failure: Failure | None = None
    stopped = False
    t0 = time.perf_counter()
    session = membudget.budget(budget, policy)
    try:
        with session as s:
            if cost_limit is not None:
                s.engine.remat_cost_limit = cost_limit
            s.adopt(case.state())
            try:
                case.step()
            except membudget.BudgetTooSmallError as e:
                failure = breakdown(s, case, e)
                raise
    except membudget.BudgetTooSmallError:
        pass
    except membudget.Thrashed:
        stopped = True
    wall = time.perf_counter() - t0
    collect()
    return session.stats, wall, failure, stopped


def collect() -> None:
    """Collect garbage until none is left: one pass can leave a finished session's engine
    and its records alive (the wrappers' finalizers release them during that pass), and
    ``breakdown`` would then count that engine's resident records too."""
    while gc.collect():
        pass


def attempt(case: Case, policy: str, ratio: float, peak: int, base_wall: float,
            base_cost: float) -> Attempt:
    """One step at ``ratio`` × the unlimited peak."""
    stats, wall, failure, stopped = run_step(case, int(ratio * peak), policy,
                                             THRASH_COST * base_cost * 1e9)
    ok = failure is None and not stopped
    a = Attempt(ratio, ok, wall, failure=failure, stopped=stopped)
    if ok:
        a.overhead = stats.remat_seconds / stats.op_seconds if stats.op_seconds else 0.0
        if wall > THRASH_WALL * base_wall:
            a.ok, a.thrashed = False, True
    return a


@dataclass
class Search:
    """The bisection of one model under one policy."""

    policy: str
    attempts: dict[float, Attempt] = field(default_factory=dict)
    smallest: Attempt | None = None
    below: Attempt | None = None  # the attempt at the grid point just below ``smallest``


def bisect(case: Case, policy: str, peak: int, base_wall: float, base_cost: float,
           log: Callable[[str], None]) -> Search:
    """The smallest completing ratio on :data:`GRID`, by bisection."""
    search = Search(policy)

    def run(k: int) -> bool:
        a = attempt(case, policy, GRID[k], peak, base_wall, base_cost)
        search.attempts[GRID[k]] = a
        log(f"  {policy:6} ratio {GRID[k]:.2f}: {describe(a)}")
        return a.ok

    lo, hi = -1, len(GRID) - 1  # GRID[lo] fails (-1: none tried), GRID[hi] completes
    if not run(hi):
        return search
    while hi - lo > 1:
        mid = (lo + hi + 1) // 2 if lo >= 0 else (hi + 1) // 2
        if run(mid):
            hi = mid
        else:
            lo = mid
    search.smallest = search.attempts[GRID[hi]]
    if lo >= 0:
        search.below = search.attempts[GRID[lo]]
    return search


def describe(a: Attempt) -> str:
    """A progress line's account of one attempt."""
    if a.ok:
        return f"ok in {a.wall:.2f} s, overhead {a.overhead:.2f}"
    if a.thrashed:
        return f"thrashed ({a.wall:.1f} s, overhead {a.overhead:.2f})"
    if a.stopped:
        return f"stopped by remat_cost_limit after {a.wall:.1f} s"
    f = a.failure
    assert f is not None
    return (f"too small at {f.op} ({f.phase}{', remat' if f.remat else ''}), "
            f"needs {f.needed / MiB:.2f} MiB, pinned+locked {f.resident / MiB:.2f} MiB, "
            f"floor {f.floor / MiB:.2f} MiB ({a.wall:.2f} s)")


# ---------------------------------------------------------------------------- per model
@dataclass
class Result:
    """A model's measurements under every policy."""

    spec: ModelSpec
    sizes: str
    param_bytes: int
    peak: int
    base_wall: float
    eager_wall: float
    searches: list[Search]


def measure(spec: ModelSpec, quick: bool, policies: list[str],
            log: Callable[[str], None]) -> Result:
    """The unlimited peak (the second of two unlimited session steps: the first sizes and
    times every op), then one bisection per policy."""
    case = Case(spec, quick)
    case.reset()
    t0 = time.perf_counter()
    case.step()
    eager = time.perf_counter() - t0
    first, _, _, _ = run_step(case, UNLIMITED, "dtr-eq")
    stats, wall, failure, _ = run_step(case, UNLIMITED, "dtr-eq")
    assert failure is None
    log(f"{spec.name}: params {case.param_bytes / MiB:.2f} MiB, peak "
        f"{stats.peak_bytes / MiB:.2f} MiB (first unlimited step {first.peak_bytes / MiB:.2f}), "
        f"eager step {eager:.2f} s, unlimited session step {wall:.2f} s")
    searches = [bisect(case, p, stats.peak_bytes, wall, stats.op_seconds, log)
                for p in policies]
    return Result(spec, case.sizes, case.param_bytes, stats.peak_bytes, wall, eager, searches)


# ---------------------------------------------------------------------------- report
def mib(n: int | float) -> str:
    return f"{n / MiB:.2f}"


def top(c: Counter[str], n: int = 3) -> str:
    return ", ".join(f"{k} {v / MiB:.2f}" for k, v in c.most_common(n)) or "—"


COLUMNS = ["model", "policy", "params MiB", "peak MiB", "smallest ratio", "overhead",
           "failing op below", "pinned+locked MiB", "floor MiB", "excess MiB", "request MiB",
           "op inputs MiB", "excess beyond op inputs MiB",
           "of which: waiting ops' inputs / other pinned / batch and leaves MiB",
           "what is locked (MiB)", "other pinned (MiB)"]
TEXT_COLUMNS = {"model", "policy", "failing op below", "what is locked (MiB)",
                "other pinned (MiB)"}


def row(r: Result, s: Search) -> str:
    """One table row: a model under one policy."""
    cells = [r.spec.name, s.policy, mib(r.param_bytes), mib(r.peak)]
    blank = [""] * (len(COLUMNS) - 7)
    if s.smallest is None:
        cells += ["does not complete at 1.0", "", "", *blank]
        return "| " + " | ".join(cells) + " |"
    a, b = s.smallest, s.below
    cells += [f"{a.ratio:.2f}", f"{a.overhead:.2f}"]
    f = b.failure if b is not None else None
    if b is None:
        cells += ["— (the lowest ratio completes)", *blank]
    elif f is None:
        what = "thrashed" if b.thrashed else "stopped by remat_cost_limit"
        cells += [f"{what} at {b.ratio:.2f} ({b.wall:.1f} s)", *blank]
    else:
        frag = (f"; fragmentation: largest free block {mib(f.largest_free)}"
                if f.fragmented else "")
        cells += [f"`{f.op}` ({f.phase}{', remat' if f.remat else ''}{frag})",
                  mib(f.resident), mib(f.floor), mib(f.excess), mib(f.request),
                  "—" if f.op_inputs < 0 else mib(f.op_inputs), mib(f.beyond_inputs),
                  " / ".join(mib(f.beyond[k]) for k in BEYOND),
                  top(f.locked), top(f.other_pinned)]
    return "| " + " | ".join(cells) + " |"


def detail(r: Result, s: Search) -> list[str]:
    """The full breakdown at the failing ratio below the smallest completing one."""
    b = s.below
    if b is None or b.failure is None:
        return []
    f = b.failure
    parts = ", ".join(f"{k} {mib(v)}" for k, v in sorted(f.parts.items()))
    inputs = ("not found" if f.op_inputs < 0 else
              f"{mib(f.op_inputs)} MiB resident, {mib(f.op_inputs_extra)} MiB of them outside "
              "the floor")
    frag = (f" The pool had {mib(f.budget - f.unevictable)} MiB free but its largest block "
            f"was {mib(f.largest_free)} MiB." if f.fragmented else "")
    return [f"- **{r.spec.name} / {s.policy}** at {b.ratio:.2f} (budget {mib(f.budget)} MiB): "
            f"`{f.op}` in the {f.phase}{' (a recomputation)' if f.remat else ''} asked "
            f"{mib(f.request)} MiB with {mib(f.unevictable)} MiB unevictable (found resident: "
            f"{mib(f.resident)}); {parts}. Other pinned by op: {top(f.other_pinned, 5)}. "
            f"Locked by op: {top(f.locked, 5)}; the largest locked storages: "
            f"{items(f.locked_items)}. The op's inputs: {inputs}.{frag}"]


def items(pairs: list[tuple[int, str]], n: int = 6) -> str:
    """The first ``n`` of (bytes, what) pairs, as "what MiB, ..."."""
    text = ", ".join(f"{what} {mib(nbytes)}" for nbytes, what in pairs[:n]) or "—"
    return text + (f" and {len(pairs) - n} more" if len(pairs) > n else "")


def observations(results: list[Result]) -> list[str]:
    """What the failures have in common, in words (from the breakdowns)."""
    below = [(r, s, s.below.failure) for r in results for s in r.searches
             if s.below is not None and s.below.failure is not None]
    tight = [f"{r.spec.name}/{s.policy}" for r, s, f in below
             if f.beyond_inputs < 0.1 * MiB and not f.fragmented]
    wide = [(r, s, f) for r, s, f in below if f.beyond_inputs > f.request]
    frag = [(r, s, f) for r, s, f in below if f.fragmented]
    out = []
    if tight:
        out.append(f"- Tight ({len(tight)} of {len(below)}): the excess over the floor is the "
                   "failing op's own inputs (pinned+locked = floor + its inputs, and it needs "
                   "its request on top) and the pool is not fragmented: no policy can go lower "
                   "at that op without splitting it. "
                   + ", ".join(tight) + ".")
    for r, s, f in wide:
        b = f.beyond
        out.append(f"- **{r.spec.name}/{s.policy}**: {mib(f.beyond_inputs)} MiB beyond floor "
                   f"and op inputs, {f.beyond_inputs / f.request:.1f}× the request of "
                   f"`{f.op}` ({mib(f.request)} MiB): {mib(b['locked'])} locked as inputs of "
                   f"the ops waiting on this recomputation, {mib(b['other pinned'])} other "
                   f"pinned ({top(f.other_pinned)}), {mib(b['inputs/leaves'])} the batch and "
                   f"other leaves; locked then: {items(f.locked_items, 8)}.")
    if frag:
        out.append(f"- Fragmentation ({len(frag)} of {len(below)}; needed ≤ budget, no block "
                   "large enough): " + "; ".join(
                       f"{r.spec.name}/{s.policy} {mib(f.budget - f.unevictable)} MiB free, "
                       f"largest block {mib(f.largest_free)} for {mib(f.request)}"
                       for r, s, f in frag) + ".")
    return out


def report(results: list[Result], quick: bool, seconds: float, command: str,
           malloc_kept: bool) -> str:
    """The markdown report."""
    import transformers

    failures = [a.failure for r in results for s in r.searches for a in s.attempts.values()
                if a.failure is not None]
    seen = all(f.records_seen for f in failures)
    off = [f for f in failures if f.resident != f.unevictable]
    check = ("n/a (no failure)" if not failures else
             f"{'yes' if seen else 'NO'}; in {len(failures) - len(off)} of {len(failures)} "
             "failures their resident bytes summed to the error's `unevictable_bytes` exactly"
             + ("" if not off else " (off in: " + ", ".join(
                 f"{f.op} {mib(f.resident)} vs {mib(f.unevictable)}" for f in off[:5]) + ")")
            + ("" if not off else
               "; the breakdown is taken where the program catches the error, after the "
               "engine's recomputation frames and autograd have let go of what they held "
               "(in the CNN, a gradient in flight that a waiting op held locked)"))
    lines = [
        "# Live models: smallest completing budget and what fills memory at the failure", "",
        f"- date: {datetime.date.today().isoformat()}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; {torch.get_num_threads()} intra-op thread(s); "
        f"{git_state(Path(__file__).resolve().parent.parent)}; "
        f"core {'compiled (mypyc)' if COMPILED else 'interpreted'}",
        f"- glibc malloc {'told to keep freed memory (mallopt)' if malloc_kept else 'as is'}; "
        "one intra-op thread by default (`--threads`): with two, the other jobs on this "
        "shared 2-core machine made steps swing by up to 30×",
        f"- command: `{command}` ({'quick' if quick else 'full'} run, {seconds / 60:.1f} min)",
        "- one step = forward + backward + AdamW(foreach=True) step in one session; "
        "parameters, buffers and optimizer state adopted as the session starts; ratio = "
        "budget / the step's peak in a session without a limit; bisection on a 0.02 grid in "
        "[0.05, 1.0]; overhead = remat_seconds / op_seconds at the smallest completing ratio",
        "- the failure columns are at the grid point just below (smallest − 0.02): "
        "pinned+locked = bytes resident at the failure (all pinned or locked), floor = "
        "parameters + gradients + optimizer state resident then (gradients only as far as "
        "the backward had made them), excess = the rest; request = the failing op's "
        "`request_bytes`; op inputs = resident bytes of its input storages; excess beyond "
        "op inputs = excess − its inputs outside the floor; of which waiting ops' inputs = "
        "locked storages that are not the failing op's inputs: inputs of the ops whose "
        "recomputation (or run) waits on this one, locked since an op needs all its inputs "
        "at once; other pinned = pinned storages outside the floor, in the backward the "
        "values it made (gradients in flight, pinned by the runtime), batch and leaves = the "
        "batch and buffers (each of the three not the failing op's inputs); locked / other pinned "
        "= top producing ops; \"remat\": the failing op was a recomputation; "
        "\"fragmentation\": the budget had room for the request but no block that large "
        "(coop's two-sided pool)",
        "- the sessions price ops with the cost model (`cost=\"model\"`, the default), so "
        "the same budget makes the same decisions on every run; \"overhead\" is measured",
        f"- the engine's compiled `Storage` records seen by gc.get_objects(): {check}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if c in TEXT_COLUMNS else "---:" for c in COLUMNS) + "|",
    ]
    lines += [row(r, s) for r in results for s in r.searches]
    lines += ["", "## Reading the table", "", *observations(results)]
    lines += ["", "## Models", ""]
    lines += [f"- **{r.spec.name}**: {r.spec.what}; {r.sizes}; eager step {r.eager_wall:.2f} s, "
              f"unlimited session step {r.base_wall:.2f} s" for r in results]
    lines += ["", "## Breakdowns at the failure", ""]
    lines += [x for r in results for s in r.searches for x in detail(r, s)]
    lines += ["", "## Every attempt", ""]
    for r in results:
        for s in r.searches:
            runs = "; ".join(f"{k:.2f} {describe(a)}" for k, a in sorted(s.attempts.items()))
            lines.append(f"- {r.spec.name} / {s.policy}: {runs}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller models, a smoke run")
    ap.add_argument("--models", default=",".join(m.name for m in MODELS),
                    help="comma-separated subset of: " + ", ".join(m.name for m in MODELS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    malloc_kept = keep_freed_memory()
    wanted = args.models.split(",")
    specs = [m for m in MODELS if m.name in wanted]
    t0 = time.perf_counter()
    results = []
    for spec in specs:
        results.append(measure(spec, args.quick, args.policies.split(","),
                               lambda line: print(line, flush=True)))
    seconds = time.perf_counter() - t0
    text = report(results, args.quick, seconds, "python benchmarks/live_models.py " +
                  " ".join(sys.argv[1:]), malloc_kept)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
