"""An independent check that a static plan is safe on every interleaving of its streams.

It trusts neither the packer nor :func:`membudget.plan.streams.conflict_graph`: it
re-derives the dependencies from the program (tensors, stream order, waits), orders the ops
by depth-first search, keeps each op's ancestors as a Python integer, and checks every pair
of buffers that overlap in address: one of the two must be dead before the other is first
written, on every execution (every use of it an ancestor of the other's producer).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass

from membudget.plan.graph import LEAF
from membudget.plan.streams import StreamError, StreamProgram, buffer_id
from membudget.plan.validate import PackingError, checked_offset


class UnsafeSharingError(PackingError):
    """Two tensors that may be live at once on some interleaving of the streams overlap in
    address; the message names both and the ops that leave them unordered."""


@dataclass(frozen=True)
class UnsafePair:
    """Buffers ``first`` and ``second`` share the addresses ``[low, high)`` although some
    interleaving has both live; ``reason`` names the ops that are not ordered."""

    first: str
    second: str
    low: int
    high: int
    reason: str


@dataclass(frozen=True)
class _Use:
    """A buffer as the check sees it: where it is, which op makes it (LEAF: a leaf) and the
    bit set of the ops that touch it (its producer included)."""

    id: str
    offset: int
    size: int
    src: int
    uses: int
    to_end: bool


def _ancestors(program: StreamProgram) -> list[int]:
    """Each op's strict ancestors under tensors, stream order and waits, as bit sets (bit u
    of ``anc[v]``: op u finishes before op v starts on every execution)."""
    g = program.graph
    preds: list[set[int]] = [set() for _ in range(g.n)]
    for t in g.tensors:
        if t.src != LEAF:
            for s in t.sinks:
                preds[s].add(t.src)
    last: dict[int, int] = {}
    for v, stream in enumerate(program.streams):
        if stream in last:
            preds[v].add(last[stream])
        last[stream] = v
    for u, v in program.waits:
        preds[v].add(u)
    anc = [0] * g.n
    done = [False] * g.n
    on_path: set[int] = set()
    for root in range(g.n):
        if done[root]:
            continue
        stack = [(root, iter(sorted(preds[root])))]
        on_path.add(root)
        while stack:
            v, todo = stack[-1]
            u = next((p for p in todo if not done[p]), None)
            if u is None:
                for p in preds[v]:
                    anc[v] |= anc[p] | (1 << p)
                done[v] = True
                on_path.discard(v)
                stack.pop()
            elif u in on_path:
                raise StreamError(f"the dependencies form a cycle through op "
                                  f"{program.describe(u)}")
            else:
                on_path.add(u)
                stack.append((u, iter(sorted(preds[u]))))
    return anc


def _buffers(program: StreamProgram, offsets: Mapping[str, int],
             capacity: int | None) -> list[_Use]:
    """The program's tensors of size > 0 with their offsets, checked to be whole: every one
    has a non-negative integer offset (within ``capacity``) and no other id has one."""
    out = []
    for k, t in enumerate(program.graph.tensors):
        if t.size <= 0:
            continue
        bid = buffer_id(k, t)
        off = checked_offset(bid, t.size, offsets, capacity)
        uses = 0 if t.src == LEAF else 1 << t.src
        for s in t.sinks:
            uses |= 1 << s
        out.append(_Use(bid, off, t.size, t.src, uses, t.to_end))
    unknown = sorted(set(offsets) - {b.id for b in out})
    if unknown:
        raise PackingError(f"offsets given for {len(unknown)} buffer(s) the program does not "
                           f"have, e.g. {unknown[0]!r}")
    return out


def _before(anc: list[int], a: _Use, b: _Use) -> bool:
    """Whether ``a`` is dead before ``b`` is first written on every execution: every use of
    ``a`` is an ancestor of ``b``'s producer."""
    return (a.src != LEAF and not a.to_end and b.src != LEAF
            and a.uses & ~anc[b.src] == 0)


def _why_not_before(program: StreamProgram, anc: list[int], a: _Use, b: _Use) -> str:
    """Why ``a`` may still be live when ``b`` is first written on some execution: a use of
    ``a`` unordered with ``b``'s producer, else one that runs after it."""
    if a.src == LEAF:
        return f"{a.id!r} is a leaf, live for the whole step"
    if a.to_end:
        return f"{a.id!r} is held to the end of the step"
    if b.src == LEAF:
        return f"{b.id!r} is a leaf, live from the start of the step"
    late = a.uses & ~anc[b.src]
    if late >> b.src & 1:
        return f"{program.describe(b.src)} uses {a.id!r} and writes {b.id!r}"
    ops = []
    while late:
        low = late & -late
        ops.append(low.bit_length() - 1)
        late ^= low
    unordered = [x for x in ops if not anc[x] >> b.src & 1]  # nor after b's producer
    x = (unordered or ops)[-1]
    how = "unordered with" if unordered else "which runs after"
    return (f"{a.id!r} is used by {program.describe(x)}, {how} {program.describe(b.src)}, "
            f"which writes {b.id!r}")


def _unsafe(program: StreamProgram, bufs: list[_Use]) -> list[UnsafePair]:
    """Every pair of ``bufs`` that overlap in address while some interleaving has both live,
    in address order: a sweep over the buffers sorted by offset meets each overlap once."""
    bufs = sorted(bufs, key=lambda b: (b.offset, b.id))
    anc = _ancestors(program)
    starts = [b.offset for b in bufs]
    found = []
    for i, a in enumerate(bufs):
        for j in range(i + 1, bisect_left(starts, a.offset + a.size, lo=i + 1)):
            b = bufs[j]
            if _before(anc, a, b) or _before(anc, b, a):
                continue
            found.append(UnsafePair(a.id, b.id, b.offset,
                                    min(a.offset + a.size, b.offset + b.size),
                                    f"{_why_not_before(program, anc, a, b)}; and "
                                    f"{_why_not_before(program, anc, b, a)}"))
    return found


def unsafe_pairs(program: StreamProgram, offsets: Mapping[str, int],
                 capacity: int | None = None) -> list[UnsafePair]:
    """Every pair of buffers of a plan that overlap in address while some interleaving has
    both live, in address order; the offsets are first checked as by
    :func:`validate_streams`."""
    return _unsafe(program, _buffers(program, offsets, capacity))


def validate_streams(program: StreamProgram, offsets: Mapping[str, int],
                     capacity: int | None = None) -> int:
    """Check a plan of a stream program and return its height (0 for no buffers): every
    buffer has an offset, and no two that may be live at once overlap in address. Raises
    UnsafeSharingError naming the first such pair (in address order) and why."""
    bufs = _buffers(program, offsets, capacity)
    pairs = _unsafe(program, bufs)
    if pairs:
        p = pairs[0]
        raise UnsafeSharingError(
            f"buffers {p.first!r} and {p.second!r} share the addresses [{p.low}, {p.high}) "
            f"but may be live at once on some interleaving of the streams: {p.reason}"
            + (f" ({len(pairs) - 1} more unsafe pair(s))" if len(pairs) > 1 else ""))
    return max((b.offset + b.size for b in bufs), default=0)
