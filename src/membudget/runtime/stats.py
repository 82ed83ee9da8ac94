"""What a session did, in the units a user reads: bytes, counts and seconds."""

from __future__ import annotations

from dataclasses import dataclass, field

from membudget.core.allocators.fungible import LiftedAllocator
from membudget.core.engine import Engine


@dataclass
class SessionStats:
    """What a session did. ``op_seconds`` is what the program's ops cost and
    ``remat_seconds`` what recomputing cost, as the engine priced them before running them
    (the first measured run of the same op on the same input shapes in this process, or for
    one never run before a cost-model estimate; or the session's ``cost`` function).
    ``run_seconds`` is the measured time of the program's ops as they ran in this session,
    ``remat_run_seconds`` that of their recomputations (the engine's prices of the same ops
    can differ: a first run pays for cold caches and fresh pages). ``unsized_ops`` counts
    the ops whose outputs could not be sized before they ran (their output shapes depend on
    the data, or a meta kernel sized them wrongly): only those outputs were ever held beside
    the budget, for a moment.
    ``peak_bytes`` is the most the engine held within the budget; what the program still
    held when the session ended was then handed to it, within the budget where it could
    hold them all at once, else with the budget raised by ``beyond_budget_bytes``
    (``runtime.handout``).

    ``searches`` counts the allocations for which the policy searched for victims
    (``evictions`` counts every value evicted to make room, by the policy or a plan). In
    planned mode (``runtime.planned``), ``plan_evictions`` of those were the plan's, taken
    with no search (``searches`` then counts the allocations the plan left to the policy);
    ``plan_followed_calls`` engine calls ran under a plan (``ops`` is every op of the
    step); ``plan_divergences`` is 1 if the step's calls stopped matching every plan, at
    call ``plan_diverged_at``, after which the policy decided alone; ``plan_switches``
    counts moves to another plan of the session that matched the step where the current
    one did not; ``plan_recorded`` whether the step was recorded to be planned;
    ``plan_source`` what made the last plan it followed (the planner's ``source``: by
    default the name of the policy whose schedule was cheapest). A replayed step
    (``runtime.replay``) ran ``replayed_ops`` ops without the engine, dropping
    ``replay_dropped`` saved values and running ``replay_recomputed_ops`` ops to recompute
    them; ``replay_handed_over_at`` is the op at which the engine took over, and
    ``replay_reason`` why (else None and ""); for a planned step that was not replayed
    though the step before followed its plan to the end, ``replay_reason`` says why not
    (no set of drops fits the budget, an earlier replay handed over or ran out, replay is
    off, several processes). Its ``peak_bytes`` is then the replay's metered
    peak (or the engine's, if higher after it took over), and ``replay_forecast_bytes`` the
    peak its choice of drops was forecast to reach."""

    budget_bytes: int
    peak_bytes: int = 0
    evictions: int = 0
    eager_evictions: int = 0
    remat_ops: int = 0
    ops: int = 0
    remat_seconds: float = 0.0
    op_seconds: float = 0.0
    run_seconds: float = 0.0
    remat_run_seconds: float = 0.0
    unsized_ops: int = 0
    beyond_budget_bytes: int = 0
    search_us: dict[str, float] = field(default_factory=dict)
    fragmentation: dict[str, float] = field(default_factory=dict)
    # on a CUDA (or other accelerator) device: the most bytes its caching allocator held
    # beyond what it held when the session began, to cross-check peak_bytes (DeviceMeter)
    device_peak_bytes: int | None = None
    searches: int = 0
    plan_recorded: bool = False
    plan_followed_calls: int = 0
    plan_evictions: int = 0
    plan_switches: int = 0
    plan_divergences: int = 0
    plan_diverged_at: int | None = None
    plan_source: str | None = None
    replayed_ops: int = 0
    replay_dropped: int = 0
    replay_recomputed_ops: int = 0
    replay_handed_over_at: int | None = None
    replay_reason: str = ""
    replay_forecast_bytes: int = 0
    moves: int = 0  # values copied to another address to merge free blocks (dtr-compact)
    moved_bytes: int = 0
    move_seconds: float = 0.0  # their measured copy time
    swap_outs: int = 0  # values evicted to host memory (swap="only" or "both")
    swap_ins: int = 0  # values copied back
    swapped_bytes: int = 0  # bytes copied to host memory
    shelved: int = 0  # released values kept on the host (their copy made), not dropped
    swap_seconds: float = 0.0  # the measured time of the copies both ways

    @classmethod
    def of(cls, budget_bytes: int, engine: Engine, run_ns: int, remat_ns: int,
           unsized_ops: int, device_peak_bytes: int | None, swap_ns: int = 0) -> SessionStats:
        """The stats of a session that ran ``engine``."""
        st = engine.stats
        alloc = engine.allocator
        beyond = max(0, alloc.high - budget_bytes) if isinstance(alloc, LiftedAllocator) else 0
        return cls(budget_bytes, engine.peak_bytes, st.evictions, st.eager_evictions, st.remat_ops,
                   st.ops, st.remat_cost / 1e9, st.base_cost / 1e9, run_ns / 1e9, remat_ns / 1e9,
                   unsized_ops, beyond,
                   st.search_us(), st.fragmentation_summary(), device_peak_bytes,
                   st.failed_allocations, moves=st.moves, moved_bytes=st.moved_bytes,
                   move_seconds=st.move_cost / 1e9, swap_outs=st.swap_outs,
                   swap_ins=st.swap_ins, swapped_bytes=st.swapped_bytes, shelved=st.shelved,
                   swap_seconds=swap_ns / 1e9)
