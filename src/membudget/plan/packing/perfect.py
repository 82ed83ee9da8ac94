"""Perfect-packing problems, made here: a time × address rectangle cut at random into
buffers, so every time step is full and the optimum equals the max-load bound by
construction. Held-out material for the packer, unlike the suite it was tuned on."""

from __future__ import annotations

import heapq
import random

from membudget.plan.problem import Buffer, Problem


def perfect_problem(buffers: int, seed: int, height: int = 1 << 20, span: int = 4096,
                    unit: int = 64) -> Problem:
    """``buffers`` rectangles tiling [0, span) × [0, height): the largest piece is cut in
    two (across time or across addresses, at a random point on a ``unit`` grid) until
    there are enough. Ids are shuffled so that no order of the file gives the answer."""
    rng = random.Random(seed)
    heap: list[tuple[float, tuple[int, int, int, int]]] = []

    def push(piece: tuple[int, int, int, int]) -> None:  # lower, upper, offset, size
        heapq.heappush(heap, (-(piece[1] - piece[0]) * piece[3] * rng.random(), piece))

    push((0, span, 0, height))
    done: list[tuple[int, int, int, int]] = []  # pieces too small to cut
    while heap and len(heap) + len(done) < buffers:
        lo, hi, off, size = heapq.heappop(heap)[1]
        if hi - lo > 1 and (size <= unit or rng.random() < 0.5):
            t = rng.randrange(lo + 1, hi)
            push((lo, t, off, size))
            push((t, hi, off, size))
        elif size > unit:
            cut = unit * rng.randrange(1, size // unit)
            push((lo, hi, off, cut))
            push((lo, hi, off + cut, size - cut))
        else:
            done.append((lo, hi, off, size))
    pieces = done + [piece for _, piece in heap]
    rng.shuffle(pieces)
    return Problem(tuple(Buffer(str(i), lo, hi, size)
                         for i, (lo, hi, _, size) in enumerate(pieces)))
