"""The default policy live, on five transformers models none of the tests use: does it
complete wherever dtr-eq does, and does it make the same decisions on every run?

Each model (random init from its config, no download) trains one step without a session
(the reference), then under budgets of 0.6, 0.4 and 0.3 of its unconstrained session peak
with `default` (dtr-compact on a best-fit pool), `dtr-eq` (fungible pool) and `coop`. A run
counts as completed when the loss and every gradient equal the reference bitwise. Then one
configuration runs again in fresh processes; each reports a digest of its pool's whole history
(every placement and free: evictions, recomputations and moves) and its counts.
Writes docs/results/address-aware-live.md.
Run: python benchmarks/address_aware_live.py [--repeats N] [--models …]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

import membudget
from membudget import BudgetTooSmallError

ROOT = Path(__file__).resolve().parents[1]
RATIOS = [0.6, 0.4, 0.3]
POLICIES = ["default", "dtr-eq", "coop"]
REPEAT = ("qwen2", 0.4)  # the configuration run again in fresh processes
SEQ, BATCH, VOCAB = 256, 8, 256


def _lm(config_cls: type, model_cls: type, **kw: object) -> Callable[[], tuple]:
    def build() -> tuple:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = model_cls(config_cls(vocab_size=VOCAB, **kw))
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        return model, lambda m: m(input_ids=ids, labels=ids).loss
    return build


MODELS: dict[str, Callable[[], tuple]] = {
    "qwen2": _lm(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, hidden_size=64,
                 intermediate_size=172, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=SEQ),
    "gpt-neox": _lm(transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM,
                    hidden_size=64, intermediate_size=256, num_hidden_layers=3,
                    num_attention_heads=4, max_position_embeddings=SEQ),
    "opt": _lm(transformers.OPTConfig, transformers.OPTForCausalLM, hidden_size=64,
               ffn_dim=256, num_hidden_layers=3, num_attention_heads=4,
               max_position_embeddings=SEQ, word_embed_proj_dim=64),
    "bart": _lm(transformers.BartConfig, transformers.BartForConditionalGeneration,
                d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256,
                max_position_embeddings=SEQ),
    "t5": _lm(transformers.T5Config, transformers.T5ForConditionalGeneration, d_model=64,
              d_ff=256, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4,
              decoder_start_token_id=0, pad_token_id=0),
}


def step(model: torch.nn.Module, loss_fn: Callable) -> tuple[torch.Tensor, list]:
    """One training step with fixed dropout draws: the loss and the gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def same(a: tuple, b: tuple) -> bool:
    """Bitwise equal losses and gradients."""
    return torch.equal(a[0], b[0]) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a[1], b[1], strict=True))


class PoolLog:
    """Every placement and free of the session's pool, in order (an allocation observer)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_alloc(self, s: object, b: object) -> None:
        self.events.append(("alloc", s.id, b.addr, b.size))  # type: ignore[attr-defined]

    def on_free(self, s: object, b: object) -> None:
        self.events.append(("free", s.id, b.addr, b.size))  # type: ignore[attr-defined]

    def on_segment(self, action: str, addr: int, size: int) -> None:
        self.events.append((action, addr, size))


def run(name: str, ratio: float, policy: str) -> dict:
    """One step of ``name`` under ``ratio`` × its unconstrained session peak."""
    model, loss_fn = MODELS[name]()
    state = copy.deepcopy(model.state_dict())
    ref = step(model, loss_fn)
    ref = (ref[0], [None if g is None else g.clone() for g in ref[1]])
    model.load_state_dict(state)
    with membudget.budget(10**11, "dtr-eq") as free:
        step(model, loss_fn)
    nbytes = int(free.stats.peak_bytes * ratio)
    model.load_state_dict(state)
    log = PoolLog()
    t0 = time.perf_counter()
    try:
        with membudget.budget(nbytes, policy) as session:
            if session.engine.allocator.has_layout:
                session.engine.allocator.observer = log
            out = step(model, loss_fn)
    except BudgetTooSmallError as e:
        return {"model": name, "ratio": ratio, "policy": policy, "status": "failed",
                "error": str(e).split(";")[0]}
    st = session.stats
    return {"model": name, "ratio": ratio, "policy": policy,
            "status": "ok" if same(out, ref) else "wrong gradients",
            "seconds": time.perf_counter() - t0, "evictions": st.evictions,
            "remat_ops": st.remat_ops, "moves": st.moves, "moved_bytes": st.moved_bytes,
            "peak_bytes": st.peak_bytes, "budget_bytes": nbytes,
            "pool_history": hashlib.sha256(repr(log.events).encode()).hexdigest()[:16]}


def fresh(name: str, ratio: float, policy: str) -> dict:
    """``run`` in a fresh Python process."""
    out = subprocess.run([sys.executable, __file__, "--one", name, str(ratio), policy],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "RATIO", "POLICY"),
                    help=argparse.SUPPRESS)  # (a fresh process of the repeats)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "address-aware-live.md"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run(args.one[0], float(args.one[1]), args.one[2])))
        return
    t0 = time.perf_counter()
    rows = []
    for name in args.models:
        for ratio in RATIOS:
            for policy in POLICIES:
                r = run(name, ratio, policy)
                rows.append(r)
                print(f"{name} @ {ratio} {policy}: {r['status']} "
                      f"{r.get('evictions', '')} {r.get('moves', '')}", file=sys.stderr)
    repeats = []
    for k in range(args.repeats):
        repeats.append(fresh(*REPEAT, "default"))
        print(f"repeat {k + 1}/{args.repeats}: {repeats[-1].get('pool_history')}",
              file=sys.stderr)
    wall = time.perf_counter() - t0

    def cell(r: dict) -> str:
        if r["status"] != "ok":
            return r["status"]
        moves = f", {r['moves']} moves" if r["moves"] else ""
        return f"ok: {r['evictions']} ev., {r['remat_ops']} remat{moves}"

    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
               f"Python {platform.python_version()}, torch {torch.__version__}, "
               f"transformers {transformers.__version__}")
    lines = ["# The default policy live on five transformers models", "",
             f"Produced by `python benchmarks/address_aware_live.py` on {date} ({machine}). "
             f"Wall time {wall:.0f} s.", "",
             "Models from their configs with random weights (hidden 64, 2-3 layers, "
             f"sequence {SEQ}, batch {BATCH}, vocabulary {VOCAB}); none is used by the tests. "
             "Budgets are fractions of the step's unconstrained session peak. A cell is ok "
             "when the loss and every gradient equal the reference run's bitwise; else the "
             "run ran out of budget (failed). ev.: evictions, remat: recomputed ops, moves: "
             "values copied to merge free blocks. Costs are the cost model's (the session's "
             "default `cost=\"model\"`).", "",
             "| model | ratio | " + " | ".join(POLICIES) + " |",
             "|---|---:|" + "---|" * len(POLICIES)]
    for name in args.models:
        for ratio in RATIOS:
            cells = [next(r for r in rows if r["model"] == name and r["ratio"] == ratio
                          and r["policy"] == p) for p in POLICIES]
            lines.append(f"| {name} | {ratio:g} | " + " | ".join(map(cell, cells)) + " |")
    default = [r for r in rows if r["policy"] == "default"]
    eq = {(r["model"], r["ratio"]): r for r in rows if r["policy"] == "dtr-eq"}
    misses = [f"{r['model']}@{r['ratio']:g}" for r in default
              if r["status"] != "ok" and eq[(r["model"], r["ratio"])]["status"] == "ok"]
    done_eq = sum(r["status"] == "ok" for r in eq.values())
    lines += ["", f"`default` completed {sum(r['status'] == 'ok' for r in default)} of "
              f"{len(default)} runs and dtr-eq {done_eq}; "
              + ("`default` completed every run dtr-eq completed." if not misses else
                 "runs dtr-eq completed and `default` did not: " + ", ".join(misses) + "."),
              "", f"## The same decisions on every run: {REPEAT[0]} at {REPEAT[1]:g}, "
              f"`default`, {len(repeats)} fresh processes", "",
              "| run | status | evictions | recomputed ops | moves | pool history digest |",
              "|---:|---|---:|---:|---:|---|"]
    for k, r in enumerate(repeats, 1):
        lines.append(f"| {k} | {r['status']} | {r.get('evictions', '—')} | "
                     f"{r.get('remat_ops', '—')} | {r.get('moves', '—')} | "
                     f"`{r.get('pool_history', '—')}` |")
    distinct = {json.dumps({k: v for k, v in r.items() if k != "seconds"}, sort_keys=True)
                for r in repeats}
    lines += ["", f"{len(distinct)} distinct outcome(s) in {len(repeats)} runs (every field "
              "but the wall time compared)."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
