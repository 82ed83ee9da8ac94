"""A session's steady-state GPT-2 step against the same step in an earlier revision's runtime.

Issue 19 asked that knowing sizes before an op runs keep the steady-state step within 2 % of
the runtime before it (revision b6f11d3, the parent of 5383280). This builds that revision's
compiled core in a temporary git worktree (mypyc, as ``pip install`` does), then runs
processes of the earlier and the current runtime in turn. Each process times a GPT-2 training
step (forward and backward, budget far above the peak, so nothing is evicted) in a session
and eagerly, in pairs whose order alternates, with one intra-op thread and glibc told to keep
freed memory; it prints the session / eager ratio of each pair. Ratios are compared, not
times: this machine's speed drifts between processes.

    python benchmarks/step_vs_revision.py                     # b6f11d3, 5 processes each
    python benchmarks/step_vs_revision.py --rev HEAD~3 --processes 3 --rounds 6

It needs mypy (``pip install mypy==2.4.1``) to build the earlier core, and git.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE_SIZES_FIRST = "b6f11d3"


def child(rounds: int, width: int) -> None:
    """One process: ``rounds`` paired session and eager steps; prints their ratios as JSON."""
    import gc
    import importlib.util
    import time
    import warnings

    # this checkout's membudget.bench.malloc, by path: the earlier revision's package, on
    # the path here, may not have it
    spec = importlib.util.spec_from_file_location(
        "_malloc", ROOT / "src" / "membudget" / "bench" / "malloc.py")
    assert spec is not None and spec.loader is not None
    malloc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(malloc)
    malloc.keep_freed_memory()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import membudget

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=width, n_layer=6, n_head=12, n_positions=256, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 50257, (4, 256))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(input_ids=ids, labels=ids).loss.backward()

    def session_step() -> None:
        with membudget.budget(10**11, "dtr-eq"):
            step()

    def timed(f: Callable[[], None]) -> float:
        gc.collect()
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    step()
    session_step()
    session_step()
    ratios = []
    for k in range(rounds):
        if k % 2:
            s = timed(session_step)
            e = timed(step)
        else:
            e = timed(step)
            s = timed(session_step)
        ratios.append(s / e)
    print(json.dumps({"ratios": ratios, "membudget": membudget.__file__}))


def build(rev: str, where: Path) -> Path:
    """A worktree of ``rev`` at ``where`` with its core compiled in place; its ``src``."""
    try:
        import mypy  # noqa: F401
    except ImportError:
        sys.exit("error: building the earlier core needs mypy: pip install mypy==2.4.1")
    steps = [(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(where), rev],
              ROOT, f"check out {rev}"),
             ([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], where,
              f"build {rev}'s core with mypyc")]
    for command, cwd, what in steps:
        print(f"{what} ...", flush=True)
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
        if done.returncode:
            lines = (done.stderr or done.stdout).strip().splitlines()
            sys.exit(f"error: could not {what}: {lines[-1] if lines else done.returncode}")
    return where / "src"


def run(src: Path, rounds: int, width: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(rounds),
                          "--width", str(width)], env=env, check=True, capture_output=True,
                         text=True, cwd=tempfile.gettempdir())
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["membudget"].startswith(str(src)), result["membudget"]
    return result["ratios"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default=BEFORE_SIZES_FIRST, help="the earlier revision")
    ap.add_argument("--processes", type=int, default=5, help="processes of each runtime")
    ap.add_argument("--rounds", type=int, default=8, help="paired steps per process")
    ap.add_argument("--width", type=int, default=768, help="GPT-2's n_embd")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.rounds, a.width)
        return
    current = ROOT / "src"
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "earlier"
        try:
            earlier = build(a.rev, where)
            runs: dict[str, list[list[float]]] = {"earlier": [], "current": []}
            for k in range(a.processes):
                for name, src in (("earlier", earlier), ("current", current)):
                    runs[name].append(run(src, a.rounds, a.width))
                    print(f"process {k + 1}/{a.processes} {name}: median session / eager "
                          f"{statistics.median(runs[name][-1]):.4f}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(where)], capture_output=True)
    print(f"\nGPT-2 (n_embd {a.width}, 6 layers, batch 4 x 256), one thread, budget 10^11 B "
          f"(no eviction), dtr-eq; {a.processes} processes x {a.rounds} paired steps each")
    print("| runtime | process medians | median of them | median of all pairs |")
    print("|---|---|---:|---:|")
    summary = {}
    for name, label in (("earlier", a.rev), ("current", "this checkout")):
        meds = [statistics.median(r) for r in runs[name]]
        pooled = statistics.median([x for r in runs[name] for x in r])
        summary[name] = (statistics.median(meds), pooled)
        print(f"| {label} | {' '.join(f'{m:.3f}' for m in meds)} | {summary[name][0]:.4f} | "
              f"{pooled:.4f} |")
    (m0, p0), (m1, p1) = summary["earlier"], summary["current"]
    print(f"\ncurrent / earlier step: {m1 / m0:.4f} (medians of process medians), "
          f"{p1 / p0:.4f} (medians of all pairs); target <= 1.02")


if __name__ == "__main__":
    main()
