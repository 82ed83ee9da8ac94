"""``membudget demo``: train a small GPT-2 for a few steps under a budget, beside an
unconstrained run, and show that the losses agree while the peak stays within the budget.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from membudget.units import format_bytes


@dataclass
class StepResult:
    loss: float
    seconds: float
    evictions: int = 0
    remat_ops: int = 0
    peak_bytes: int = 0


def _gpt2(seed: int = 0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(n_embd=128, n_layer=4, n_head=4, n_positions=128, vocab_size=2000,
                        bos_token_id=0, eos_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPT2LMHeadModel(config)


def run_demo(ratio: float = 0.4, steps: int = 5, policy: str = "dtr", batch: int = 8,
             seq: int = 128, console: Console | None = None) -> tuple[list[StepResult],
                                                                   list[StepResult], int]:
    """Train ``steps`` AdamW steps twice from the same start, without a budget and under
    ``ratio`` × the unconstrained session peak; return both runs and the budget."""
    import torch

    import membudget

    console = console or Console(stderr=True, emoji=False)
    model = _gpt2()
    start = copy.deepcopy(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
               for _ in range(steps)]

    def train(budget: int | None, progress: Progress, label: str) -> list[StepResult]:
        model.load_state_dict(start)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        task = progress.add_task(label, total=steps)
        out = []
        for ids in batches:
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(2)  # the same dropout draws in both runs
            t0 = time.perf_counter()
            if budget is None:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                result = StepResult(float(loss.detach()), time.perf_counter() - t0)
            else:
                with membudget.budget(budget, policy) as session:
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                st = session.stats
                result = StepResult(float(loss.detach()), time.perf_counter() - t0,
                                    st.evictions, st.remat_ops, st.peak_bytes)
            opt.step()  # outside the budget: it writes the parameters in place
            out.append(result)
            progress.update(task, advance=1)
        return out

    # the unconstrained peak of a step, the second with the AdamW state the first made (alive
    # through its forward and backward, it counts from the start of the session)
    opt, peak = torch.optim.AdamW(model.parameters(), lr=1e-3), 0
    for ids in batches[:2]:
        with membudget.budget(10**12, policy) as free:
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak = max(peak, free.stats.peak_bytes)
    del opt
    budget = int(peak * ratio)
    bar = Progress(TextColumn("[bold]{task.description}[/]"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console)
    with bar:
        plain = train(None, bar, "unconstrained")
        limited = train(budget, bar, f"{policy} at {ratio:g} × peak")
    return plain, limited, budget


def demo_table(plain: list[StepResult], limited: list[StepResult], budget: int,
               policy: str, ratio: float) -> Table:
    table = Table(title=f"GPT-2 (4 layers, 128 wide) trained under {format_bytes(budget)} "
                        f"({ratio:g} × its unconstrained peak) with {policy}")
    for h in ("step", "loss, no budget", "loss, budget", "same", "peak", "evictions",
              "recomputed ops", "time ×"):
        table.add_column(h, justify="right")
    for k, (a, b) in enumerate(zip(plain, limited, strict=True), 1):
        table.add_row(str(k), f"{a.loss:.6f}", f"{b.loss:.6f}",
                      "yes" if a.loss == b.loss else "no", format_bytes(b.peak_bytes),
                      str(b.evictions), str(b.remat_ops), f"{b.seconds / a.seconds:.2f}")
    return table
