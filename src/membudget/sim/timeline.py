"""Record where every storage lived in a layout-aware pool, then draw it or export it.

:class:`Recorder` watches a layout-aware allocator (best-fit, two-sided, torch-caching) and
logs each placement and release against the executed-op count. From that log,
:func:`plot_timeline` draws an address-over-time PNG, and :func:`write_snapshot` writes a
pickle in PyTorch's memory-snapshot format (``torch.cuda.memory._snapshot()``), which
pytorch.org/memory_viz and ``torch.cuda._memory_viz`` read without a GPU.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from membudget.core.allocators import layout_names
from membudget.outputs import replacing

if TYPE_CHECKING:
    from membudget.core.allocators.block import Block
    from membudget.core.engine import Engine
    from membudget.core.records import Storage

MIB = 1 << 20
CATEGORIES = ("activation", "gradient", "parameter", "recomputed")
COLORS = {"activation": "tab:blue", "gradient": "tab:orange", "parameter": "tab:green",
          "recomputed": "tab:red"}
FREE_COLOR = "#e6e6e6"
PARAMETER_KINDS = frozenset(("leaf", "constant", "parameter", "param"))

# Event actions (the first two are the recorder's own; the others are PyTorch's names).
ALLOC, FREE, SEGMENT_ALLOC, SEGMENT_FREE = "alloc", "free", "segment_alloc", "segment_free"

# Settings of a default PyTorch caching allocator, for tools that read them.
_ALLOCATOR_SETTINGS = {
    "PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
    "expandable_segments": False, "pinned_num_register_threads": 1,
    "release_lock_on_cudamalloc": False, "pinned_use_cuda_host_register": False,
    "roundup_power2_divisions": {},
}


class Interval(NamedTuple):
    """``size`` bytes at ``addr`` held by storage ``storage`` from op ``start`` to op ``end``.

    Times are executed ops (program and recomputation); ``end == start`` means the block was
    taken and given back while one op ran (the engine's temporary duplicates).
    """

    start: int
    end: int
    addr: int
    size: int
    category: str
    storage: int


class Recorder:
    """Logs every placement and release of ``engine``'s allocator, as its observer.

    ``events`` holds one tuple per event, ``(seq, time, action, addr, size, requested,
    storage id, category)``: ``seq`` counts events (it orders those of one op), ``time`` is
    the number of ops executed so far, ``action`` is "alloc", "free", "segment_alloc" or
    "segment_free", ``size`` the block's bytes and ``requested`` the storage's. Attach it
    before the run: the pool must be empty.
    """

    def __init__(self, engine: Engine) -> None:
        alloc = engine.allocator
        if not alloc.has_layout:
            raise ValueError(f"the {alloc.name!r} allocator has no address layout to record; "
                             f"use {layout_names()}")
        if alloc.used:
            raise ValueError("attach the recorder before the run: the pool already holds "
                             f"{alloc.used} bytes")
        if alloc.observer is not None:
            raise ValueError(f"the allocator is already observed by {alloc.observer!r}")
        self.engine = engine
        self.pool_bytes = int(alloc.capacity)
        self.events: list[tuple[int, int, str, int, int, int, int, str]] = []
        self.segmented = False  # did the allocator report segments (torch-caching)?
        self._stats = engine.stats
        alloc.observer = self

    def now(self) -> int:
        """Ops executed so far (program ops and recomputations)."""
        st = self._stats
        return st.ops + st.remat_ops

    # ------------------------------------------------------------------ observer hooks
    def on_alloc(self, s: Storage, block: Block) -> None:
        if s.pinned or s.kind in PARAMETER_KINDS:
            category = "parameter"
        elif s.kind == "gradient":
            category = "gradient"
        elif s.evicted:  # the engine clears it once the storage is placed again
            category = "recomputed"
        else:
            category = "activation"
        st = self._stats
        ev = self.events
        ev.append((len(ev), st.ops + st.remat_ops, ALLOC, block.addr, block.size, s.nbytes,
                   s.id, category))

    def on_free(self, s: Storage, block: Block) -> None:
        st = self._stats
        ev = self.events
        ev.append((len(ev), st.ops + st.remat_ops, FREE, block.addr, block.size, s.nbytes,
                   s.id, ""))

    def on_segment(self, action: str, addr: int, size: int) -> None:
        self.segmented = True
        st = self._stats
        ev = self.events
        ev.append((len(ev), st.ops + st.remat_ops, action, addr, size, size, -1, ""))

    # ------------------------------------------------------------------ results
    def intervals(self) -> list[Interval]:
        """Every allocation as a closed interval, in the order they ended; those still held
        end at the current time."""
        held: dict[int, tuple[int, int, str, int]] = {}
        out: list[Interval] = []
        for _, time, action, addr, size, _, sid, category in self.events:
            if action == ALLOC:
                held[addr] = (time, size, category, sid)
            elif action == FREE:
                start, size, category, sid = held.pop(addr)
                out.append(Interval(start, time, addr, size, category, sid))
        end = self.now()
        out.extend(Interval(start, end, addr, size, category, sid)
                   for addr, (start, size, category, sid) in held.items())
        return out


def plot_timeline(recorder: Recorder, path: str | Path, title: str = "Memory timeline",
                  pool_bytes: int | None = None) -> Path:
    """Draw the pool's address space (MiB, y) over executed ops (x) as a PNG at ``path``.

    One rectangle per interval, coloured by category, over a grey band for the pool
    [0, ``pool_bytes``) (default: the allocator's capacity). An interval that began and ended
    within one op is drawn one op wide, since its bytes were held while that op ran.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    pool = recorder.pool_bytes if pool_bytes is None else pool_bytes
    ivs = recorder.intervals()
    fig = Figure(figsize=(12, 6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.axhspan(0, pool / MIB, color=FREE_COLOR, zorder=0)
    x_max = max(recorder.now(), 1)
    if ivs:
        a = np.array([iv[:4] for iv in ivs], dtype=np.float64)
        x0 = a[:, 0]
        x1 = np.maximum(a[:, 1], x0 + 1)
        y0 = a[:, 2] / MIB
        y1 = (a[:, 2] + a[:, 3]) / MIB
        verts = np.stack([np.column_stack(p) for p in
                          ((x0, y0), (x0, y1), (x1, y1), (x1, y0))], axis=1)
        cats = np.array([iv.category for iv in ivs])
        for category in CATEGORIES:
            mask = cats == category
            if mask.any():
                ax.add_collection(PolyCollection(verts[mask], facecolors=COLORS[category],
                                                 edgecolors="none", linewidths=0, zorder=1))
        x_max = max(x_max, float(x1.max()))
    ax.set_xlim(0, x_max)
    ax.set_ylim(0, max(pool / MIB, 1e-9))
    ax.set_xlabel("time (executed ops)")
    ax.set_ylabel("address (MiB)")
    ax.set_title(title)
    handles = [Patch(color=COLORS[c], label=c) for c in CATEGORIES]
    handles.append(Patch(color=FREE_COLOR, label="free"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    out = Path(path)
    with replacing(out) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format=out.suffix[1:] or "png")
    return out


def make_snapshot(recorder: Recorder, pool_bytes: int | None = None,
                  device: int = 0) -> dict[str, Any]:
    """The recording as the dict ``torch.cuda.memory._snapshot()`` returns.

    ``device_traces[device]`` is the event trace, with ``time_us`` set to the op time so the
    viewer's time axis counts ops. A pool that reports no segments (best-fit, two-sided) is
    one segment of ``pool_bytes`` (default: the allocator's capacity) at address 0, reserved
    at time 0; otherwise the segments are the allocator's and ``pool_bytes`` is not used.
    ``segments`` is the final state, from the allocator's live layout.
    """
    trace: list[dict[str, Any]] = []
    blocks = recorder.engine.allocator.layout()
    if recorder.segmented:
        groups: dict[int, list[Block]] = {}
        for b in blocks:
            groups.setdefault(b.segment, []).append(b)
        segments = [_segment(device, g) for g in groups.values()]
    else:
        pool = recorder.pool_bytes if pool_bytes is None else pool_bytes
        extent = sum(b.size for b in blocks)
        if extent != pool:
            raise ValueError(f"pool_bytes={pool} but the allocator's pool has {extent} bytes")
        trace.append(_entry(SEGMENT_ALLOC, 0, pool, 0))
        segments = [_segment(device, blocks)]
    for _, time, action, addr, _, requested, _, _ in recorder.events:
        if action == FREE:
            trace.append(_entry("free_requested", addr, requested, time))
            trace.append(_entry("free_completed", addr, requested, time))
        else:
            trace.append(_entry(action, addr, requested, time))
    segments.sort(key=lambda seg: seg["address"])
    return {"segments": segments,
            "device_traces": [[] for _ in range(device)] + [trace],
            "allocator_settings": dict(_ALLOCATOR_SETTINGS)}


def write_snapshot(recorder: Recorder, path: str | Path, pool_bytes: int | None = None,
                   device: int = 0) -> Path:
    """Pickle :func:`make_snapshot` to ``path`` (open it at pytorch.org/memory_viz)."""
    out = Path(path)
    with replacing(out) as tmp, tmp.open("wb") as f:
        pickle.dump(make_snapshot(recorder, pool_bytes, device), f)
    return out


def _entry(action: str, addr: int, size: int, time: int) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time,
            "frames": []}


def _segment(device: int, blocks: list[Block]) -> dict[str, Any]:
    """A snapshot segment made of ``blocks`` (contiguous, in address order)."""
    blocks = sorted(blocks, key=lambda b: b.addr)
    out = []
    allocated = requested = 0
    for b in blocks:
        s = b.storage
        if s is None:
            out.append({"address": b.addr, "size": b.size, "requested_size": 0,
                        "state": "inactive", "frames": []})
        else:
            allocated += b.size
            requested += s.nbytes
            out.append({"address": b.addr, "size": b.size, "requested_size": s.nbytes,
                        "state": "active_allocated", "frames": []})
    return {"device": device, "address": blocks[0].addr,
            "total_size": sum(b.size for b in blocks), "allocated_size": allocated,
            "active_size": allocated, "requested_size": requested, "stream": 0,
            "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": [], "blocks": out}
