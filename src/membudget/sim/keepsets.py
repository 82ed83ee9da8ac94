"""The forward values of a training step, as static checkpointing sees them.

A *value* is a storage a call made: a fresh output, or the new version of an input the call
wrote (``mut``); views are folded into the storage they share. Each has a key ``(call,
slot)`` in the numbering of :mod:`membudget.sim.evictions` (slot = output position, the new
versions after the outputs), its bytes, the cost of the call that made it, the values it was
computed from, and the calls that read it (through any handle or view). A *forward* value is
one made before the forward/backward boundary; a static checkpointing strategy is a set of
forward values to keep (see :mod:`membudget.sim.baselines`).

The boundary is the trace's ``phase "backward"`` marker. Traces without one (the DTR logs of
models whose step is not one forward and one backward, e.g. ``unroll_gan``) get it at the
first call whose op name contains ``backward``; :attr:`StepGraph.boundary_source` says which.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from membudget.errors import MembudgetError
from membudget.sim.evictions import ValueKey
from membudget.trace.format import CALL, COPY, COPY_FROM, GET, PHASE, PIN, PUT, RELEASE, Trace

# Pointwise ops: each output element depends only on the same element of each input, so a
# fusing compiler (inductor, XLA) recomputes one inside the kernel that reads it at ~0 extra
# cost. The one list of them, by base name (:func:`op_base`), since a trace has op names
# and no schemas: those aten tags ``torch.Tag.pointwise`` (tests check the tag), then the
# fusible ops it does not tag: creation, casts, random ops and dropout, including the DTR
# logs' ``_fused_droupout_`` (sic) and ``_masked_scale``. Matmuls, convolutions,
# reductions, softmax and norms are not pointwise.
POINTWISE_TAGGED = frozenset({
    "abs", "add", "addcdiv", "addcmul", "bitwise_and", "bitwise_not", "bitwise_or", "clamp",
    "clamp_max", "clamp_min", "clone", "cos", "div", "elu", "eq", "erf", "exp", "expm1", "ge",
    "gelu", "gt", "hardsigmoid", "hardtanh", "le", "leaky_relu", "lerp", "log", "log1p",
    "logical_and", "logical_not", "lt", "masked_fill", "maximum", "minimum", "mish", "mul",
    "ne", "neg", "pow", "reciprocal", "relu", "relu6", "rsqrt", "rsub", "sigmoid", "sign",
    "silu", "sin", "sqrt", "square", "sub", "tanh", "threshold", "where",
})
POINTWISE_UNTAGGED = frozenset({
    "bernoulli", "dropout", "empty_like", "fill", "_fused_dropout", "_fused_droupout",
    "hardswish", "_masked_scale", "native_dropout", "ones_like", "scalar_tensor", "to",
    "_to_copy", "zero", "zeros_like",
})
POINTWISE_OPS = POINTWISE_TAGGED | POINTWISE_UNTAGGED


def op_base(op: str) -> str:
    """An op's name without namespace, overload and in-place underscore:
    ``aten.add_.Tensor`` -> ``add``, ``relu_`` -> ``relu``, ``_masked_scale`` as it is."""
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims", "torch") else parts[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def is_pointwise(op: str) -> bool:
    return op_base(op) in POINTWISE_OPS


@dataclass
class Value:
    """One storage of the step: a leaf (``call`` -1) or a value made by call ``call``."""

    index: int
    key: ValueKey | None  # (call, slot); None for a leaf
    call: int
    op: str
    nbytes: int
    cost: float  # the cost of the call that made it (0 for a leaf)
    parents: list[int] = field(default_factory=list)  # values it was computed from
    reads: list[int] = field(default_factory=list)  # calls that read it, in order
    held_at_boundary: bool = False  # the program holds it when the backward starts

    @property
    def leaf(self) -> bool:
        return self.key is None


class StepGraph:
    """The values of one trace and who reads them (see the module docstring)."""

    def __init__(self, trace: Trace) -> None:
        self.name = trace.name
        self.values: list[Value] = []
        self.call_ops: list[str] = []
        self.call_costs: list[float] = []
        self.call_inputs: list[list[int]] = []  # value indices each call reads (distinct)
        self.call_outputs: list[list[int]] = []  # values each call makes, by slot
        # value -> calls run before its last read outside a call: a GET, a PIN, being held
        # at a PIN with overwrite (the engine materializes and pins every held value computed
        # from what is overwritten), or being held at the end (read then: g.calls)
        self.late_reads: dict[int, int] = {}
        self.releases: dict[int, int] = {}  # value -> calls before the program dropped it
        self.boundary = -1  # index of the first backward call
        self.boundary_source = ""
        self._build(trace)

    # ------------------------------------------------------------------ building
    def _new(self, key: ValueKey | None, call: int, op: str, nbytes: int, cost: float,
             parents: Iterable[int] = ()) -> int:
        i = len(self.values)
        self.values.append(Value(i, key, call, op, nbytes, cost, list(dict.fromkeys(parents))))
        return i

    def _build(self, trace: Trace) -> None:
        handle: dict[int, int] = {}  # trace handle -> value index
        refs: list[int] = []  # live handles per value
        k = -1
        marker = -1  # calls before the "backward" phase marker
        live: set[int] = set()  # values with a handle

        def bind(tid: int, v: int) -> None:
            handle[tid] = v
            while len(refs) <= v:
                refs.append(0)
            refs[v] += 1
            live.add(v)

        def drop(tid: int) -> None:
            v = handle.pop(tid)
            refs[v] -= 1
            if not refs[v]:
                self.releases[v] = k + 1
                live.discard(v)

        late = self.late_reads

        held: list[int] | None = None  # values held at the phase marker
        guess: tuple[int, list[int]] | None = None  # the first *backward* op, and the same
        for ev in trace.events:
            kind = ev[0]
            if kind == CALL:
                _, _, op, ins, outs, nbytes, alias, cost, mut = ev
                k += 1
                if guess is None and marker < 0 and "backward" in op_base(op):
                    guess = (k, list(live))
                inputs = list(dict.fromkeys(handle[t] for t in ins))
                self.call_ops.append(op)
                self.call_costs.append(cost)
                self.call_inputs.append(inputs)
                for v in inputs:
                    self.values[v].reads.append(k)
                made = []
                for j, (tid, b, a) in enumerate(zip(outs, nbytes, alias, strict=True)):
                    if a >= 0:
                        v = handle[ins[a]]
                        base = self.values[v]
                        for p in inputs:  # a view's base gains the op's other inputs
                            if p != v and p not in base.parents:
                                base.parents.append(p)
                    else:
                        v = self._new((k, j), k, op, b, cost, inputs)
                        made.append(v)
                    bind(tid, v)
                for j, m in enumerate(mut):
                    v = self._new((k, len(outs) + j), k, op, self.values[handle[ins[m]]].nbytes,
                                  cost, inputs)
                    made.append(v)
                    drop(ins[m])
                    bind(ins[m], v)
                self.call_outputs.append(made)
            elif kind == PUT:
                bind(ev[2], self._new(None, -1, "put", ev[3], 0.0))
            elif kind == RELEASE:
                drop(ev[2])
            elif kind == COPY:
                bind(ev[3], handle[ev[2]])
            elif kind == COPY_FROM:
                src = handle[ev[2]]
                if handle.get(ev[3]) != src:
                    if ev[3] in handle:
                        drop(ev[3])
                    bind(ev[3], src)
            elif kind in (GET, PIN):
                late[handle[ev[2]]] = k + 1
                if kind == PIN and ev[3]:
                    for v in live:
                        late[v] = k + 1
            elif kind == PHASE and ev[2] == "backward" and marker < 0:
                marker = k + 1
                held = list(live)
        for v in live:
            late[v] = k + 1
        if marker >= 0:
            self.boundary, self.boundary_source = marker, "phase marker"
        elif guess is not None:
            self.boundary, held = guess
            self.boundary_source = f"inferred: first *backward* op ({self.call_ops[guess[0]]})"
        else:
            raise MembudgetError(f"{self.name}: no backward phase marker and no op named "
                                 "*backward*: cannot tell the forward from the backward")
        for v in held or ():
            self.values[v].held_at_boundary = True

    # ------------------------------------------------------------------ queries
    @property
    def calls(self) -> int:
        return len(self.call_ops)

    def by_key(self) -> dict[ValueKey, int]:
        return {v.key: v.index for v in self.values if v.key is not None}

    def forward(self, v: Value) -> bool:
        return not v.leaf and v.call < self.boundary

    def forward_values(self) -> list[Value]:
        return [v for v in self.values if self.forward(v)]

    def results(self) -> set[int]:
        """Forward values the program reads after the backward started other than by a
        call (the loss it prints, what it holds at the end or at the optimizer's writes):
        a strategy keeps them, since evicting them only adds their recomputation."""
        return {v for v, c in self.late_reads.items()
                if c > self.boundary and self.forward(self.values[v])}

    def last_forward_read(self, v: Value) -> int:
        """The last forward call that reads ``v`` (its own call if none does)."""
        last = v.call
        for c in v.reads:
            if c < self.boundary:
                last = max(last, c)
        return last

    def saved(self) -> list[Value]:
        """The forward values the backward needs that the program holds at the boundary:
        what autograd saved (the activation memory a checkpointing strategy trades)."""
        return [v for v in self.forward_values() if v.held_at_boundary and v.nbytes > 0]

    def crossing(self) -> list[list[int]]:
        """For each forward call k, the forward values live across the gap after it: made at
        or before k and read by a forward call after k."""
        n = self.boundary
        starts: list[list[int]] = [[] for _ in range(n)]
        ends = [0] * len(self.values)
        for v in self.forward_values():
            last = self.last_forward_read(v)
            if last > v.call:
                starts[v.call].append(v.index)
                ends[v.index] = last
        out: list[list[int]] = []
        live: set[int] = set()
        for k in range(n):
            live.update(starts[k])
            live = {v for v in live if ends[v] > k}
            out.append(sorted(live))
        return out


# ---------------------------------------------------------------------------------- cuts
# A forward value read across more than this fraction of the forward calls is *carried*
# (an encoder's memory read by every decoder layer, a mask, a U-Net skip, DenseNet's
# features within a block): it crosses every gap of that stretch, so it is kept along with
# whatever cut it crosses and does not count against a gap being a cut.
CARRIED_FRACTION = 1 / 8
# Candidate cuts must leave no stretch of the forward longer than this fraction of its cost
# without one; else gaps crossed by two (three, ...) short-lived values are candidates too
# (an LSTM's step carries h and c).
COVER_FRACTION = 1 / 4


@dataclass
class Gap:
    """The gap after forward call ``after``: the forward values crossing it (``values``),
    and those of them that are not carried (``narrow``)."""

    after: int
    position: float  # forward cost of the calls up to and including ``after``
    values: list[int]
    narrow: list[int]
    held: bool  # the program holds every narrow value into the backward
    nbytes: int  # bytes of the narrow values

    def rank(self) -> tuple[int, int, int]:
        """Smaller is a better cut: held first, then fewest values, then fewest bytes."""
        return (0 if self.held else 1, len(self.narrow), self.nbytes)


def gaps(g: StepGraph) -> list[Gap]:
    """Every gap inside the forward (after call 0 … before the last forward call)."""
    n = g.boundary
    long = max(1, int(n * CARRIED_FRACTION))
    carried = {v.index for v in g.forward_values() if g.last_forward_read(v) - v.call > long}
    out, pos = [], 0.0
    for k, crossing in enumerate(g.crossing()[:max(0, n - 1)]):
        pos += g.call_costs[k]
        narrow = [v for v in crossing if v not in carried]
        out.append(Gap(k, pos, crossing, narrow,
                       all(g.values[v].held_at_boundary for v in narrow),
                       sum(g.values[v].nbytes for v in narrow)))
    return out


def forward_cost(g: StepGraph) -> float:
    return sum(g.call_costs[:g.boundary])


def cut_candidates(g: StepGraph) -> tuple[list[Gap], int]:
    """The gaps a checkpointing strategy may cut at, and the width ``c`` they share: gaps
    crossed by at most ``c`` non-carried values, for the least ``c`` whose gaps cover the
    forward (:data:`COVER_FRACTION`). With ``c`` = 1 these are the articulation points of
    the forward graph: one value every later forward path passes through (on a chain, every
    activation)."""
    all_gaps = [gp for gp in gaps(g) if gp.narrow]
    total = forward_cost(g)
    if not all_gaps:
        return [], 0
    widest = max(len(gp.narrow) for gp in all_gaps)
    for c in range(1, widest + 1):
        chosen = [gp for gp in all_gaps if len(gp.narrow) <= c]
        marks = [(-1, 0.0), *((gp.after, gp.position) for gp in chosen),
                 (g.boundary - 1, total)]
        if all(b - a <= 1 or q - p <= COVER_FRACTION * total  # one call: nothing to cut
               for (a, p), (b, q) in itertools.pairwise(marks)):
            return chosen, c
    return all_gaps, widest


def _boundaries(cands: list[Gap]) -> list[list[int]]:
    """Ways to place block boundaries at candidate cuts: a run of adjacent candidates (a
    cut value, then ops that only read the previous one, as a relu after a residual add)
    is one boundary, at its first or its last held gap (a block's input must be held to be
    kept), or each held gap of it is one; a run with no held gap, at its best-ranked."""
    runs: list[list[Gap]] = []
    for gp in cands:
        if runs and gp.after == runs[-1][-1].after + 1:
            runs[-1].append(gp)
        else:
            runs.append([gp])
    held = [[gp.after for gp in run if gp.held] or [min(run, key=Gap.rank).after]
            for run in runs]
    return [[h[0] for h in held], [h[-1] for h in held], [a for h in held for a in h]]


@dataclass
class KeepSet:
    """A static strategy: the forward values to keep (indices into ``StepGraph.values``);
    every other forward value is evicted after its last forward read. ``info``: how it was
    chosen, for reports."""

    name: str
    keep: set[int]
    info: dict[str, object] = field(default_factory=dict)


def all_forward(g: StepGraph) -> set[int]:
    return {v.index for v in g.forward_values()}


def chen_sqrt(g: StepGraph, segments: int | None = None) -> KeepSet:
    """Chen et al.'s √n checkpointing: a forward of n activations (:meth:`StepGraph.saved`;
    on a chain, one per op) is cut into about √n segments of about equal forward cost, each
    at a cut (see :func:`cut_candidates`: near each target, the best-ranked one within half
    a segment), and the values crossing the cuts are kept: in the backward each segment is
    recomputed once, from its cut. Only cuts whose values the program holds into the
    backward qualify (the engine drops a released value at once: it cannot be kept); a
    target with no such cut within half a segment, or only cuts next to one already taken,
    gets none (fewer, longer segments)."""
    cuts, width = cut_candidates(g)
    n = len(g.saved())
    s = segments if segments is not None else max(1, round(math.sqrt(n)))
    s = min(s, len(cuts) + 1)
    total = forward_cost(g)
    chosen: dict[int, Gap] = {}
    if cuts and s > 1:
        half = total / (2 * s)
        for j in range(1, s):
            target = j * total / s
            free = [gp for gp in cuts  # held (else not keepable), and not next to a cut
                    if gp.held and not any(abs(gp.after - c) <= 1 for c in chosen)]
            near = [gp for gp in free if abs(gp.position - target) <= half]
            if not near:
                continue
            best = min(near, key=lambda gp, t=target: (*gp.rank(), abs(gp.position - t)))
            chosen[best.after] = best
    keep = {v for gp in chosen.values() for v in gp.values}
    return KeepSet("chen-sqrt", keep, {"activations": n, "candidates": len(cuts),
                                       "width": width, "segments": len(chosen) + 1,
                                       "cuts": sorted(chosen)})


def per_block(g: StepGraph, blocks: list[tuple[int, int]] | None = None) -> KeepSet:
    """Per-block checkpointing (what ``gradient_checkpointing_enable`` does in HF
    models): inside each block ``[begin, end)`` of forward calls, keep only what leaves it
    (read by a forward call after ``end``: the next block's input); everything made outside
    the blocks (stem, head, the loss) is kept. ``blocks`` default: :func:`infer_blocks`."""
    source = "given"
    if blocks is None:
        blocks, source = infer_blocks(g), "inferred"
    if not blocks:
        raise MembudgetError(f"{g.name}: no repeated blocks found")
    owner: dict[int, int] = {}
    for b, e in blocks:
        for k in range(b, min(e, g.boundary)):
            owner[k] = e
    keep = set()
    for v in g.forward_values():
        e = owner.get(v.call)
        if e is None or g.last_forward_read(v) >= e:
            keep.add(v.index)
    # A block input the program does not hold (a residual sum that only a pad or a norm
    # reads, and that saves its own output) is dropped by the engine once released, and a
    # recomputation in the block would recompute it, and the previous block, and so on;
    # checkpointing holds the input itself. Here the held values the block computes from it
    # directly stand in for it.
    moved = 0
    for b, e in blocks:
        for k in range(b, min(e, g.boundary)):
            for v in g.call_inputs[k]:
                val = g.values[v]
                if g.forward(val) and not b <= val.call < e and not val.held_at_boundary:
                    new = {c for c in g.call_outputs[k] if g.values[c].held_at_boundary}
                    moved += len(new - keep)
                    keep |= new
    return KeepSet("per-block", keep, {"blocks": len(blocks), "block_source": source,
                                       "stand_ins": moved})


def infer_blocks(g: StepGraph, max_period: int = 4) -> list[tuple[int, int]]:
    """Blocks from the forward graph alone: the segments between cuts (each way of
    :func:`_boundaries`; the one whose blocks cover the most calls), grouped into layers
    where their op sequences repeat with a period of up to ``max_period`` segments (a
    transformer layer is two segments, attention and MLP, in the DTR logs' post-norm
    encoder; a ResNet stage's first block differs from the next). Segments before the first
    repeat and after the last are outside; a repeated group of a single op is no layer."""
    best: list[tuple[int, int]] = []
    for cuts in _boundaries(cut_candidates(g)[0]):
        blocks = _layers(g, cuts, max_period)
        if sum(e - b for b, e in blocks) > sum(e - b for b, e in best):
            best = blocks
    return best


def _layers(g: StepGraph, cuts: list[int], max_period: int) -> list[tuple[int, int]]:
    if not cuts:
        return []
    edges = [0, *[c + 1 for c in cuts], g.boundary]
    segs = [(a, b) for a, b in itertools.pairwise(edges) if b > a]
    sig = [tuple(op_base(g.call_ops[k]) for k in range(a, b)) for a, b in segs]
    m = len(segs)
    groups: list[tuple[int, int, bool]] = []  # (first segment, last + 1, repeated)
    i = 0
    while i < m:
        p = next((p for p in range(1, max_period + 1)
                  if i + 2 * p <= m and sig[i:i + p] == sig[i + p:i + 2 * p]), None)
        if p is None:
            groups.append((i, i + 1, False))
            i += 1
            continue
        j = i
        while j + p <= m and sig[j:j + p] == sig[i:i + p]:
            groups.append((j, j + p, True))
            j += p
        i = j
    groups = [(a, b, r and segs[b - 1][1] - segs[a][0] >= 2)  # a layer has two ops or more
              for a, b, r in groups]
    rep = [n for n, grp in enumerate(groups) if grp[2]]
    if not rep:
        return []
    return [(segs[a][0], segs[b - 1][1]) for a, b, _ in groups[rep[0]:rep[-1] + 1]]


# ---------------------------------------------------------------------------------- SAR
MATMULS = frozenset({"bmm", "matmul", "baddbmm", "mm"})
SOFTMAXES = frozenset({"softmax", "_softmax", "_safe_softmax", "safe_softmax"})
VIEWLIKE = frozenset({"view", "_unsafe_view", "reshape", "expand", "transpose", "permute",
                      "as_strided", "clone", "contiguous", "detach", "alias", "t", "squeeze",
                      "unsqueeze", "slice", "select"})


class NotATransformer(MembudgetError):
    """Selective recomputation was asked of a trace with no attention core."""


def attention_cores(g: StepGraph) -> list[list[int]]:
    """Megatron's attention cores: for each softmax whose input comes (through scaling,
    masking and views) from a matmul (QKᵀ) and whose output reaches (through dropout and
    views) a matmul (PV), the forward values on the paths from QKᵀ's output to PV's inputs
    (scores, masked scores, probabilities, dropout mask and dropped probabilities)."""
    children: dict[int, list[int]] = {}
    for v in g.values:
        for p in v.parents:
            children.setdefault(p, []).append(v.index)
    parents = {v.index: v.parents for v in g.values}
    score_ops = POINTWISE_OPS | VIEWLIKE
    cores = []
    for k in range(g.boundary):
        if op_base(g.call_ops[k]) not in SOFTMAXES:
            continue
        qk = _find_up(g, g.call_inputs[k], score_ops)
        pv = _find_down(g, children, g.call_outputs[k], score_ops)
        if qk is None or pv is None:
            continue
        down = _within(g, g.call_outputs[qk], children, qk, pv)
        up = _within(g, g.call_inputs[pv], parents, qk, pv)
        cores.append(sorted(down & up))
    return cores


def _find_up(g: StepGraph, start: list[int], through: frozenset[str],
             depth: int = 8) -> int | None:
    """The matmul call that the values ``start`` come from through ``through`` ops."""
    frontier = list(start)
    for _ in range(depth):
        nxt = []
        for v in frontier:
            val = g.values[v]
            if val.leaf:
                continue
            base = op_base(val.op)
            if base in MATMULS:
                return val.call
            if base in through:
                nxt.extend(val.parents)
        frontier = nxt
    return None


def _find_down(g: StepGraph, children: dict[int, list[int]], start: list[int],
               through: frozenset[str], depth: int = 8) -> int | None:
    """The first matmul call that reads the values ``start`` through ``through`` ops."""
    frontier = list(start)
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for k in g.values[v].reads:
                if k >= g.boundary:
                    continue
                base = op_base(g.call_ops[k])
                if base in MATMULS:
                    return k
                if base in through:
                    nxt.extend(g.call_outputs[k])
            nxt.extend(c for c in children.get(v, []) if op_base(g.values[c].op) in through)
        frontier = list(dict.fromkeys(nxt))
    return None


def _within(g: StepGraph, start: Iterable[int], step: dict[int, list[int]], lo: int,
            hi: int) -> set[int]:
    """The values reachable from ``start`` along ``step`` while made by calls in
    ``[lo, hi)`` (``start`` included where it is)."""
    def ok(v: int) -> bool:
        return not g.values[v].leaf and lo <= g.values[v].call < hi

    seen: set[int] = set()
    work = [v for v in start if ok(v)]
    while work:
        v = work.pop()
        if v in seen:
            continue
        seen.add(v)
        work.extend(u for u in step.get(v, ()) if ok(u) and u not in seen)
    return seen


def selective(g: StepGraph) -> KeepSet:
    """Megatron-LM's selective activation recomputation (Korthikanti et al.): keep every
    forward value except the attention cores' (:func:`attention_cores`)."""
    cores = attention_cores(g)
    if not cores:
        raise NotATransformer(
            f"{g.name}: selective recomputation needs a transformer trace, and this one has "
            "no attention core (a softmax between a QK^T matmul and a PV matmul)")
    core = {v for c in cores for v in c}
    return KeepSet("selective", all_forward(g) - core,
                   {"cores": len(cores), "core_values": len(core),
                    "core_bytes": sum(g.values[v].nbytes for v in core
                                      if g.values[v].held_at_boundary)})


# ---------------------------------------------------------------------------------- knapsack
def recompute_cost(g: StepGraph, v: Value, fusion_aware: bool) -> float:
    """What the knapsack charges for not saving ``v``: its op's cost, 0 for a pointwise op
    under ``fusion_aware`` (it would be fused into its consumer). Recomputing ``v``'s own
    evicted inputs is not counted: the simulator measures that."""
    return 0.0 if fusion_aware and is_pointwise(v.op) else v.cost


def knapsack(sizes: list[int], values: list[int], capacity: int,
             time_limit: float = 30.0) -> tuple[list[int], bool]:
    """The items to take (indices) maximising total value with total size <= capacity, as
    a MIP by SCIP through OR-Tools' knapsack interface (exact, on the true byte sizes; its
    own branch and bound took 30 s on GPT-2's 274 items without proving what SCIP proves in
    0.05 s); and whether the optimum was proved within ``time_limit`` seconds."""
    from ortools.algorithms.python import knapsack_solver

    take = [i for i, (s, v) in enumerate(zip(sizes, values, strict=True)) if v > 0 and s > 0]
    free = [i for i, (s, v) in enumerate(zip(sizes, values, strict=True)) if v > 0 and s == 0]
    if not take:
        return free, True
    solver = knapsack_solver.KnapsackSolver(
        knapsack_solver.SolverType.KNAPSACK_MULTIDIMENSION_SCIP_MIP_SOLVER, "saved")
    solver.set_time_limit(time_limit)
    solver.init([values[i] for i in take], [[sizes[i] for i in take]], [max(0, capacity)])
    solver.solve()
    chosen = [i for n, i in enumerate(take) if solver.best_solution_contains(n)]
    return sorted(chosen + free), solver.is_solution_optimal()


def min_cut(g: StepGraph, budget: int, fusion_aware: bool = False) -> KeepSet:
    """The knapsack behind torch.compile's ``activation_memory_budget`` (He & Yu): of the
    activations the backward needs (:meth:`StepGraph.saved`), save the set of most total
    recompute cost (:func:`recompute_cost`) whose bytes fit ``budget``; the rest are
    recomputed. Other forward values are kept (the program drops them anyway)."""
    items = g.saved()
    costs = [round(recompute_cost(g, v, fusion_aware)) for v in items]
    chosen, optimal = knapsack([v.nbytes for v in items], costs, budget)
    saved = {items[i].index for i in chosen}
    dropped = {v.index for v in items} - saved
    return KeepSet("min-cut", all_forward(g) - dropped,
                   {"budget_bytes": budget, "fusion_aware": fusion_aware, "optimal": optimal,
                    "saved_bytes": sum(items[i].nbytes for i in chosen),
                    "items": len(items), "saved": len(chosen),
                    "estimated_recompute": sum(c for i, c in enumerate(costs)
                                               if items[i].index in dropped)})
