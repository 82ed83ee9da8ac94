"""Simulate a policy on a trace under a budget, with the metrics of DESIGN.md."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from membudget.core.allocators import layout_names, make_allocator
from membudget.core.engine import INPLACE_MODES, Engine, check_swap
from membudget.core.executor import SimulatedExecutor
from membudget.core.policies import make_policy, resolve_policy
from membudget.core.policies.future import DTRFuture
from membudget.errors import MembudgetError, OutOfBudget, OutOfTime, Thrashed
from membudget.sim.evictions import (
    DecisionRecorder,
    EvictionPlan,
    PlanFirst,
    PlanFollower,
    plan_first,
    recording_policy,
)
from membudget.sim.future import FutureReads
from membudget.sim.replay import CallHooks, replay
from membudget.trace.format import Trace

SEMANTICS = ("membudget", "simrd")
DEFAULT_OVERHEAD_LIMIT = 2.0
COPY_SPEC = "a100-80gb"  # prices a move where the trace names no device spec


def copy_executor(header: dict[str, Any]) -> SimulatedExecutor:
    """A simulated executor that prices a move (a copy of a storage's bytes, read and
    written) and a host copy (one way over the host link) on the trace's device spec
    (``device_spec`` in its header, else :data:`COPY_SPEC`): launch overhead plus bytes over
    the achieved bandwidth, in ns; a live run's trace gives the ``move_price`` its moves
    were weighed at. Host copies overlap the ops on copy streams, and pinned
    storages may leave for the host too, except in a live run's trace: its header gives the
    ``host_link`` prices it copied at, in turn, and whether it swapped pinned storages (the
    live runtime does not own the program's parameters, so it never does)."""
    from membudget.cost.devices import get_spec  # (imports torch: only when simulating)

    spec = get_spec(str(header.get("device_spec") or COPY_SPEC))
    copy_ns, copy_launch = _header_price(header, "move_price") or spec.move_ns()
    link = header.get("host_link")
    recorded = _header_price(header, "host_link")
    if recorded is not None:
        (link_ns, link_launch), overlap, pinned = (
            recorded, bool(link.get("overlap", False)), bool(link.get("pinned", False)))
    else:
        (link_ns, link_launch), overlap, pinned = spec.host_copy_ns(), True, True
    ex = SimulatedExecutor(copy_ns, copy_launch, link_ns, link_launch, overlap)
    ex.swaps_pinned = pinned
    return ex


def _header_price(header: dict[str, Any], key: str) -> tuple[float, float] | None:
    """The (ns per byte, ns per copy) a live run's trace header recorded under ``key``, or
    None if it has none; a clear error if it is malformed."""
    price = header.get(key)
    if not isinstance(price, dict):
        return None
    try:
        return float(price["ns_per_byte"]), float(price["launch_ns"])
    except (KeyError, TypeError, ValueError):
        raise MembudgetError(f"the trace header's {key} {price!r} needs numbers "
                             "ns_per_byte and launch_ns") from None


@dataclass(frozen=True)
class Baseline:
    """The unconstrained run: every op once, tensors freed when the program releases them."""

    cost: float
    peak_bytes: int
    ops: int


@dataclass
class SimResult:
    """Everything one simulated run reports (``to_json`` is what ``--json`` prints)."""

    trace: str
    policy: str
    method: str  # how tables name it: the policy, or policy@allocator+inplace
    allocator: str
    inplace: str
    semantics: str
    status: str  # "ok", "oom", "thrashed" or (given a deadline) "timeout"
    ratio: float | None
    budget_bytes: int
    baseline_cost: float
    baseline_peak_bytes: int
    overhead: float  # executed cost / baseline cost - 1
    executed_cost: float
    remat_cost: float
    peak_bytes: int
    evictions: int
    eager_evictions: int
    remat_ops: int
    ops: int
    search_us: dict[str, float]
    fragmentation: dict[str, float]  # free / pool bytes at failed allocations: mean, max
    wall_s: float
    ops_per_s: float  # executed ops (remat included) per second of wall time
    needed_bytes: int | None = None  # with "oom": the budget the failing allocation needed
    message: str = ""
    swap: str = "off"  # where victims went: "off" (dropped), "only" (host memory), "both"
    extra: dict[str, Any] = field(default_factory=dict)
    # with record_plan: the policy's decisions as a plan that replays them (not in the JSON)
    eviction_plan: EvictionPlan | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["eviction_plan"]
        return out


def check_config(policy: str, allocator: str | None = None, inplace: str | None = None,
                 semantics: str = "membudget",
                 policy_options: dict[str, Any] | None = None,
                 swap: str = "off") -> tuple[str, str]:
    """Fail fast on a bad combination, before any work; return the allocator and in-place
    mode the run will use (the policy's published defaults where not given; copy-on-write
    with ``swap="only"``, which keeps no history to recompute an old value from)."""
    pol = make_policy(policy, **(policy_options or {}))
    if semantics not in SEMANTICS:
        raise MembudgetError(f"unknown semantics {semantics!r}; known: {', '.join(SEMANTICS)}")
    allocator = allocator or pol.default_allocator
    inplace = check_swap(swap, inplace, pol.default_inplace)
    if inplace not in INPLACE_MODES:
        raise MembudgetError(f"unknown in-place mode {inplace!r}; known: "
                             f"{', '.join(INPLACE_MODES)}")
    pool = make_allocator(allocator, 1 << 20)  # an unknown name is refused here
    if pol.needs_layout and not pool.has_layout:
        raise MembudgetError(f"policy {policy!r} needs an address-ordered allocator, not "
                             f"{allocator!r}; use the allocator {layout_names()}")
    return allocator, inplace


def measure_baseline(trace: Trace) -> Baseline:
    """Replay with no budget, freeing every storage when the program releases it."""
    engine = Engine(math.inf, "lru", keep_released_leaves=False)
    replay(engine, trace.events, trace.path)
    return Baseline(engine.stats.base_cost, engine.peak_bytes, engine.stats.ops)


def simulate(trace: Trace, policy: str, *, ratio: float | None = None,
             budget: int | None = None, semantics: str = "membudget",
             overhead_limit: float | None = DEFAULT_OVERHEAD_LIMIT,
             baseline: Baseline | None = None, seed: int = 0, allocator: str | None = None,
             inplace: str | None = None, policy_options: dict[str, Any] | None = None,
             on_engine: Callable[[Engine], object] | None = None,
             plan: EvictionPlan | None = None, record_plan: bool = False,
             swap: str = "off", deadline: float = math.inf) -> SimResult:
    """Replay ``trace`` under a budget (bytes, or ``ratio`` × the baseline peak) with ``policy``
    on ``allocator``'s pool, handling in-place writes by ``inplace`` (both default to what the
    policy was published with). ``on_engine`` sees the engine before the replay (to attach
    a recorder). ``plan`` evicts what it lists before each call, and ``policy`` decides only
    what it leaves open; ``record_plan`` returns the run's decisions (with ``plan``, its
    evictions and the policy's) as a plan (``eviction_plan``) that replays them. ``swap``
    lets victims go to host memory ("only", or "both" beside recomputation: see
    :class:`Engine`), copied over the host link of the trace's device spec on copy streams
    that overlap the ops.

    The run ends "ok", "oom" (nothing evictable was left for an allocation), "thrashed"
    (recomputations, moves and waits for host copies cost more than ``overhead_limit - 1``
    times the baseline cost) or "timeout" (``time.perf_counter()`` passed ``deadline``).
    """
    policy = resolve_policy(policy)
    allocator, inplace = check_config(policy, allocator, inplace, semantics, policy_options,
                                      swap)
    if (ratio is None) == (budget is None):
        raise MembudgetError("give exactly one of ratio and budget")
    if ratio is not None and not ratio > 0:
        raise MembudgetError(f"ratio must be > 0, got {ratio}")
    if budget is not None and budget < 0:
        raise MembudgetError(f"budget must be >= 0 bytes, got {budget}")
    base = baseline or measure_baseline(trace)
    if ratio is not None:
        budget = int(base.peak_bytes * ratio)
    assert budget is not None
    limit = math.inf if overhead_limit is None else base.cost * (overhead_limit - 1)
    pol = make_policy(policy, seed=seed, **(policy_options or {}))
    oracle = pol if isinstance(pol, DTRFuture) else None
    if plan is not None:
        pol = plan_first(pol)
    recorder = DecisionRecorder(recording_policy(pol)) if record_plan else None
    if swap != "off" and (plan is not None or record_plan):
        raise NotImplementedError("eviction plans record drops only: follow or record one "
                                  "with swap='off'")
    engine = Engine(budget, recorder.policy if recorder is not None else pol, allocator,
                    copy_executor(trace.header), remat_cost_limit=limit,
                    free_dead=semantics == "membudget", inplace=inplace, swap=swap, seed=seed,
                    deadline=deadline)
    follower = None
    if plan is not None:
        assert isinstance(pol, PlanFirst)
        follower = PlanFollower(engine, plan, pol,
                                recorder.policy.note if recorder is not None else None)
    hooks: CallHooks | None = follower
    if recorder is not None:
        recorder.follower = follower
        hooks = recorder
    if oracle is not None:
        hooks = FutureReads(oracle, trace.events, hooks)
    if on_engine is not None:
        on_engine(engine)
    status, needed, message = "ok", None, ""
    t0 = time.perf_counter()
    try:
        replay(engine, trace.events, trace.path, hooks)
    except OutOfBudget as e:
        status, needed, message = "oom", e.needed_bytes, str(e)
    except Thrashed as e:
        status, message = "thrashed", str(e)
    except OutOfTime as e:
        status, message = "timeout", str(e)
    wall = time.perf_counter() - t0
    st = engine.stats
    executed_ops = st.ops + st.remat_ops
    return SimResult(
        trace=trace.name, policy=policy, method=policy, allocator=allocator, inplace=inplace,
        semantics=semantics, status=status, ratio=ratio, swap=swap,
        budget_bytes=int(budget), baseline_cost=base.cost, baseline_peak_bytes=base.peak_bytes,
        overhead=st.executed_cost / base.cost - 1 if base.cost else 0.0,
        executed_cost=st.executed_cost, remat_cost=st.remat_cost, peak_bytes=engine.peak_bytes,
        evictions=st.evictions, eager_evictions=st.eager_evictions, remat_ops=st.remat_ops,
        ops=st.ops, search_us=st.search_us(), fragmentation=st.fragmentation_summary(),
        wall_s=wall,
        ops_per_s=executed_ops / wall if wall > 0 else 0.0, needed_bytes=needed,
        message=message, extra={"inplace_reuses": st.inplace_reuses,
                                "moves": st.moves, "moved_bytes": st.moved_bytes,
                                "move_cost": st.move_cost,
                                **({"swap_outs": st.swap_outs, "swap_ins": st.swap_ins,
                                    "swapped_bytes": st.swapped_bytes, "backups": st.backups,
                                    "shelved": st.shelved,
                                    "prefetches": st.prefetches,
                                    "swap_stall": st.swap_stall, "host_peak": st.host_peak}
                                   if swap != "off" else {}),
                                "inplace_copies": st.inplace_copies,
                                "failed_allocations": st.failed_allocations,
                                # following a plan: the evictions it made (its answers to
                                # searches for room among them), the searches left to the policy
                                **({"plan_evictions": pol.answered + follower.evicted,
                                    "plan_answered": pol.answered,
                                    "policy_searches": pol.searches}
                                   if follower is not None and isinstance(pol, PlanFirst)
                                   else {})},
        eviction_plan=recorder.plan(policy) if recorder is not None else None)
