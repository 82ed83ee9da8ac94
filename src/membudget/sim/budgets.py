"""The minimum budget (smallest ratio that completes) and the cutoff budget (largest ratio
with at least one eviction), found by bisection on the budget ratio."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from membudget.core.engine import Engine
from membudget.core.records import Tensor
from membudget.sim.replay import replay
from membudget.sim.simulate import (
    DEFAULT_OVERHEAD_LIMIT,
    Baseline,
    SimResult,
    measure_baseline,
    simulate,
)
from membudget.trace.format import Trace

MAX_RATIO = 4.0  # a layout-aware pool may need more than the fungible peak


class _LargestOp:
    """Call hooks that keep the most bytes one call held: its inputs and outputs."""

    def __init__(self) -> None:
        self.most = 0

    def before_call(self, k: int) -> None:
        pass

    def after_call(self, k: int, inputs: list[Tensor], results: list[Tensor]) -> None:
        held = {t.storage for t in inputs} | {t.storage for t in results}
        self.most = max(self.most, sum(s.nbytes for s in held))


def op_floor(trace: Trace) -> int:
    """The most bytes one op of ``trace`` holds at once, its distinct inputs and outputs
    (a new version of a value it writes included): no budget below this completes,
    whatever is recomputed or swapped."""
    hooks = _LargestOp()
    replay(Engine(math.inf, "lru"), trace.events, trace.path, hooks)
    return hooks.most


@dataclass
class BudgetLimits:
    """``minimum``: the smallest ratio found to complete (None: not even ``MAX_RATIO``);
    ``cutoff``: the largest ratio with an eviction (None: none at ``minimum``)."""

    trace: str
    method: str
    minimum: float | None
    cutoff: float | None
    runs: int
    tolerance: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _bisect(ok: Callable[[float], bool], lo: float, hi: float,
            tol: float) -> tuple[float, float]:
    """Narrow (lo, hi] to ``tol`` keeping not ok(lo) and ok(hi) (lo = 0 is taken as not ok)."""
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return lo, hi


def budget_limits(trace: Trace, policy: str, *, allocator: str | None = None,
                  inplace: str | None = None, semantics: str = "membudget",
                  overhead_limit: float | None = DEFAULT_OVERHEAD_LIMIT,
                  baseline: Baseline | None = None, tolerance: float = 0.01,
                  seed: int = 0, method: str = "", swap: str = "off") -> BudgetLimits:
    """Bisect the ratio for the minimum and the cutoff budget (each to ``tolerance``).

    Completing is taken as monotone in the budget, as is evicting at all; each bisection
    runs about log2(1/tolerance) simulations. On an address-ordered pool it is not always
    (a live step of a transformers ConvNext with the default policy completes at 0.58 and
    0.62 of its eager peak, not at 0.60): the minimum is then a budget that completes, not
    one above which all do.
    """
    base = baseline or measure_baseline(trace)
    runs = 0
    cache: dict[float, SimResult] = {}

    def run(ratio: float) -> SimResult:
        nonlocal runs
        if ratio not in cache:
            runs += 1
            cache[ratio] = simulate(trace, policy, ratio=ratio, semantics=semantics,
                                    overhead_limit=overhead_limit, baseline=base, seed=seed,
                                    allocator=allocator, inplace=inplace, swap=swap)
        return cache[ratio]

    def completes(r: float) -> bool:
        return run(r).status == "ok"

    def quiet(r: float) -> bool:
        return run(r).status == "ok" and run(r).evictions == 0

    hi = 1.0
    while not completes(hi) and hi < MAX_RATIO:
        hi *= 2
    minimum = cutoff = None
    if completes(hi):
        minimum = _bisect(completes, 0.0, hi, tolerance)[1]
        top = hi
        while not quiet(top) and top < MAX_RATIO:
            top *= 2
        if not quiet(minimum):
            cutoff = _bisect(quiet, minimum, top, tolerance)[0] if quiet(top) else top
    return BudgetLimits(trace.name, method or policy, minimum, cutoff, runs, tolerance)
