"""How long DTR's exact eviction search takes where evicted values form long chains.

A transformers RWKV (a recurrent model: each time step's values feed the next) trained with
AdamW near the least budget at which dtr-eq completes: tens of thousands of ops, thousands
of evictions, and evicted regions of a hundred values or more around each candidate. Each row
runs two steps in one session per step (the second with AdamW's state) and reports the
second: its wall time, the policy's search time per eviction (median and 99th percentile),
evictions and recomputed ops. ``dtr`` and ``dtr-compact`` (the default) score the exact
evicted neighbourhood e*(S); ``dtr-eq`` approximates it with union-find classes, the cheap
peer. Rows run in turn in one process, interleaved over ``--rounds``, so that each policy's
figure shares the machine's noise; decisions do not depend on timing (cost model pinned).

Run: python benchmarks/search_speed.py [--ratio 0.45] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("MEMBUDGET_CPU_SPEC",
                      str(Path(__file__).resolve().parent.parent / "tests/data/cpu-spec.json"))

import torch

import membudget
from membudget.bench.meter import StorageMeter

POLICIES = ["dtr-eq", "dtr", "default"]


def rwkv():
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(0)
    cfg = RwkvConfig(vocab_size=512, hidden_size=64, num_hidden_layers=3,
                     attention_hidden_size=64, intermediate_size=128, context_length=64)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(3))
    return RwkvForCausalLM(cfg), ids


def eager_peak(model, ids) -> int:
    """The eager peak of a whole step (forward, backward, AdamW), by StorageMeter."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with StorageMeter() as meter:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return meter.peak_bytes


def second_step(model, ids, budget: int, policy: str) -> tuple[float, dict]:
    """Two steps, a session each; the second's wall time and stats."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with membudget.budget(budget, policy) as session:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        seconds = time.perf_counter() - t0
    st = session.stats
    return seconds, {"p50": st.search_us["p50"], "p99": st.search_us["p99"],
                     "evictions": st.evictions, "remat_ops": st.remat_ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ratio", type=float, default=0.45, help="budget / eager peak")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, ids = rwkv()
    budget = int(eager_peak(model, ids) * args.ratio)
    seconds: dict[str, list[float]] = {p: [] for p in POLICIES}
    last: dict[str, dict] = {}
    for _ in range(args.rounds):
        for policy in POLICIES:
            s, last[policy] = second_step(model, ids, budget, policy)
            seconds[policy].append(s)
    print(f"RWKV (3 layers, 64 wide, 4 x 64 tokens), AdamW, {args.ratio:g} x its eager peak "
          f"({budget:,} B); the second step, median of {args.rounds} rounds\n")
    print("| policy | step s | search p50 ms | search p99 ms | evictions | recomputed ops |")
    print("|---|---:|---:|---:|---:|---:|")
    for policy in POLICIES:
        f = last[policy]
        print(f"| {policy} | {statistics.median(seconds[policy]):.2f} | {f['p50'] / 1e3:.2f} | "
              f"{f['p99'] / 1e3:.2f} | {f['evictions']:,} | {f['remat_ops']:,} |")


if __name__ == "__main__":
    main()
