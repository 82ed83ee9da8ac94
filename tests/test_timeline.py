"""The allocation timeline: Recorder intervals, the PNG plot and the PyTorch memory snapshot.

The snapshot is checked by PyTorch's own viewer code (``torch.cuda._memory_viz``), which runs
without a GPU: its text reports must describe our pool, and its HTML builders must accept it.
"""

from __future__ import annotations

import base64
import json
import pickle
import random
import re
from itertools import pairwise
from types import SimpleNamespace

import pytest

from membudget.core import Engine, Storage
from membudget.core.allocators import Block
from membudget.core.stats import Stats
from membudget.sim.timeline import (
    CATEGORIES,
    Interval,
    Recorder,
    make_snapshot,
    plot_timeline,
    write_snapshot,
)

B = 100  # bytes of one activation in the chain program


def chain_program(allocator: str = "best-fit") -> tuple[Engine, Recorder]:
    """x0 (leaf) -> x1 -> ... -> x8 under leaf + 3 activations, then a read of x1 (one
    recomputation), then a backward pass of gradients that releases everything but x0."""
    eng = Engine(4 * B, "dtr-eq", allocator)
    rec = Recorder(eng)
    xs = [eng.put(B)]
    for i in range(1, 9):
        (x,) = eng.apply(f"f{i}", [xs[-1]], [B], cost=1.0)
        xs.append(x)
    eng.get_value(xs[1])
    eng.output_kind = "gradient"
    (g,) = eng.apply("loss", [xs[-1]], [B // 2], cost=1.0)
    for i in range(8, 0, -1):
        (g2,) = eng.apply(f"b{i}", [xs[i], g], [B // 2], cost=1.0)
        eng.release(g)
        eng.release(xs.pop())
        g = g2
    eng.release(g)
    return eng, rec


def random_program(seed: int, allocator: str) -> tuple[Engine, Recorder]:
    """Two training-like steps of a random-width net with skip connections; budget half of
    the activations, so the policy evicts and the backward pass recomputes."""
    rng = random.Random(seed)
    sizes = [rng.randint(50, 2000) for _ in range(24)]
    eng = Engine(sum(sizes) // 2 + 3000, "dtr-eq", allocator)
    rec = Recorder(eng)
    w = eng.put(1000)
    for _ in range(2):
        eng.output_kind = "activation"
        acts = [eng.put(300, "input")]
        for i, n in enumerate(sizes):
            ins = [acts[-1], w] + ([acts[-3]] if i >= 2 and rng.random() < 0.3 else [])
            (y,) = eng.apply(f"f{i}", ins, [n], cost=rng.uniform(0.1, 5.0))
            acts.append(y)
        eng.output_kind = "gradient"
        g = None
        for i in reversed(range(len(sizes))):
            ins = [acts[i + 1], w] + ([g] if g is not None else [])
            (g2,) = eng.apply(f"b{i}", ins, [sizes[i] // 2 + 1], cost=rng.uniform(0.1, 5.0))
            if g is not None:
                eng.release(g)
            eng.release(acts.pop())
            g = g2
        eng.release(g)
        eng.release(acts.pop())
    return eng, rec


def held_blocks(eng: Engine) -> set[tuple[int, int]]:
    return {(b.addr, b.size) for b in eng.allocator.layout() if b.storage is not None}


def assert_legal_packing(eng: Engine, rec: Recorder) -> list[Interval]:
    """Blocks held at the same moment never share an address, all lie in the pool, and the
    recording ends in the allocator's final layout."""
    pool = rec.pool_bytes
    live: dict[int, int] = {}  # exact check, event by event
    for _, _, action, addr, size, _, _, _ in rec.events:
        if action == "alloc":
            assert addr >= 0 and addr + size <= pool
            assert all(addr + size <= a or a + n <= addr for a, n in live.items()), addr
            live[addr] = size
        else:
            assert live.pop(addr) == size
    assert set(live.items()) == held_blocks(eng)

    ivs = rec.intervals()
    assert len(ivs) == sum(1 for e in rec.events if e[2] == "alloc")
    by_start = sorted(ivs)
    for i, a in enumerate(by_start):  # half-open in time: [start, end)
        assert a.addr >= 0 and a.addr + a.size <= pool and 0 <= a.start <= a.end <= rec.now()
        assert a.category in CATEGORIES
        for b in by_start[i + 1:]:
            if b.start >= a.end:
                break
            assert a.addr + a.size <= b.addr or b.addr + b.size <= a.addr, (a, b)
    still_held = {(iv.addr, iv.size) for iv in ivs if iv.end == rec.now()}
    assert held_blocks(eng) <= still_held
    return ivs


# ---------------------------------------------------------------------------------- recorder
def test_chain_categories_and_recomputation():
    eng, rec = chain_program()
    assert eng.stats.evictions > 0 and eng.stats.remat_ops > 0
    ivs = assert_legal_packing(eng, rec)
    assert {iv.category for iv in ivs} == set(CATEGORIES)
    leaf = [iv for iv in ivs if iv.category == "parameter"]
    assert len(leaf) == 1 and leaf[0].start == 0 and leaf[0].end == rec.now()
    assert leaf[0].size == B
    # every recomputed block belongs to a storage that held an earlier block (then evicted)
    recomputed = [iv for iv in ivs if iv.category == "recomputed"]
    for r in recomputed:
        earlier = [iv for iv in ivs if iv.storage == r.storage and iv.end <= r.start
                   and iv.category != "recomputed"]
        assert earlier, f"{r} recomputed but never evicted before"
    assert all(iv.size == B // 2 for iv in ivs if iv.category == "gradient")
    # everything but the leaf was released: only the leaf is held at the end
    assert held_blocks(eng) == {(leaf[0].addr, B)}
    assert rec.now() == eng.stats.ops + eng.stats.remat_ops
    seqs = [e[0] for e in rec.events]
    assert seqs == list(range(len(seqs)))
    times = [e[1] for e in rec.events]
    assert times == sorted(times)


def test_duplicate_of_a_dead_sibling_is_a_one_op_activation():
    # split makes (a, b); b is released with no dependent, so it is freed for good. h evicts
    # a (x, c and d fill the pool); reading a recomputes split, whose dead output b is held
    # by a temporary duplicate (storage id -1) while that op runs.
    eng = Engine(3 * B, "dtr-eq", "best-fit")
    rec = Recorder(eng)
    x = eng.put(B)
    a, b = eng.apply("split", [x], [B, B], cost=1.0)
    eng.release(b)
    (c,) = eng.apply("g", [a], [B], cost=1.0)
    eng.apply("h", [c], [B], cost=1.0)
    assert a.storage.evicted and b.storage.dead
    eng.get_value(a)
    assert eng.stats.remat_ops == 1
    ivs = assert_legal_packing(eng, rec)
    (dup,) = [iv for iv in ivs if iv.storage == -1]
    assert dup.category == "activation" and dup.start == dup.end == 3 and dup.size == B
    (redo,) = [iv for iv in ivs if iv.category == "recomputed"]
    assert redo.storage == a.storage.id and redo.start == 3 and redo.end == rec.now() == 4


@pytest.mark.parametrize("allocator", ["best-fit", "two-sided"])
@pytest.mark.parametrize("seed", range(6))
def test_random_programs_pack_legally(seed, allocator):
    eng, rec = random_program(seed, allocator)
    ivs = assert_legal_packing(eng, rec)
    assert eng.stats.evictions > 0
    cats = {iv.category for iv in ivs}
    assert {"activation", "gradient", "parameter"} <= cats
    assert ("recomputed" in cats) == (eng.stats.remat_ops > 0)


def test_recorder_needs_an_empty_layout_aware_pool():
    with pytest.raises(ValueError, match="no address layout"):
        Recorder(Engine(1000, "dtr-eq", "fungible"))
    eng = Engine(1000, "dtr-eq", "best-fit")
    eng.put(10)
    with pytest.raises(ValueError, match="before the run"):
        Recorder(eng)
    eng = Engine(1000, "dtr-eq", "best-fit")
    Recorder(eng)
    with pytest.raises(ValueError, match="already observed"):
        Recorder(eng)


# ---------------------------------------------------------------------------------- plot
def test_plot_writes_a_png(tmp_path):
    _, rec = random_program(0, "two-sided")
    out = plot_timeline(rec, tmp_path / "timeline.png", title="random 0")
    assert out == tmp_path / "timeline.png"
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_plot_of_an_empty_recording(tmp_path):
    rec = Recorder(Engine(1 << 20, "dtr-eq", "best-fit"))
    out = plot_timeline(rec, tmp_path / "empty.png", pool_bytes=1 << 20)
    assert out.stat().st_size > 0


# ---------------------------------------------------------------------------------- snapshot
@pytest.fixture
def mv():
    """PyTorch's snapshot viewer code (no GPU needed)."""
    return pytest.importorskip("torch.cuda._memory_viz")


def load_snapshot(tmp_path, rec: Recorder, **kw) -> dict:
    path = write_snapshot(rec, tmp_path / "snap.pickle", **kw)
    with path.open("rb") as f:
        return pickle.load(f)


def test_snapshot_format(tmp_path):
    eng, rec = chain_program()
    snap = load_snapshot(tmp_path, rec)
    assert set(snap) == {"segments", "device_traces", "allocator_settings"}
    (trace,) = snap["device_traces"]
    pool = rec.pool_bytes
    assert trace[0] == {"action": "segment_alloc", "addr": 0, "size": pool, "stream": 0,
                        "time_us": 0, "frames": []}
    n_alloc = sum(1 for e in rec.events if e[2] == "alloc")
    n_free = sum(1 for e in rec.events if e[2] == "free")
    assert len(trace) == 1 + n_alloc + 2 * n_free
    times = [e["time_us"] for e in trace]
    assert times == sorted(times) and all(isinstance(t, int) for t in times)
    for e, nxt in pairwise(trace):
        if e["action"] == "free_requested":
            assert nxt["action"] == "free_completed" and nxt["addr"] == e["addr"]

    (seg,) = snap["segments"]
    assert seg["address"] == 0 and seg["total_size"] == pool and seg["device"] == 0
    assert seg["allocated_size"] == seg["active_size"] == seg["requested_size"] == eng.used_bytes
    assert seg["segment_type"] == "large" and seg["segment_pool_id"] == (0, 0)
    blocks = seg["blocks"]
    assert sum(b["size"] for b in blocks) == pool
    assert {(b["address"], b["size"]) for b in blocks if b["state"] == "active_allocated"} \
        == held_blocks(eng)
    assert {b["state"] for b in blocks} <= {"active_allocated", "inactive"}

    # replaying the trace ends in the final state (what the viewer assumes)
    live: dict[int, int] = {}
    for e in trace[1:]:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == e["size"]
    assert set(live.items()) == {(b["address"], b["requested_size"]) for b in blocks
                                 if b["state"] == "active_allocated"}


def test_snapshot_device_index(tmp_path):
    _, rec = chain_program()
    snap = load_snapshot(tmp_path, rec, device=2)
    assert [len(t) > 0 for t in snap["device_traces"]] == [False, False, True]
    assert snap["segments"][0]["device"] == 2


def test_snapshot_pool_bytes_must_match_the_pool():
    _, rec = chain_program()
    with pytest.raises(ValueError, match="pool_bytes"):
        make_snapshot(rec, pool_bytes=rec.pool_bytes + 1)
    assert make_snapshot(rec, pool_bytes=rec.pool_bytes)["segments"][0]["total_size"] == 4 * B


def test_memory_viz_text_reports(tmp_path, mv):
    eng, rec = chain_program()
    snap = load_snapshot(tmp_path, rec)
    fmt = mv._format_size
    summary = mv.segsum(snap)
    assert "segments: 1\n" in summary
    assert f"total_reserved: {fmt(4 * B)}\n" in summary
    assert f"total_allocated: {fmt(eng.used_bytes)}\n" in summary
    assert f"total_free: {fmt(4 * B - eng.used_bytes)}" in summary

    text = mv.trace(snap)
    lines = text.splitlines()
    assert lines[0] == "Device 0 ----------------"
    assert lines[1] == f"{len(snap['device_traces'][0])} entries"
    assert lines[2] == f"a = cudaMalloc(0, {fmt(4 * B)})"
    allocs = [(m.group(1), m.group(2)) for m in re.finditer(r"= a\[(\d+):([^\]]+)\]", text)]
    expected = [(str(e[3]), fmt(e[5])) for e in rec.events if e[2] == "alloc"]
    assert allocs == expected
    assert text.count("# free completed for ") == sum(1 for e in rec.events if e[2] == "free")


def test_memory_viz_html_builders(tmp_path, mv):
    _, rec = chain_program()
    snap = load_snapshot(tmp_path, rec)
    for html in (mv.trace_plot(snap), mv.segment_plot(snap)):
        assert isinstance(html, str) and html.lstrip().startswith("<!DOCTYPE html>")
        (payload,) = json.loads(re.search(r"const local_files = (.*)\n", html).group(1))
        assert pickle.loads(base64.b64decode(payload["base64"])) == snap
    assert "Active Memory Timeline" in mv.trace_plot(snap)
    assert "Allocator State History" in mv.segment_plot(snap)


def test_snapshot_of_a_segmented_pool(tmp_path, mv):
    """A pool that reports segments (torch-caching) keeps them: no whole-pool segment."""
    s1, s2, s3 = Storage(1, 60), Storage(2, 100), Storage(3, 30)
    b1, hole, b2 = Block(0, 64, s1, 0), Block(64, 64, None, 0), Block(1024, 128, s2, 1)
    b3 = Block(4096, 32, s3, 2)
    alloc = SimpleNamespace(name="fake", has_layout=True, used=0, capacity=8192,
                            observer=None, layout=lambda: [b1, hole, b2])
    stats = Stats()
    rec = Recorder(SimpleNamespace(allocator=alloc, stats=stats))
    assert alloc.observer is rec
    rec.on_segment("segment_alloc", 0, 128)
    rec.on_alloc(s1, b1)
    stats.ops += 1
    rec.on_segment("segment_alloc", 1024, 128)
    rec.on_alloc(s2, b2)
    rec.on_segment("segment_alloc", 4096, 32)
    rec.on_alloc(s3, b3)
    stats.ops += 1
    rec.on_free(s3, b3)
    rec.on_segment("segment_free", 4096, 32)
    snap = load_snapshot(tmp_path, rec)

    (trace,) = snap["device_traces"]
    assert [(e["action"], e["addr"], e["size"], e["time_us"]) for e in trace] == [
        ("segment_alloc", 0, 128, 0), ("alloc", 0, 60, 0), ("segment_alloc", 1024, 128, 1),
        ("alloc", 1024, 100, 1), ("segment_alloc", 4096, 32, 1), ("alloc", 4096, 30, 1),
        ("free_requested", 4096, 30, 2), ("free_completed", 4096, 30, 2),
        ("segment_free", 4096, 32, 2)]
    seg0, seg1 = snap["segments"]
    assert (seg0["address"], seg0["total_size"], seg0["allocated_size"],
            seg0["requested_size"]) == (0, 128, 64, 60)
    assert [(b["address"], b["state"]) for b in seg0["blocks"]] == [
        (0, "active_allocated"), (64, "inactive")]
    assert (seg1["address"], seg1["total_size"], seg1["allocated_size"]) == (1024, 128, 128)
    summary = mv.segsum(snap)
    assert "segments: 2\n" in summary
    assert f"total_reserved: {mv._format_size(256)}\n" in summary
    assert "(33.3% internal)" in summary  # 4 + 28 B of rounding among 96 B free
    assert [iv[:5] for iv in rec.intervals()] == [
        (1, 2, 4096, 32, "activation"), (0, 2, 0, 64, "activation"),
        (1, 2, 1024, 128, "activation")]
