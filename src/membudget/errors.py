"""The errors membudget raises: each names the problem and what to do about it."""

from __future__ import annotations

from collections.abc import Iterable


class MembudgetError(Exception):
    """Base class of every error raised by membudget."""


def excerpt(v: object, limit: int = 60) -> str:
    """``repr(v)``, cut to ``limit`` characters: a message quotes a field, never all of it."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r):,} characters)"


class StaleBuildWarning(UserWarning):
    """The compiled core is older than its sources (an editable install edited since it was
    built): the compiled code runs, not the sources."""


class BudgetRaisedWarning(UserWarning):
    """A session held more than its budget at once because the program held that much (the
    values handed back as it ended, or a ``torch.save`` of them): ``stats.beyond_budget_bytes``
    says by how much."""


class UnknownNameError(MembudgetError, ValueError):
    """A policy, allocator or other named component that does not exist."""

    def __init__(self, what: str, name: str, known: Iterable[str]) -> None:
        self.known = sorted(known)
        super().__init__(f"unknown {what} {name!r}; known: {', '.join(self.known)}")


class OutOfBudget(MembudgetError, MemoryError):
    """An allocation cannot fit even after evicting everything evictable.

    ``needed_bytes`` is the smallest budget under which this allocation could have succeeded
    at that moment: the bytes that could not be evicted (pinned or locked) plus the request.
    For an op the program runs, that is a lower bound for the whole run; not where the
    allocation serves a recomputation (``recomputing``), which another schedule might not
    need there. ``pinned_apart``: the pool keeps pinned blocks apart already, so the message
    suggests such a pool only where it does not.
    """

    def __init__(self, *, op: object, request_bytes: int, unevictable_bytes: int,
                 budget_bytes: float, largest_free_bytes: float | None = None,
                 pinned_apart: bool = False, recomputing: bool = False) -> None:
        self.op = op
        self.pinned_apart = pinned_apart
        self.recomputing = recomputing
        self.request_bytes = request_bytes
        self.unevictable_bytes = unevictable_bytes
        self.needed_bytes = request_bytes + unevictable_bytes
        self.budget_bytes = budget_bytes
        self.largest_free_bytes = (budget_bytes - unevictable_bytes
                                   if largest_free_bytes is None else largest_free_bytes)
        short = (f"it needs {request_bytes:,} B more while {unevictable_bytes:,} B are pinned "
                 f"or locked, but the budget is {int(budget_bytes):,} B")
        if self.needed_bytes > budget_bytes and recomputing:
            why = (f"{short}: recomputing an evicted value, it needs {self.needed_bytes:,} B "
                   "at this point of this schedule, and other evictions may fit the run in the "
                   "budget: raise it or try another policy")
        elif self.needed_bytes > budget_bytes:
            why = (f"{short}: this op alone needs a budget of at least {self.needed_bytes:,} B "
                   "(a lower bound for the run: later ops may need more)")
        else:
            why = (f"it needs one free block of {request_bytes:,} B, but with the "
                   f"{unevictable_bytes:,} B of pinned or locked blocks in place the largest block "
                   f"the {int(budget_bytes):,} B pool can give is "
                   f"{int(self.largest_free_bytes):,} B (fragmentation, or the allocator's "
                   "segment sizes); change the budget: with addresses, what completes is not "
                   "monotone in the budget, so a little more or a little less may fit "
                   "(`membudget simulate --min-budget` finds the least that works)"
                   + ("" if pinned_apart else " or use a pool that keeps pinned blocks "
                                              "together (two-sided or segregated)"))
        super().__init__(f"out of budget running {excerpt(op, 120)}: {why}")


class Thrashed(MembudgetError):
    """The work beyond the program's own ops (recomputations, moves, waits for host copies)
    exceeded the overhead limit (the run is judged as not completing)."""

    def __init__(self, extra_cost: float, limit_cost: float) -> None:
        self.extra_cost = extra_cost
        self.limit_cost = limit_cost
        super().__init__(
            f"recomputation, moves and waits for host copies cost {extra_cost:.4g}, past the "
            f"overhead limit ({limit_cost:.4g}); raise the budget or the overhead limit")


class OutOfTime(MembudgetError):
    """A simulated run passed its wall-clock deadline (the run is judged as not completing)."""

    def __init__(self, calls: int) -> None:
        self.calls = calls
        super().__init__(f"out of time after {calls:,} calls; give it a later deadline")


class TraceError(MembudgetError, ValueError):
    """A trace that cannot be read or replayed; names the file and line."""

    def __init__(self, path: object, line: int | None, message: str) -> None:
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")


class EngineError(MembudgetError, RuntimeError):
    """The engine was asked for something its state cannot satisfy (a bug or misuse)."""


class UnsupportedTensorError(MembudgetError, NotImplementedError):
    """A tensor a session cannot budget: one with no strided storage of its own (a sparse or
    mkldnn layout, a ``torch.func`` transform's wrapper)."""

    def __init__(self, what: str, fix: str = "") -> None:
        super().__init__(f"{what}: a membudget session counts memory by strided storages and "
                         f"cannot budget it; run that part outside the session{fix}")


class RecomputationError(MembudgetError):
    """A recomputed value differs from what its op made the first time (PyTorch's checkpoint
    calls this its determinism check): the op is not safe to recompute."""

    def __init__(self, op: object, output: int, first: str, again: str) -> None:
        self.op = op
        self.output = output
        super().__init__(
            f"recomputing {op} gave output {output} with {again}, but its first run made "
            f"{first}; the op does not recompute to the same value, so evicting its outputs "
            "is unsafe: report it, or run the session with determinism_check=\"none\" if the "
            "difference is harmless")


class BudgetTooSmallError(OutOfBudget):
    """A live session's op cannot fit in its budget even after evicting all it can.

    The session is closed when this propagates out of it (what the program holds is handed
    back, see ``runtime.handout``); a new session with a larger budget works in the same
    process.
    """

    #: how to find a budget that completes, added to the message
    HOW = ("; the least budget that completes the whole run: record one step without a budget "
           "(membudget.budget(..., record=\"step.jsonl.gz\")) and run `membudget simulate "
           "step.jsonl.gz --policy POLICY --min-budget`")

    def __init__(self, **fields: object) -> None:
        super().__init__(**fields)  # type: ignore[arg-type]
        if self.needed_bytes > self.budget_bytes:
            self.args = (self.args[0] + self.HOW,)

    @classmethod
    def from_oob(cls, e: OutOfBudget) -> BudgetTooSmallError:
        return cls(op=e.op, request_bytes=e.request_bytes, unevictable_bytes=e.unevictable_bytes,
                   budget_bytes=e.budget_bytes, largest_free_bytes=e.largest_free_bytes,
                   pinned_apart=e.pinned_apart, recomputing=e.recomputing)
