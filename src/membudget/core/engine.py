"""The framework-free engine: put / apply / release / get_value under a memory budget.

It records every op's compute path, evicts storages chosen by a policy *before* an allocation
would exceed the budget, evicts eagerly what the program releases while a dependent may still
need it, frees for good what nothing can need any more, and rematerializes evicted tensors on
demand with an explicit stack (never recursion), so arbitrarily long evicted chains are fine.
With swapping on, a victim may instead be copied to host memory and copied back when needed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from heapq import heappop, heappush
from time import perf_counter, perf_counter_ns

from membudget.core.allocators import Allocator, Block, layout_names, make_allocator
from membudget.core.allocators.fungible import LiftedAllocator
from membudget.core.executor import Executor, SimulatedExecutor
from membudget.core.policies import Policy, make_policy
from membudget.core.policies.cost import evicted_region_cost
from membudget.core.pool import CandidatePool
from membudget.core.records import NOTHING_REUSED, ComputePath, Storage, Tensor
from membudget.core.stats import Stats
from membudget.errors import EngineError, OutOfBudget, OutOfTime, Thrashed

INPLACE_MODES = ("cow", "remat")
SWAP_MODES = ("off", "only", "both")


def check_swap(swap: str, inplace: str | None, default_inplace: str) -> str:
    """The in-place mode a run with ``swap`` uses (``inplace``, else copy-on-write with
    "only", which keeps no history to recompute an old value from, else the default); a
    clear error for an unknown swap mode or recomputable in-place with "only"."""
    if swap not in SWAP_MODES:
        raise EngineError(f"unknown swap mode {swap!r}; known: {', '.join(SWAP_MODES)}")
    if swap == "only" and inplace == "remat":
        raise EngineError("swap='only' keeps no compute history, so an in-place write "
                          "cannot leave a recomputable old value; use inplace='cow' "
                          "(--inplace cow)")
    return inplace or ("cow" if swap == "only" else default_inplace)


class Engine:
    """Runs a program's ops under ``budget`` bytes, recomputing evicted values on demand.

    ``remat_cost_limit`` aborts the run with :class:`Thrashed` once recomputations, moves and
    waits for host copies have cost more than that (the simulator sets it from the overhead
    limit and the baseline cost). ``deadline`` (``time.perf_counter()`` seconds) aborts it
    with :class:`OutOfTime` at the first allocation that needs room after it.
    ``free_dead`` frees for good a storage that nothing can need any more (no program
    reference, no live dependent); simrd's accounting instead keeps it in the graph as an
    evicted node, and keeps released pinned storages resident. ``keep_released_leaves=False``
    drops released leaves too (only sound without a budget: the baseline run).

    ``allocator`` and ``inplace`` default to what the policy's method was published with
    (coop: the two-sided pool and recomputable in-place; dte and megengine: best fit; the
    DTR family: the fungible pool and copy-on-write).

    ``inplace`` says what an op that mutates an input does with memory. "cow" (copy-on-write)
    gives the new version a fresh block and leaves the old value where it was (the data is
    copied only when something may still need the old value; otherwise the write lands in
    the old value's data, which is evicted as soon as the op has run, as its release would
    have done). "remat" (Coop's recomputable in-place) lets the new version take the old
    value's block and turns the old value into an evicted version, recomputable from its
    history; when the old value cannot be recomputed (a leaf) and something may still need
    it, that op falls back to copy-on-write, since correctness beats memory.

    ``swap`` says where a victim goes. "off": it is dropped and recomputed when needed.
    "only": it is copied to host memory and copied back (no compute history is kept, so
    nothing is ever recomputed). "both": the copies where they cost less than rebuilding it
    (its op and the evicted ancestors it needs, see ``_let_go``); every policy weighs the
    cheaper of its copies and its own recomputation (``_return_cost``); a value the program
    releases whose host copy has finished stays there where that is cheaper (``_shelves``).
    Where the executor owns the bytes of pinned storages (``swaps_pinned``: the simulator),
    they go to the host as a last resort, when no candidate is left and room is still short:
    the least recently used first (as ZeRO-Offload keeps optimizer state on the host), so a
    run that fits without them makes the same decisions as before. Copies are priced, and
    run, by the executor; the ops' waits for them count in the overhead. An
    executor whose copies overlap the ops gets values backed up to the host ahead of need,
    oldest first, whenever its link is idle and memory has run short once, and swapped
    values brought back ahead of need, the one made last first, while the link back is idle
    and a block is free for them; such a guess goes back to the host, with no copy, before
    anything is evicted to make room.
    """

    def __init__(self, budget: float, policy: Policy | str = "dtr-eq",
                 allocator: Allocator | str | None = None, executor: Executor | None = None,
                 *, remat_cost_limit: float = math.inf, free_dead: bool = True,
                 keep_released_leaves: bool = True, inplace: str | None = None,
                 swap: str = "off", seed: int = 0, deadline: float = math.inf) -> None:
        self.policy = make_policy(policy, seed=seed) if isinstance(policy, str) else policy
        allocator = allocator or self.policy.default_allocator
        self.allocator = (make_allocator(allocator, budget) if isinstance(allocator, str)
                          else allocator)
        if self.policy.needs_layout and not self.allocator.has_layout:
            raise EngineError(f"policy {self.policy.name!r} reads the address layout, which the "
                              f"{self.allocator.name!r} allocator does not have; use "
                              f"{layout_names()}")
        inplace = check_swap(swap, inplace, self.policy.default_inplace)
        if inplace not in INPLACE_MODES:
            raise EngineError(f"unknown in-place mode {inplace!r}; known: "
                              f"{', '.join(INPLACE_MODES)}")
        self.executor = executor if executor is not None else SimulatedExecutor()
        self.pool = CandidatePool(track_free_adj=self.policy.reads_free_adj)
        self.swap = swap
        # pinned storages, for swapping when nothing else can go (pruned as they die)
        self._pinned: list[Storage] | None = (
            [] if swap != "off" and self.executor.swaps_pinned else None)
        self.history = swap != "only"  # compute paths link their outputs to their inputs
        # the tensors of each swapped storage that were materialized when it left
        self._held: dict[Storage, list[Tensor]] = {}
        # storages to back up to the host, oldest first (with an overlapping executor)
        self._backlog: deque[Storage] | None = None
        # swapped storages, a heap with the one made last on top: (-id, departure, storage)
        self._gone: list[tuple[int, int, Storage]] = []
        self._departures = 0
        self._arriving: dict[Storage, float] = {}  # prefetched storages -> when they are in
        if swap != "off":
            try:
                self.executor.transfer(Storage(0, 0))
            except NotImplementedError as e:
                raise EngineError(f"swap={swap!r}: {e}") from None
            self.pool.price = self._return_cost
            if self.executor.overlaps:
                self._backlog = deque()
        self.stats = Stats()
        self.clock = 1.0
        self.remat_cost_limit = remat_cost_limit
        self.deadline = deadline
        self.free_dead = free_dead
        self.keep_released_leaves = keep_released_leaves
        self.inplace = inplace
        self.output_kind = "activation"  # kind given to new storages (the replay sets phases)
        self._ids = 0
        # storages locked while they were candidates: still in the pool until a search
        # (_hold_out_locked); a stack, cut back as each _run releases its locks
        self._locked: list[Storage] = []
        # an allocation serves a recomputation (what it needs is this schedule's, not a
        # bound on every schedule's): set by _run for the frame placing outputs or inputs
        self._recomputing = False
        # the frames of the running _run: [path, inputs locked so far, remat, gave up locks]
        self._frames: list[list] = []
        self._batch_open = False  # a batch of moves has had its launch (_copy_batched)
        if self.pool.track_free_adj:  # else no allocator work on free neighbours at all
            self.allocator.pool = self.pool
        self.policy.attach(self)

    # ------------------------------------------------------------------ properties
    @property
    def budget(self) -> float:
        return self.allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self.allocator.used

    @property
    def peak_bytes(self) -> int:
        return self.allocator.peak

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    # ------------------------------------------------------------------ the four commands
    def put(self, nbytes: int, kind: str = "leaf") -> Tensor:
        """A leaf enters (parameter, input, constant): pinned, counted, one program reference.
        Kind "value" is a value of the step made outside the engine (by a replay that
        handed the step over): unlike the state, it has no place beside the pinned ones."""
        if nbytes < 0:
            raise EngineError(f"a tensor cannot have {nbytes} bytes")
        s = Storage(self._next_id(), int(nbytes), kind)
        s.pinned = True
        if self._pinned is not None:
            self._pinned.append(s)
        t = Tensor(self._next_id(), s, None, alias=False)
        s.tensors.append(t)
        if self.policy.relocates and kind != "value":  # clear its place, if the pool has one
            self._batch_open = False  # (the values in the way move in one launch)
            self.allocator.make_way(s.nbytes, self._copy_batched)
        self._allocate(s, f"taking in a {kind} of {int(nbytes):,} B")  # (the error names it)
        self._placed(s)
        t.defined = True
        s.last_access = self.clock
        t.ext_refs = s.ext_refs = 1
        return t

    def apply(self, op: object, inputs: Sequence[Tensor], out_bytes: Sequence[int] | None,
              out_alias: Sequence[int] | None = None, cost: float = 0.0,
              mutated: Sequence[int] = ()) -> list[Tensor]:
        """Run ``op`` on ``inputs``; return its outputs, each with one program reference.

        ``out_alias[i]`` is the index of the input whose storage output ``i`` shares (a view,
        0 bytes of its own) or -1 for a fresh storage of ``out_bytes[i]``. Each index in
        ``mutated`` names an input the op writes: a new version of that input (a storage of
        the same size, kind and pinning) is appended to the outputs, and the caller rebinds
        its handle and releases the old version. Where the new version's bytes live depends
        on the engine's ``inplace`` mode. With ``out_bytes`` None the outputs
        are described by the executor's ``probe`` when the op first runs (the live runtime).
        """
        # the outputs are made when the op first runs, once its inputs are materialized and
        # locked, whether their sizes are given or probed: a live run and its replay then
        # take exactly the same steps
        self._ids += 1
        path = ComputePath(self._ids, op, inputs, float(cost), tuple(mutated),
                           None if out_bytes is None else (out_bytes, out_alias))
        inputs = path.inputs
        locked = self._locked
        mark = len(locked)  # every lock taken from here is released before returning
        clock = self.clock
        stale = self.pool.stale
        for t in inputs:  # the common case: all defined; stamp and lock them, and run it
            if not t.defined:  # not that case: undo the locks taken before this input's first
                for u in inputs:  # occurrence (_run stamps every input again)
                    if u is t:
                        break
                    u.storage.locks -= 1
                del locked[mark:]
                for u in inputs:  # (a freed input is never defined: checked only here)
                    if u.storage.dead:
                        raise EngineError(f"{op!r} reads {u!r}, which was freed for good")
                self._run(path, False)
                return path.outputs  # type: ignore[return-value]
            s = t.storage
            s.last_access = clock
            s.locks += 1
            if s.slot >= 0:
                stale.append(s)
                locked.append(s)
        try:
            self._execute(path, False)
        finally:
            unlock = self._unlock
            for t in inputs:
                unlock(t.storage)
            del locked[mark:]
        return path.outputs  # type: ignore[return-value]

    def _outputs(self, path: ComputePath, out_bytes: Sequence[int],
                 out_alias: Sequence[int] | None) -> list[Tensor]:
        """Create (and return) the output tensors of a new path (each with one program
        reference), one per entry of ``out_bytes`` and then the new version of each mutated
        input, and link their storages to the path's inputs, each storage once, in the order
        of the outputs.

        The path's cost is charged to its outputs' storages; to the new versions of a writing
        op only once it has run (a live runtime learns that cost by running it, and a replay
        must place those versions the same way)."""
        op, inputs = path.op, path.inputs
        if out_alias is not None and len(out_alias) != len(out_bytes):
            raise EngineError(f"{op!r}: {len(out_bytes)} output sizes but "
                              f"{len(out_alias)} alias entries")
        kind, clock, ids, cost = self.output_kind, self.clock, self._ids, path.cost
        history = self.history
        outputs: list[Tensor] = []
        views: list[Storage] | None = None  # input storages that outputs are views of
        # each output is referenced from the start, so nothing frees it on unlock
        for k, nbytes in enumerate(out_bytes):
            alias = -1 if out_alias is None else out_alias[k]
            if alias < 0:
                s = Storage(ids + 1, int(nbytes), kind)
                s.last_access = clock
                s.cost = cost
                ids += 2
                t = Tensor(ids, s, path, False)
                t.ext_refs = s.ext_refs = 1
                s.tensors.append(t)
                outputs.append(t)
                # _link for a new storage: not pinned, evicted nor a candidate
                if history:
                    parents = s.parents
                    for i in inputs:
                        p = i.storage
                        if p not in parents:
                            parents[p] = None
                            p.children[s] = None
                            if p.evicted:
                                s.ev_parents += 1
                continue
            s = inputs[alias].storage
            ids += 1
            t = Tensor(ids, s, path, True)
            t.ext_refs = 1
            s.ext_refs += 1
            s.tensors.append(t)
            outputs.append(t)
            if views is None:
                views = []
            if s not in views:  # else another view of a storage already linked
                views.append(s)
                s.cost += cost
                self._link(s, inputs)
        for k in path.mutated:  # a version has the size, kind and pinning of the old value
            old = inputs[k].storage
            s = Storage(ids + 1, old.nbytes, old.kind)
            s.pinned = old.pinned
            if s.pinned and self._pinned is not None:
                self._pinned.append(s)
            s.last_access = clock
            ids += 2
            t = Tensor(ids, s, path, False)
            t.ext_refs = s.ext_refs = 1
            s.tensors.append(t)
            outputs.append(t)
            self._link(s, inputs)
        self._ids = ids
        path.outputs = outputs
        return outputs

    def _link(self, s: Storage, inputs: Sequence[Tensor]) -> None:
        """Make the storages of ``inputs`` parents of ``s`` (each once, in order: parents is
        an ordered set), unless ``s`` is pinned or nothing is recomputed (its history must
        not keep its inputs alive)."""
        stale = self.pool.stale
        if s.slot >= 0:
            stale.append(s)
        if s.pinned or not self.history:
            return
        parents = s.parents
        for i in inputs:
            p = i.storage
            if p is s or p in parents:
                continue
            parents[p] = None
            p.children[s] = None
            if p.evicted:
                s.ev_parents += 1
                if s.slot >= 0:
                    stale.append(s)
            if s.evicted:  # a view of an evicted base gains a parent
                p.ev_children += 1
                if p.slot >= 0:
                    stale.append(p)

    def retain(self, t: Tensor) -> None:
        """The program took one more reference to ``t`` (a copied handle)."""
        if t.storage.dead:
            raise EngineError(f"cannot reference {t!r}: it was freed for good")
        t.ext_refs += 1
        t.storage.ext_refs += 1

    def release(self, t: Tensor) -> None:
        """The program dropped one reference to ``t``."""
        if t.ext_refs <= 0:
            raise EngineError(f"{t!r} released more often than it was referenced")
        t.ext_refs -= 1
        s = t.storage
        s.ext_refs -= 1
        if s.ext_refs or s.locks:
            return
        # the program holds no reference into s and no op is using it
        if not s.children and self.free_dead:
            self._free(s)
        elif s.resident and (not s.pinned or not self.keep_released_leaves):
            if self._shelves(s):
                self._shelve(s)
            else:
                self._evict(s)
            self.stats.eager_evictions += 1

    def get_value(self, t: Tensor) -> object:
        """The program reads ``t``: materialize it (recomputing if evicted, copying it back if
        swapped) and return its data."""
        self._touch(t.storage)
        if not t.defined and t.storage.swapped:
            self._swap_in(t.storage, "a read")
        elif self._arriving:
            self._await((t,))
        if not t.defined:
            if t.storage.dead or t.producer is None:
                raise EngineError(f"{t!r} is not materialized and cannot be recomputed")
            self._run(t.producer, remat=True)
        return self.executor.value(t)

    # ------------------------------------------------------------------ running ops
    def _run(self, path: ComputePath, remat: bool) -> None:
        """Execute ``path``, first rematerializing any undefined input, iteratively.

        A frame stamps its inputs' last access when it starts, then locks each input it finds
        defined, so a later rematerialization cannot evict it; an undefined input pushes its
        producer as a new frame. (``apply`` runs a new op whose inputs are all defined
        itself, the commonest case, without the frames.) Where memory runs out, the frames
        below the top one may give up their locks (``_give_up_locks``) and scan again.
        """
        inputs = path.inputs
        locked = self._locked
        mark = len(locked)  # every lock taken from here is released before returning
        self._stamp(inputs)
        stack: list[list] = [[path, 0, remat, False]]
        outer, self._frames = self._frames, stack
        try:
            while stack:
                frame = stack[-1]
                p, i, rm, _ = frame
                inputs = p.inputs
                n = len(inputs)
                while i < n:
                    t = inputs[i]
                    if not t.defined:
                        break
                    self._lock(t.storage)
                    i += 1
                frame[1] = i
                if i < n:
                    t = inputs[i]
                    if t.storage.swapped:
                        self._recomputing = rm
                        self._swap_in(t.storage, p.op)
                        if t.defined:
                            continue  # the frame locks it and goes on
                    if t.producer is None or t.storage.dead:
                        raise EngineError(f"{t!r}, an input of {p.op!r}, was lost: it is "
                                          "neither materialized nor recomputable")
                    self._stamp(t.producer.inputs)
                    stack.append([t.producer, 0, True, False])
                    continue
                self._recomputing = rm
                self._execute(p, rm)
                stack.pop()
                for t in inputs:
                    self._unlock(t.storage)
        except BaseException:
            for p, i, *_ in stack:
                for t in p.inputs[:i]:
                    self._unlock(t.storage)
            raise
        finally:
            del locked[mark:]
            self._recomputing = False
            self._frames = outer

    def _give_up_locks(self) -> bool:
        """Nothing is left to evict while the top frame places its outputs or an input: the
        frames below it unlock the inputs they hold, each once per run, and will lock them
        again (or recompute them, if evicted meanwhile) when they run. A chain of
        recomputations otherwise holds one input at each of its frames, and can need more
        than the budget where the inputs of one op alone fit in it. Return whether any
        frame gave up a lock."""
        gave = False
        for frame in self._frames[:-1]:
            p, i, _, given = frame
            if given or not i:
                continue
            frame[1] = 0
            frame[3] = gave = True
            for t in p.inputs[:i]:
                self._unlock(t.storage)
        return gave

    def _execute(self, p: ComputePath, remat: bool) -> None:
        """Allocate the outputs of ``p`` (its inputs are locked), run it, account for it."""
        outputs = p.outputs
        if outputs is None:
            out_bytes: Sequence[int]
            out_alias: Sequence[int] | None
            if p.pending is None:
                out_bytes, out_alias, p.cost = self.executor.probe(p)
            else:
                (out_bytes, out_alias), p.pending = p.pending, None
            outputs = self._outputs(p, out_bytes, out_alias)
            if p.mutated:
                cost = self._place_and_run(p, outputs, remat)
            else:  # the commonest case, a new op that writes nothing: its outputs are new
                # storages, none resident, dead or a candidate yet, and none needs a lock
                # (nothing can evict them before they join the pool, once the op has run)
                alloc = self.allocator
                try:
                    for t in outputs:
                        if not t.alias:
                            s = t.storage
                            if not alloc.allocate(s):
                                self._make_room(s, p.op)
                            s.resident = True
                    if self._backlog is not None:
                        self._back_up()
                        if self._arriving:
                            self._await(p.inputs)
                    cost = self.executor.run(p, False)
                finally:  # the placed ones become candidates, even if a later one failed
                    add = self.pool.add  # (a new storage is never pinned)
                    for t in outputs:
                        s = t.storage
                        if not t.alias and s.resident and s.nbytes > 0:
                            add(s)
        else:
            cost = self._place_and_run(p, outputs, remat)
        clock = self.clock = self.clock + cost
        st = self.stats
        if remat:
            for t in outputs:  # a resident sibling may have been evicted to make room
                t.defined = t.storage.resident
            st.remat_ops += 1
            st.remat_cost += cost
            self._check_limit()
        else:
            st.ops += 1
            st.base_cost += cost
            stale = self.pool.stale
            for t in outputs:
                s = t.storage
                t.defined = s.resident
                s.last_access = clock
                if s.slot >= 0:
                    stale.append(s)
            if self._backlog is not None:
                self._backlog.extend(t.storage for t in outputs
                                     if not t.alias and t.storage.nbytes > 0)

    def _place_and_run(self, p: ComputePath, outputs: list[Tensor], remat: bool) -> float:
        """Place the outputs of ``p`` (``outputs``) and run it; return its cost
        (``_execute``'s general case: a recomputation, or a new op that writes).

        An output that is still resident, or dead, is produced again all the same, so its
        bytes are held by a temporary duplicate while the op runs (as a real recompute would).
        With recomputable in-place, a new version takes its old value's block (see ``apply``),
        and so does a recomputed one where its old value was recomputed for it alone.
        """
        alloc = self.allocator
        writes = p.mutated and not remat
        if not p.mutated:
            reused = NOTHING_REUSED
        elif remat:
            reused = self._rewritten(p, outputs)
        else:
            reused = self._inplace_sources(p)
        transfer = reused and (remat or self.inplace == "remat")  # versions take old blocks
        placed: list[Storage] = []
        duplicates: list[Storage] | None = None
        try:
            for t in outputs:
                if t.alias:
                    continue
                s = t.storage
                if s.resident or s.dead:
                    dup = Storage(-1, s.nbytes, "duplicate")
                    self._allocate(dup, p.op)
                    if duplicates is None:
                        duplicates = []
                    duplicates.append(dup)
                    continue
                old = reused.get(s) if transfer else None
                if old is not None:
                    alloc.transfer(old, s)
                elif not alloc.allocate(s):
                    self._make_room(s, p.op)
                s.resident = True
                if s.evicted:
                    self._placed(s)
                elif s.swapped:  # recomputed beside a sibling: its host copy stays valid
                    s.swapped = False
                    del self._held[s]
                s.locks += 1
                placed.append(s)
            if self._backlog is not None:
                self._back_up()
                if self._arriving:
                    self._await(p.inputs)
            p.reused = reused
            cost = self.executor.run(p, remat)
            p.reused = NOTHING_REUSED
            if writes:
                for t in p.versions:
                    t.storage.cost += p.cost
            for old in reused.values():  # its data, or its bytes, are the new version's now
                self._evict(old, freed=not transfer)
                if not transfer:  # the eager eviction that its release would have made
                    self.stats.eager_evictions += 1
        finally:
            if duplicates is not None:
                for dup in duplicates:
                    alloc.free(dup)
            for s in placed:
                self._unlock(s)
        return cost

    def _inplace_sources(self, p: ComputePath) -> dict[Storage, Storage]:
        """New version -> old value, for the writes of ``p`` that may overwrite the old value:
        where nothing (no dependent, no other reference) can need it any more, and in "remat"
        mode also where it is recomputable. In "remat" mode such a version takes the old
        value's block; in "cow" mode it still gets a block of its own (copy-on-write's
        accounting), and only the copy of the data is saved."""
        remat = self.inplace == "remat"
        out: dict[Storage, Storage] = {}
        for i, version in zip(p.mutated, p.versions, strict=True):
            old = p.inputs[i].storage
            new = version.storage
            if not old.resident or old in out.values():
                continue
            unneeded = all(c is new for c in old.children) and old.ext_refs <= 1
            if not remat:
                if unneeded and not old.pinned:
                    out[new] = old
            elif unneeded or (not old.pinned and old.tensors[0].producer is not None):
                out[new] = old
                self.stats.inplace_reuses += 1
            else:
                self.stats.inplace_copies += 1
        return out

    def _rewritten(self, p: ComputePath, outputs: list[Tensor]) -> dict[Storage, Storage]:
        """New version -> old value, for the writes of a recomputation that land in the old
        value's block: where the version needs a block, only this op holds the old value (no
        outer frame has it locked, no output of the op is a view of it) and it can be
        recomputed again, so a policy could evict it here anyway; in "cow" mode also only
        where nothing else depends on it. An old value recomputed for its write alone then
        costs no second block, in the engine's accounting as in memory."""
        remat = self.inplace == "remat"
        inputs = p.inputs
        out: dict[Storage, Storage] = {}
        for i, version in zip(p.mutated, p.versions, strict=True):
            old = inputs[i].storage
            new = version.storage
            if (not old.resident or old.pinned or old.tensors[0].producer is None
                    or new.resident or new.dead or old in out.values()
                    or old.locks != sum(t.storage is old for t in inputs)
                    or any(t.storage is old for t in outputs)):  # a view it returns
                continue
            if remat or (old.ext_refs == 0 and all(c is new for c in old.children)):
                out[new] = old
        return out

    # ------------------------------------------------------------------ memory
    def _allocate(self, s: Storage, op: object) -> None:
        """Place ``s``, evicting storages chosen by the policy until it fits."""
        if not self.allocator.allocate(s):
            self._make_room(s, op)

    def _make_room(self, s: Storage, op: object) -> None:
        """``s`` did not fit: evict storages chosen by the policy until it does."""
        alloc = self.allocator
        pool = self.pool
        victims = self.policy.victims
        searched = 0
        st = self.stats
        if self.deadline != math.inf and perf_counter() > self.deadline:
            raise OutOfTime(st.ops)
        st.failed_allocations += 1
        if alloc.capacity:
            st.fragmentation.append(alloc.free_bytes / alloc.capacity)
        self._hold_out_locked()
        if self._arriving and self._withdraw_guesses(s):
            st.search_ns.append(0)
            return
        relocate = self.policy.relocates  # (again after each eviction, not in a row)
        while True:
            t0 = perf_counter_ns()
            pool.sync()
            if relocate:
                moves = self.policy.relocations(pool, self.clock, s)
                searched += perf_counter_ns() - t0
                if moves:
                    self._relocate(moves)
                    if alloc.allocate(s):
                        break
                    pool.sync()
                relocate = False
                t0 = perf_counter_ns()
            if not pool.items:
                last = self._last_resort()
                if last is not None:
                    self._swap_out(last)
                    st.evictions += 1
                    if alloc.allocate(s):
                        break
                    continue
                if self._give_up_locks():
                    continue
                if self._compact(s):
                    break
                raise OutOfBudget(op=op, request_bytes=alloc.block_bytes(s.nbytes),
                                  unevictable_bytes=alloc.used, budget_bytes=alloc.capacity,
                                  largest_free_bytes=alloc.largest_free_block(),
                                  pinned_apart=alloc.keeps_pinned_apart,
                                  recomputing=self._recomputing)
            chosen = victims(pool, self.clock, s)
            searched += perf_counter_ns() - t0
            for victim in chosen:
                self._let_go(victim)
            st.evictions += len(chosen)
            if alloc.allocate(s):
                break
            relocate = self.policy.relocates
        st.search_ns.append(searched)

    def _relocate(self, moves: list[tuple[Storage, Block | None]]) -> None:
        """Move resident storages as the policy asked (into a free block, or down into the
        free block before them); the executor copies their data while the allocator holds
        the new block. The copies cost what the executor says; they count in the executed
        cost, not the clock (no op ran), so the policy's staleness is as on a pool that
        needs no moves."""
        for s, _ in moves:
            if not (s.resident and s.block is not None and s.movable):
                raise EngineError(f"{s} cannot move: only resident computed storages can")
        into = [(s, hole) for s, hole in moves if hole is not None]
        if into:  # independent copies (sources and free blocks do not overlap): one launch
            self._batch_open = False
            self.allocator.relocate(into, self._copy_batched)
        if len(into) < len(moves):  # each slide depends on the one before: a launch each
            self.allocator.slide([s for s, hole in moves if hole is None], self._copy)

    def _compact(self, s: Storage) -> bool:
        """The last resort of a policy that moves storages, once nothing is left to evict
        and no lock to give up: where the free bytes cover ``s`` but lie in pieces, compact
        the pool (its movable storages down, in address order, see ``Allocator.compact``)
        until ``s`` fits; did it? MegEngine's defragmentation, done only when the run would
        otherwise stop: it copies much of the pool."""
        alloc = self.allocator
        need = alloc.block_bytes(s.nbytes)
        if not (self.policy.relocates and alloc.compacts and alloc.free_bytes >= need):
            return False
        alloc.compact(need, self._copy)
        return alloc.allocate(s)

    def _copy_batched(self, s: Storage) -> None:
        """As :meth:`_copy`, in the launch of the batch's first copy."""
        self._copy(s, self._batch_open)
        self._batch_open = True

    def _copy(self, s: Storage, batched: bool = False) -> None:
        """The executor copies the data of ``s`` to the block it was just given."""
        st = self.stats
        st.move_cost += self.executor.move(s, batched)
        st.moved_bytes += s.nbytes
        st.moves += 1
        self._check_limit()

    # ------------------------------------------------------------------ host memory
    def _copy_price(self, s: Storage) -> float:
        """What sending ``s`` to the host costs: the ops' wait for its copy out (none once a
        backup has finished; behind the copies queued ahead of it on a copy stream) and
        the copy back."""
        return self.executor.out_wait(s, self.clock) + self.executor.transfer(s)

    def _return_cost(self, s: Storage) -> float:
        """What evicting ``s`` costs to undo: its copies, or with "both" its own
        recomputation where that is cheaper. The candidate pool's cost column with
        swapping on, so every policy weighs it."""
        price = self._copy_price(s)
        return price if not self.history else min(s.cost, price)

    def _last_resort(self) -> Storage | None:
        """The least recently used pinned storage that can go to the host now (resident,
        holding bytes, no op using it), if pinned storages may go at all."""
        pinned = self._pinned
        if pinned is None:
            return None
        pinned[:] = [s for s in pinned if not s.dead]
        best: Storage | None = None
        for s in pinned:
            if (s.resident and s.locks == 0 and s.nbytes > 0
                    and (best is None or s.last_access < best.last_access)):
                best = s
        return best

    def _rebuild_cost(self, s: Storage) -> float:
        """What recomputing ``s`` would cost now: its own op, the evicted ancestors it
        needs made again first, and the copies back of the swapped values among their
        inputs (the parent side of DTR's e*, swapped inputs included)."""
        return s.cost + evicted_region_cost(s, False, self.executor.transfer)

    def _let_go(self, s: Storage) -> None:
        """Evict the victim ``s``: to host memory where its copies cost less than rebuilding
        it (``_rebuild_cost``), or are the only way back; else dropped. Counting only its
        own op dropped values whose evicted ancestors then had to be recomputed too: the
        DTR paper's lstm at 0.3 of its peak cost 37.0 % with both, against 12.6 %."""
        if self.swap == "off" or (self.history
                                  and self._copy_price(s) >= self._rebuild_cost(s)):
            if self._arriving:
                self._arriving.pop(s, None)
            self._evict(s)
        else:
            self._swap_out(s)

    def _shelves(self, s: Storage) -> bool:
        """Does released ``s`` go to the host rather than be dropped? With "both", where its
        host copy has finished (leaving costs no copy and no wait) and copying it back costs
        less than rebuilding it. A released value is read again only by the recomputation
        of a dropped descendant, often after its own parents have been released too: dropped,
        it is rebuilt through that whole chain (on the DTR paper's unroll_gan at 0.2 of its
        peak, such chains cost 74 % of the step and the run thrashed)."""
        return (self.swap == "both" and not s.pinned and s.host_ready <= self.clock
                and self.executor.transfer(s) < self._rebuild_cost(s))

    def _shelve(self, s: Storage) -> None:
        """Released ``s`` leaves for its finished host copy: no copy, no wait, and no
        prefetch (only a recomputation can read it, if one ever does)."""
        self._leave(s)
        self.stats.shelved += 1

    def _leave(self, s: Storage) -> float:
        """``s`` goes to host memory (copied unless a copy is there already) and its block
        is freed; return how long the ops wait for its copy."""
        stall = self.executor.swap_out(s, self.clock)
        if s.host_ready == math.inf:
            self._hosted(s)
        s.host_ready = min(s.host_ready, self.clock + stall)
        self._held[s] = [t for t in s.tensors if t.defined]
        self._drop(s, True)
        s.swapped = True
        return stall

    def _swap_out(self, s: Storage) -> None:
        """Copy ``s`` to host memory (unless a copy is there already) and free its block."""
        stall = self._leave(s)
        self.stats.swap_outs += 1
        if self._backlog is not None:
            self._arriving.pop(s, None)
            self._departures += 1
            heappush(self._gone, (-s.id, self._departures, s))
        self._wait(stall)

    def _prefetch(self) -> None:
        """While the link back is idle, bring back the swapped storage made last if a block
        is free for it with as much again to spare: no eviction is made for a guess. A
        step's backward reads its values in about the reverse order its forward made them,
        whatever order the policy sent them away in (the DTR logs: treelstm at 0.1 of its
        peak costs 1.8 % with both, against 14.2 % bringing back the one that left last)."""
        gone, ex, alloc = self._gone, self.executor, self.allocator
        while gone:
            s = gone[0][2]
            if not s.swapped:
                heappop(gone)
                continue
            if alloc.free_bytes < 2 * s.nbytes or not alloc.allocate(s):
                return
            ready = ex.prefetch(s, self.clock)
            if ready == math.inf:
                alloc.free(s)
                return
            heappop(gone)
            self._back(s)
            self._arriving[s] = ready
            self.stats.prefetches += 1

    def _withdraw_guesses(self, s: Storage) -> bool:
        """Send prefetched values no op has read yet back to the host, the one needed last
        first, until ``s`` fits; whether it does. A guess gives way before anything is
        evicted: its host copy stays, so it leaves without a copy, where a victim the
        policy picks may have to be recomputed."""
        for g in reversed(list(self._arriving)):
            if g.resident and g.locks == 0:
                self._swap_out(g)
                self.stats.evictions += 1
                if self.allocator.allocate(s):
                    return True
        return False

    def _await(self, inputs: Sequence[Tensor]) -> None:
        """Wait for the inputs still on their way back from host memory."""
        arriving = self._arriving
        latest = self.clock
        for t in inputs:
            ready = arriving.pop(t.storage, None)
            if ready is not None and ready > latest:
                latest = ready
        self._wait(latest - self.clock)

    def _back(self, s: Storage) -> None:
        """Swapped ``s`` holds its bytes again (its block is allocated)."""
        s.swapped = False
        s.resident = True
        for t in self._held.pop(s):
            t.defined = True
        self.stats.swap_ins += 1
        self._touch(s)
        if not s.pinned and s.nbytes > 0 and s.slot < 0:
            self.pool.add(s)

    def _swap_in(self, s: Storage, op: object) -> None:
        """Copy swapped ``s`` back from host memory into a block of its own (making room
        as any allocation does); its host copy stays, so leaving again costs no copy."""
        self._allocate(s, op)
        stall = self.executor.swap_in(s, self.clock)
        self._back(s)
        self._wait(stall)

    def _back_up(self) -> None:
        """As an op starts (its outputs placed), start host copies of the oldest values the
        program made that are still worth one, while the executor's link is idle and once
        memory has run short: a victim with a finished copy leaves without a wait."""
        q = self._backlog
        assert q is not None
        if not self.stats.failed_allocations:
            return
        self._prefetch()
        ex, clock, st = self.executor, self.clock, self.stats
        while q:
            s = q[0]
            if s.dead or not s.resident or s.pinned or s.host_ready != math.inf:
                q.popleft()
                continue
            ready = ex.backup(s, clock)
            if ready == math.inf:
                return
            q.popleft()
            s.host_ready = ready
            self._hosted(s)
            st.backups += 1
            if s.slot >= 0:
                self.pool.stale.append(s)

    def _hosted(self, s: Storage) -> None:
        """A host copy of ``s`` is being made: count its bytes."""
        st = self.stats
        st.swapped_bytes += s.nbytes
        st.host_bytes += s.nbytes
        st.host_peak = max(st.host_peak, st.host_bytes)

    def _wait(self, stall: float) -> None:
        """The ops wait ``stall`` for a host copy: the clock and the overhead count it."""
        if stall > 0:
            self.clock += stall
            self.stats.swap_stall += stall
            self._check_limit()

    def _check_limit(self) -> None:
        """Abort with :class:`Thrashed` once the work beyond the program's own ops
        (recomputations, moves, waits for host copies) costs more than the limit."""
        st = self.stats
        extra = st.remat_cost + st.move_cost + st.swap_stall
        if extra > self.remat_cost_limit:
            raise Thrashed(extra, self.remat_cost_limit)

    def _placed(self, s: Storage) -> None:
        """``s`` now holds its bytes: if it was evicted, it is back in the graph's resident set."""
        s.resident = True
        if s.evicted:
            s.evicted = False
            s.remats += 1
            self._count_evicted(s, -1)
            self.policy.on_remat(s)

    def _evict(self, s: Storage, freed: bool = True) -> None:
        """Drop the bytes of ``s`` but keep its history so it can be recomputed
        (``freed=False``: its bytes were handed to a new version instead)."""
        self._drop(s, freed)
        s.evicted = True
        stale = self.pool.stale  # _count_evicted(s, +1), inlined: on every eager eviction
        for p in s.parents:
            p.ev_children += 1
            if p.slot >= 0:
                stale.append(p)
        for c in s.children:
            c.ev_parents += 1
            if c.slot >= 0:
                stale.append(c)
        self.policy.on_evict(s)

    def _drop(self, s: Storage, freed: bool) -> None:
        """The device no longer holds the data of ``s`` (an eviction or a swap-out): its
        block is freed (unless handed over), its tensors undefined, and it leaves the pool."""
        if freed:
            self.allocator.free(s)
        self.executor.drop(s)
        s.resident = False
        for t in s.tensors:
            t.defined = False
        if s.slot >= 0:
            self.pool.remove(s)

    def _count_evicted(self, s: Storage, delta: int) -> None:
        """``s`` joined (+1) or left (-1) the evicted set: update its neighbours' counts."""
        stale = self.pool.stale
        for p in s.parents:
            p.ev_children += delta
            if p.slot >= 0:
                stale.append(p)
        for c in s.children:
            c.ev_parents += delta
            if c.slot >= 0:
                stale.append(c)

    def _free(self, s: Storage) -> None:
        """Free ``s`` for good, then every ancestor that nothing can need any more."""
        work = [s]
        pool = self.pool
        frees = 0
        while work:
            s = work.pop()
            if s.dead:
                continue
            if s.resident:
                self.allocator.free(s)
                self.executor.drop(s)
                s.resident = False
                if s.slot >= 0:
                    pool.remove(s)
            elif s.evicted:  # its children are all dead already: only its parents count it
                self.policy.on_forget(s)
            if s.host_ready != math.inf:
                if self._arriving:
                    self._arriving.pop(s, None)
                self.executor.drop_host(s)
                s.host_ready = math.inf
                self.stats.host_bytes -= s.nbytes
                if s.swapped:
                    s.swapped = False
                    del self._held[s]
            s.dead = True
            frees += 1
            for t in s.tensors:
                t.defined = False
                t.producer = None  # let the history be garbage-collected
            s.tensors = []  # no cycles left: reference counting frees the records at once
            work.extend(self._detach(s))
            s.evicted = False
        self.stats.frees += frees

    def _detach(self, s: Storage) -> list[Storage]:
        """Cut ``s`` from its parents (which then no longer count it among their evicted
        children, if it was); return those that nothing can need any more."""
        parents, s.parents = s.parents, {}
        evicted = s.evicted
        stale = self.pool.stale
        orphans = []
        for p in parents:
            children = p.children
            children.pop(s, None)
            if evicted:
                p.ev_children -= 1
                if p.slot >= 0:
                    stale.append(p)
            if not children and p.ext_refs == 0 and p.locks == 0 and not p.dead:
                orphans.append(p)
        return orphans

    def _held_descendants(self, s: Storage) -> list[Storage]:
        """The storages computed from ``s`` that the program holds or an op is using, and
        that are not computed from ``s`` only through another such storage."""
        seen = {s}
        work = list(s.children)
        held = []
        while work:
            d = work.pop()
            if d in seen:
                continue
            seen.add(d)
            if d.ext_refs or d.locks:
                held.append(d)
            else:
                work.extend(d.children)
        return held

    def _lock(self, s: Storage) -> None:
        s.locks += 1
        if s.slot >= 0:
            self._locked.append(s)

    def _unlock(self, s: Storage) -> None:
        s.locks -= 1
        if s.locks:
            return
        if s.ext_refs == 0 and not s.children and not s.dead and self.free_dead:
            self._free(s)
        elif s.slot >= 0:  # it stayed in the pool while locked: it re-enters as the latest
            self.pool.touch(s)
        elif s.resident and not s.pinned and s.nbytes > 0 and not s.dead:
            self.pool.add(s)

    def _hold_out_locked(self) -> None:
        """Take the storages locked by running ops out of the pool before a search (a lock
        leaves a candidate in the pool, since most ops end without any search)."""
        pool = self.pool
        for s in self._locked:
            if s.locks and s.slot >= 0:
                pool.remove(s)

    def _touch(self, s: Storage) -> None:
        s.last_access = self.clock
        if s.slot >= 0:
            self.pool.stale.append(s)

    def _stamp(self, inputs: Sequence[Tensor]) -> None:
        clock = self.clock
        stale = self.pool.stale
        for t in inputs:
            s = t.storage
            s.last_access = clock
            if s.slot >= 0:
                stale.append(s)

    def lift_budget(self, capacity: float) -> None:
        """Raise the budget to ``capacity`` bytes of a fungible pool, outside the budgeted
        run and its peak: for work after it that cannot be refused, such as handing the
        program the values it holds at the end (the allocator's ``high`` is then the most
        it held)."""
        self.allocator = LiftedAllocator(self.allocator, max(capacity, self.allocator.capacity))

    def resize(self, t: Tensor, nbytes: int) -> None:
        """The resident storage of ``t`` turned out to hold ``nbytes``, not what its op was
        sized at before it ran (a live executor's prediction that its first run corrected):
        account for that many from now on, making room if it grew."""
        s = t.storage
        old = s.nbytes
        if not s.resident or nbytes == old:
            return
        if nbytes < 0:
            raise EngineError(f"a tensor cannot have {nbytes} bytes")
        alloc = self.allocator
        alloc.free(s)
        s.nbytes = nbytes
        locked = self._locked
        mark = len(locked)
        self._lock(s)  # not a victim of the room it needs
        try:
            if not alloc.allocate(s):
                self._make_room(s, f"{t!r} resized to {nbytes:,} B")
        except BaseException:
            s.nbytes = old  # as it was: the bytes it held are free again
            alloc.allocate(s)
            raise
        finally:
            self._unlock(s)
            del locked[mark:]
        if s.slot >= 0:
            self.pool.stale.append(s)

    # ------------------------------------------------------------------ inspection
    def evict(self, t: Tensor) -> bool:
        """Evict the storage of ``t`` now, as a policy would; False if it is not a candidate
        (pinned, locked by a running op, not resident, or without history)."""
        s = t.storage
        if s.slot < 0 or s.locks:
            return False
        self._let_go(s)
        self.stats.evictions += 1
        return True

    def pin(self, t: Tensor, overwrite: bool = False) -> None:
        """Never evict the storage of ``t`` from now on (it is unsafe or unwanted to recompute).

        It is materialized first if it was evicted; since it will never be recomputed, its
        history is dropped, and inputs that only it still needed are freed. ``overwrite``:
        the program is about to write the storage outside the recorded history, so what was
        computed from it could not be recomputed after that: every value the program still
        holds that depends on it is materialized and pinned now, while the old contents are
        there, and what only those values needed is freed."""
        if overwrite:
            for d in self._held_descendants(t.storage):
                self.pin(d.tensors[0])
        if not t.defined:
            self.get_value(t)
        s = t.storage
        if not s.pinned and self._pinned is not None:
            self._pinned.append(s)
        s.pinned = True
        if s.slot >= 0:
            self.pool.remove(s)
        s.ev_parents = 0
        for p in self._detach(s):
            if self.free_dead:
                self._free(p)
