"""Property tests: random DAG programs give the same values under any budget and policy.

A program is a list of instructions over program handles (puts, applies with 1-3 inputs,
1-2 outputs, views, copy-on-write mutations, copies, releases and reads). It is run once with
no budget to record every read, then under random budgets with every policy and both
semantics. A :class:`SymbolicExecutor` computes each value as a hash of its op and its inputs'
values and fails loudly if an op (or a read) touches data the engine dropped, so "the engine
never loses a value it needs" is checked on the data, not only on the engine's flags.
"""

from __future__ import annotations

import hashlib
import math
from unittest.mock import patch

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from membudget.core import ComputePath, Engine, Executor, Storage, Tensor
from membudget.core.allocators import ALLOCATORS
from membudget.core.policies import POLICIES, make_policy
from membudget.core.policies.cost import evicted_region_cost
from membudget.core.pool import CandidatePool
from membudget.errors import OutOfBudget
from membudget.sim.evictions import _Wrapper


class LostValue(AssertionError):
    """An op or a read needed data that had been dropped."""


def digest(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


class SymbolicExecutor(Executor):
    """Holds one value per tensor, present only while its storage's data is held."""

    def __init__(self) -> None:
        self.present: set[int] = set()  # ids of storages whose data is held
        self.values: dict[int, str] = {}  # tensor id -> value
        self.runs = 0

    def put_leaf(self, t: Tensor, label: str) -> None:
        self.present.add(t.storage.id)
        self.values[t.id] = digest("leaf", label)

    def _read(self, t: Tensor, what: str) -> str:
        if t.storage.id not in self.present or t.id not in self.values:
            raise LostValue(f"{what} reads {t!r} whose data was dropped")
        return self.values[t.id]

    def run(self, path: ComputePath, remat: bool) -> float:
        self.runs += 1
        args = tuple(self._read(t, repr(path.op)) for t in path.inputs)
        for i, t in enumerate(path.outputs):
            s = t.storage
            # Only a storage the engine placed (or a view of a locked input) holds the result;
            # a duplicate of an output that is not resident any more writes nowhere.
            if s.resident and not s.dead:
                self.present.add(s.id)
                self.values[t.id] = digest(path.op, i, args)
        return path.cost

    def drop(self, storage: Storage) -> None:
        self.present.discard(storage.id)
        for t in storage.tensors:
            self.values.pop(t.id, None)

    def value(self, tensor: Tensor) -> object:
        return self._read(tensor, "get_value")

    def move(self, storage: Storage, batched: bool = False) -> float:
        """The values (if computed yet: an op's outputs are placed before it runs, and may
        move while room is made for the next) go with the storage."""
        return 0.0


# ---------------------------------------------------------------------------------- programs
@st.composite
def programs(draw) -> list[tuple]:
    """Instructions over handle numbers; every instruction only uses live handles."""
    live: list[int] = []
    nxt = 0
    instrs: list[tuple] = []
    n_reads = 0

    def new_handle() -> int:
        nonlocal nxt
        nxt += 1
        return nxt

    for step in range(draw(st.integers(1, 35))):
        kind = draw(st.sampled_from(
            ["put", "apply", "apply", "apply", "apply", "release", "release", "get", "copy"]))
        if kind == "put" or not live:
            h = new_handle()
            instrs.append(("put", h, draw(st.integers(0, 64))))
            live.append(h)
        elif kind == "apply":
            ins = tuple(draw(st.lists(st.sampled_from(live), min_size=1, max_size=3)))
            mut = (draw(st.integers(0, len(ins) - 1)),) if draw(st.integers(0, 6)) == 0 else ()
            out_bytes, out_alias = [], []
            for _ in range(draw(st.integers(1, 2))):
                if draw(st.integers(0, 5)) == 0:  # a view of one input
                    out_alias.append(draw(st.integers(0, len(ins) - 1)))
                    out_bytes.append(0)
                else:
                    out_alias.append(-1)
                    out_bytes.append(draw(st.integers(0, 64)))
            outs = tuple(new_handle() for _ in out_bytes)
            cost = draw(st.integers(0, 5))
            instrs.append(("apply", f"op{step}", ins, outs, tuple(out_bytes), tuple(out_alias),
                           cost, mut))
            live.extend(outs)
        elif kind == "release":
            h = draw(st.sampled_from(live))
            live.remove(h)
            instrs.append(("release", h))
        elif kind == "copy":
            h = new_handle()
            instrs.append(("copy", draw(st.sampled_from(live)), h))
            live.append(h)
        else:
            instrs.append(("get", draw(st.sampled_from(live)), n_reads))
            n_reads += 1
    return instrs


def total_fresh_bytes(instrs: list[tuple]) -> int:
    """Bytes of every storage the program ever creates (no recomputation)."""
    total = 0
    sizes: dict[int, int] = {}
    for ins in instrs:
        if ins[0] == "put":
            sizes[ins[1]] = ins[2]
            total += ins[2]
        elif ins[0] == "apply":
            _, _, inputs, outs, nbytes, alias, _, mut = ins
            for h, b, a in zip(outs, nbytes, alias, strict=True):
                sizes[h] = sizes[inputs[a]] if a >= 0 else b
                total += b
            for m in mut:  # the new version has the mutated storage's size
                total += sizes[inputs[m]]
        elif ins[0] == "copy":
            sizes[ins[2]] = sizes[ins[1]]
    return total


def storages_of(tensors) -> set[Storage]:
    return {t.storage for t in tensors}


def check_invariants(eng: Engine, tensors: list[Tensor]) -> None:
    """What the engine documents about its state between commands."""
    storages = storages_of(tensors)
    alloc = eng.allocator
    if alloc.has_layout:
        alloc.check()
        assert eng.used_bytes == sum(s.block.size for s in storages if s.resident and s.nbytes)
        for s in storages:
            assert (s.block is not None) == (s.resident and s.nbytes > 0), s
    else:
        assert eng.used_bytes == sum(s.nbytes for s in storages if s.resident)
    assert eng.used_bytes <= eng.budget
    for s in storages:
        assert s.locks == 0
        assert s.resident + s.evicted + s.dead <= 1, s
        for t in s.tensors:
            assert not t.defined or s.resident, f"{t} defined on {s}"
        if s.dead:
            continue
        candidate = s.resident and not s.pinned and s.nbytes > 0
        assert (s.slot >= 0) == candidate, s
        assert s.ev_parents == sum(p.evicted for p in s.parents), s
        assert s.ev_children == sum(c.evicted for c in s.children), s
        assert all(s in p.children for p in s.parents), s
        assert all(s in c.parents for c in s.children), s
    eng.pool.sync()  # the arrays are lazily synced: every changed row must have been marked
    for i, s in enumerate(eng.pool.items):
        assert s.slot == i
        assert eng.pool.seq[i] == s.seq
        assert eng.pool.nbytes[i] == s.nbytes
        assert eng.pool.cost[i] == s.cost
        assert eng.pool.last[i] == s.last_access
        assert eng.pool.ev_parents[i] == s.ev_parents
        assert eng.pool.ev_children[i] == s.ev_children
        if eng.pool.track_free_adj:  # kept only for policies that read it
            assert eng.pool.free_adj[i] == s.free_adj


def run_program(instrs: list[tuple], eng: Engine, check: bool = False) -> list[str]:
    """Run ``instrs``; return every read value, then the value of every handle still held."""
    ex = eng.executor
    assert isinstance(ex, SymbolicExecutor)
    handles: dict[int, Tensor] = {}
    tensors: list[Tensor] = []
    reads: list[str] = []
    for ins in instrs:
        kind = ins[0]
        if kind == "put":
            t = eng.put(ins[2])
            ex.put_leaf(t, f"h{ins[1]}")
            handles[ins[1]] = t
            tensors.append(t)
        elif kind == "apply":
            _, op, inputs, outs, nbytes, alias, cost, mut = ins
            results = eng.apply(op, [handles[h] for h in inputs], nbytes, alias, cost, mut)
            tensors.extend(results)
            assert len(results) == len(outs) + len(mut)
            for h, t in zip(outs, results, strict=False):
                handles[h] = t
            for j, idx in enumerate(mut):  # copy-on-write: rebind, then drop the old version
                old = handles[inputs[idx]]
                handles[inputs[idx]] = results[len(outs) + j]
                eng.release(old)
        elif kind == "release":
            eng.release(handles.pop(ins[1]))
        elif kind == "copy":
            t = handles[ins[1]]
            eng.retain(t)
            handles[ins[2]] = t
        else:
            reads.append(eng.get_value(handles[ins[1]]))
        if check:
            check_invariants(eng, tensors)
    for h in sorted(handles):
        reads.append(eng.get_value(handles[h]))
    return reads


def reference(instrs: list[tuple]) -> tuple[list[str], Engine]:
    """The unconstrained run, configured like the simulator's baseline."""
    eng = Engine(math.inf, "lru", executor=SymbolicExecutor(), keep_released_leaves=False)
    reads = run_program(instrs, eng)
    assert eng.stats.remat_ops == 0
    return reads, eng


# ---------------------------------------------------------------------------------- properties
FRACTIONS = st.sampled_from([0.0, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0, 1.25])


ALLOCATOR_NAMES = st.sampled_from(sorted(ALLOCATORS))
INPLACE = st.sampled_from(["cow", "remat"])


def policies_for(allocator: str) -> list[str]:
    return [p for p in sorted(POLICIES)
            if allocator != "fungible" or not make_policy(p).needs_layout]


def run_constrained(instrs, budget, policy, free_dead, seed=0, check=False,
                    allocator="fungible", inplace="cow"):
    ex = SymbolicExecutor()
    eng = Engine(budget, policy, allocator, ex, free_dead=free_dead, seed=seed, inplace=inplace)
    try:
        reads = run_program(instrs, eng, check)
    except OutOfBudget as e:
        # either the budget is too small for the bytes that could not be evicted, or (on an
        # address-ordered pool) no single free block is large enough
        assert e.needed_bytes > budget or e.largest_free_bytes < e.request_bytes
        assert e.needed_bytes == e.request_bytes + e.unevictable_bytes
        assert eng.peak_bytes <= budget
        return None, eng
    assert eng.peak_bytes <= budget
    return reads, eng


def check_values(instrs, fraction, seed, allocator, inplace, check=False):
    expected, ref = reference(instrs)
    budget = int(ref.peak_bytes * fraction)
    for policy in policies_for(allocator):
        for free_dead in (True, False):
            reads, _eng = run_constrained(instrs, budget, policy, free_dead, seed, check,
                                          allocator, inplace)
            if reads is not None:
                assert reads == expected, (policy, free_dead)


@settings(max_examples=120, suppress_health_check=[HealthCheck.too_slow])
@given(instrs=programs(), fraction=FRACTIONS, seed=st.integers(0, 3),
       allocator=ALLOCATOR_NAMES, inplace=INPLACE)
def test_any_budget_and_policy_gives_the_unconstrained_values_or_a_clean_oom(
        instrs, fraction, seed, allocator, inplace):
    check_values(instrs, fraction, seed, allocator, inplace)


@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(instrs=programs(), fraction=FRACTIONS, seed=st.integers(0, 3),
       allocator=ALLOCATOR_NAMES, inplace=INPLACE)
def test_engine_state_invariants_hold_between_commands(instrs, fraction, seed, allocator,
                                                       inplace):
    check_values(instrs, fraction, seed, allocator, inplace, check=True)


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(instrs=programs(), fraction=FRACTIONS, allocator=ALLOCATOR_NAMES)
def test_compacting_the_stale_marks_changes_no_decision(instrs, fraction, allocator):
    """A pool compacts its stale list (marking every member instead) when marks pile up
    between searches: with a limit of 1 it does so all the time, and every run must still
    read, evict and recompute exactly as with the default limit."""
    _, ref = reference(instrs)
    budget = int(ref.peak_bytes * fraction)

    def outcome(policy: str) -> tuple:
        reads, eng = run_constrained(instrs, budget, policy, True, allocator=allocator)
        st_ = eng.stats
        return reads, st_.evictions, st_.eager_evictions, st_.remat_ops, eng.peak_bytes

    for policy in policies_for(allocator):
        default = outcome(policy)
        with patch.object(CandidatePool, "STALE_LIMIT", 1):
            assert outcome(policy) == default, policy


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(instrs=programs(),
       allocator=st.sampled_from(["fungible", "best-fit", "two-sided", "size-sided",
                                  "phase-sided"]))
@example(instrs=[("put", 1, 1), ("put", 2, 0),
                 ("apply", "op6", (1,), (7,), (0,), (0,), 0, (0,)),
                 ("apply", "op8", (1,), (9,), (0,), (0,), 0, (0,)),
                 ("apply", "op10", (1,), (11,), (3,), (-1,), 0, (0,)),
                 ("put", 18, 1), ("put", 19, 4)],
          allocator="two-sided")  # dtr-compact-lastslide evicts, then runs out
@example(instrs=[("put", 1, 3), ("apply", "op7", (1,), (8, 9), (2, 0), (-1, 0), 0, (0,)),
                 ("put", 11, 1), ("apply", "op10", (1,), (12,), (0,), (0,), 0, ()),
                 ("put", 20, 2)],
          allocator="two-sided")  # dtr-compact (the default) evicts, then runs out
def test_budget_holding_every_storage_never_evicts(instrs, allocator):
    """Without frees for good every byte ever allocated fits; best fit never fragments
    such a pool (the hole every placement comes from only shrinks by what it holds).
    A policy that moves storages is held to it only while no leaf comes after an op: it
    moves values out of a late leaf's way (``make_way``), which frees more than the leaf
    takes and can strand the rest as a hole (the examples: it then evicts and may run
    out, cleanly, as ``run_constrained`` checks)."""
    expected, _ = reference(instrs)
    budget = total_fresh_bytes(instrs)
    first_op = next((i for i, ins in enumerate(instrs) if ins[0] == "apply"), len(instrs))
    late_leaf = any(ins[0] == "put" and ins[2] for ins in instrs[first_op:])
    for policy in policies_for(allocator):
        reads, eng = run_constrained(instrs, budget, policy, True, allocator=allocator)
        if late_leaf and make_policy(policy).relocates:
            assert reads is None or reads == expected, policy
            continue
        assert reads == expected, policy
        assert eng.stats.evictions == 0 and eng.stats.remat_ops == 0


class CheckedDTR(_Wrapper):
    """DTR, each choice checked against the exact score of every candidate: its branch and
    bound skips candidates by lower bounds it keeps across searches (reset only around the
    regions a rematerialization shrinks) and by chain costs it keeps between evictions."""

    name = "checked-dtr"

    def __init__(self) -> None:
        super().__init__(make_policy("dtr"))
        self.checked = 0

    def choose(self, pool: CandidatePool, clock: float) -> Storage:
        got = self.inner.choose(pool, clock)
        scores = []
        for i, s in enumerate(pool.items):
            d = float(pool.nbytes[i]) * (clock - float(pool.last[i]))
            c = (float(pool.cost[i]) + evicted_region_cost(s, False)
                 + evicted_region_cost(s, True))
            scores.append(c / d if d > 0 else math.inf)
        best = min(scores)
        assert scores[got.slot] == best or math.isclose(scores[got.slot], best, rel_tol=1e-9)
        self.checked += 1
        return got

    def victims(self, pool: CandidatePool, clock: float, request: Storage) -> list[Storage]:
        return [self.choose(pool, clock)]  # (as DTR's: one at a time, by its choice)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(instrs=programs(), fraction=st.sampled_from([0.25, 0.4, 0.5, 0.6, 0.75]),
       inplace=INPLACE)
def test_dtr_chooses_the_exact_minimum_of_its_score(instrs, fraction, inplace):
    expected, ref = reference(instrs)
    budget = int(ref.peak_bytes * fraction)
    for free_dead in (True, False):
        policy = CheckedDTR()
        reads, _ = run_constrained(instrs, budget, policy, free_dead, inplace=inplace)
        assert reads is None or reads == expected
