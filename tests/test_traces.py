"""Trace v1 reading/writing, its errors, the DTR-log importer and format detection."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pytest

from membudget.errors import TraceError
from membudget.sim import measure_baseline, replay
from membudget.trace import expand_sources, load_trace, read_dtr_log, read_trace, write_trace
from membudget.trace.format import (
    CALL,
    COPY,
    COPY_FROM,
    FORMAT_KEY,
    GET,
    PHASE,
    PUT,
    RELEASE,
    Trace,
    first_record,
)

HEADER = {"model": "toy", "batch": 2, "cost_unit": "ns", "extra": {"nested": [1, 2]}}

EVENTS = [
    (PUT, None, 1, 4096, "param"),
    (PUT, None, 2, 8192, "input"),
    (PHASE, None, "forward"),
    (CALL, None, "mm", (2, 1), (3,), (8192,), (-1,), 12000.0, ()),
    (COPY, None, 2, 4),
    (RELEASE, None, 2),
    (CALL, None, "view", (3,), (5,), (0,), (0,), 800.0, ()),
    (RELEASE, None, 3),
    (CALL, None, "sum", (5,), (6,), (4,), (-1,), 3000.0, ()),
    (RELEASE, None, 5),
    (PHASE, None, "backward"),
    (CALL, None, "mm_backward", (6, 4), (7,), (4096,), (-1,), 12000.0, ()),
    (RELEASE, None, 4),
    (CALL, None, "sgd_", (1, 7), (), (), (), 2000.0, (0,)),
    (RELEASE, None, 7),
    (COPY_FROM, None, 6, 8),
    (GET, None, 6),
]


def strip_lines(events):
    return [(ev[0], *ev[2:]) for ev in events]


# ---------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip(tmp_path, name):
    path = tmp_path / name
    assert write_trace(path, HEADER, EVENTS) == len(EVENTS)
    raw = path.read_bytes()
    assert (raw[:2] == b"\x1f\x8b") == name.endswith(".gz")
    tr = read_trace(path)
    assert tr.header == {FORMAT_KEY: 1, **HEADER}
    assert next(iter(tr.header)) == FORMAT_KEY
    assert strip_lines(tr.events) == strip_lines(EVENTS)
    # header on line 1, one event per line after it
    assert [ev[1] for ev in tr.events] == list(range(2, len(EVENTS) + 2))
    assert tr.path == str(path) and tr.name == "toy"
    # the tuples are exactly typed as documented
    call = tr.events[3]
    assert isinstance(call[3], tuple) and isinstance(call[7], float)


def test_written_json_omits_default_alias_and_mut(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, {"model": "m"}, EVENTS)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0] == {FORMAT_KEY: 1, "model": "m"}
    mm, view, sgd = lines[4], lines[7], lines[14]
    assert mm == {"ev": "call", "op": "mm", "in": [2, 1], "out": [3], "bytes": [8192],
                  "cost": 12000.0}
    assert view["alias"] == [0] and "mut" not in view
    assert sgd["mut"] == [0] and "alias" not in sgd


def test_gzip_detected_by_content_not_name(tmp_path):
    gz = tmp_path / "t.jsonl.gz"
    write_trace(gz, HEADER, EVENTS)
    renamed = tmp_path / "plain-name.jsonl"
    renamed.write_bytes(gz.read_bytes())
    assert strip_lines(read_trace(renamed).events) == strip_lines(EVENTS)


def test_blank_lines_are_skipped_but_counted(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('\n{"membudget_trace": 1}\n\n{"ev":"put","t":1,"bytes":8}\n\n'
                    '{"ev":"get","t":1}\n')
    tr = read_trace(path)
    assert tr.events == [(PUT, 4, 1, 8, "leaf"), (GET, 6, 1)]


def test_documented_example_baseline(tmp_path):
    # docs/trace-format.md: baseline cost 29 800 ns (12000 + 800 + 3000 + 12000 + 2000) and
    # peak 20 484 B (weight 4096 + input 8192 + mm output 8192 + loss 4).
    path = tmp_path / "toy.jsonl"
    write_trace(path, HEADER, [ev for ev in EVENTS if ev[0] != COPY_FROM])
    base = measure_baseline(read_trace(path))
    assert base.cost == 29_800
    assert base.peak_bytes == 4096 + 8192 + 8192 + 4
    assert base.ops == 5


# ---------------------------------------------------------------------------------- errors
GOOD = '{"ev":"put","t":1,"bytes":8}'


@pytest.mark.parametrize("bad, words", [
    ('{"ev":"put","t":1,"bytes":8', "malformed JSON"),
    ('{"ev":"put","bytes":8}', "'t'"),
    ('{"ev":"call","op":"f","in":[1],"out":[2],"cost":1}', "'bytes'"),
    ('{"ev":"call","op":"f","in":[1],"out":[2],"bytes":[8]}', "'cost'"),
    ('{"ev":"call","in":[1],"out":[2],"bytes":[8],"cost":1}', "'op'"),
    ('{"ev":"put","t":1,"bytes":-8}', "negative"),
    ('{"ev":"call","op":"f","in":[1],"out":[2],"bytes":[-8],"cost":1}', "negative"),
    ('{"ev":"call","op":"f","in":[1],"out":[2],"bytes":[8],"cost":-1}', "'cost'"),
    ('{"ev":"call","op":"f","in":[1],"out":[2,3],"bytes":[8],"cost":1}', "equal lengths"),
    ('{"ev":"call","op":"f","in":[1],"out":[2],"bytes":[0],"alias":[1],"cost":1}',
     "out of range"),
    ('{"ev":"call","op":"f","in":[1],"out":[],"bytes":[],"cost":1,"mut":[-1]}',
     "out of range"),
    ('{"ev":"release","t":"1"}', "'t'"),
    ('{"ev":"release","t":true}', "'t'"),
    ('{"ev":"explode","t":1}', "unknown event"),
    ('{"t":1}', "unknown event"),
    ('[1, 2]', "JSON object"),
])
@pytest.mark.parametrize("gz", [False, True])
def test_malformed_line_names_file_and_line(tmp_path, bad, words, gz):
    path = tmp_path / ("bad.jsonl.gz" if gz else "bad.jsonl")
    text = f'{{"membudget_trace": 1}}\n{GOOD}\n\n{bad}\n{GOOD}\n'
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    e = ei.value
    assert e.line == 4 and e.path == path
    assert str(e).startswith(f"{path}:4: ")
    assert words in str(e)


def test_alias_below_minus_one_is_rejected(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"membudget_trace": 1}\n' + GOOD + '\n'
                    '{"ev":"call","op":"f","in":[1],"out":[2],"bytes":[8],"alias":[-2],'
                    '"cost":1}\n')
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    assert ei.value.line == 3


@pytest.mark.parametrize("text, line, words", [
    ("", None, "empty file"),
    ("\n\n", None, "empty file"),
    ("not json\n", 1, "header is not JSON"),
    ('{"membudget_trace": 2}\n', 1, "v1 header"),
    ('{"model": "x"}\n', 1, "v1 header"),
    ("\n[1]\n", 2, "v1 header"),
])
def test_bad_header(tmp_path, text, line, words):
    path = tmp_path / "h.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    assert ei.value.line == line and words in str(ei.value)
    assert str(ei.value).startswith(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.zip::x")


def big_events(n: int) -> list:
    return [(PUT, None, 1, 64, "leaf")] + [
        (CALL, None, f"op{i}", (1,), (i + 2,), (64,), (-1,), 1.0, ()) for i in range(n)]


@pytest.mark.parametrize("keep", [0.5, 0.9])
@pytest.mark.parametrize("loader", [read_trace, load_trace])
def test_truncated_gzip_raises_trace_error(tmp_path, keep, loader):
    full = tmp_path / "full.jsonl.gz"
    write_trace(full, {"model": "m"}, big_events(3000))
    data = full.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(TraceError) as ei:
        loader(cut)
    assert "truncated or corrupt" in str(ei.value)
    assert str(ei.value).startswith(f"{cut}:")
    assert ei.value.line is not None and ei.value.line > 2


def test_gzip_missing_its_trailer_raises_trace_error(tmp_path):
    full = tmp_path / "small.jsonl.gz"
    write_trace(full, {"model": "m"}, big_events(3))
    cut = tmp_path / "cut.gz"
    cut.write_bytes(full.read_bytes()[:-4])  # the size field of the gzip trailer is gone
    with pytest.raises(TraceError, match="truncated or corrupt"):
        read_trace(cut)


@pytest.mark.parametrize("loader", [read_trace, load_trace])
def test_gzip_truncated_inside_the_header_raises_trace_error(tmp_path, loader):
    full = tmp_path / "full.jsonl.gz"
    write_trace(full, {"model": "m", "pad": "x" * 200}, big_events(3))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(full.read_bytes()[:30])
    with pytest.raises(TraceError, match="truncated or corrupt"):
        loader(cut)


# ---------------------------------------------------------------------------------- DTR logs
def rec(**kw) -> str:
    return json.dumps(kw)


def write_log(path: Path, records: list[str]) -> Path:
    path.write_text("\n".join(records) + "\n")
    return path


START = rec(INSTRUCTION="ANNOTATE", ANNOTATION="START")

LOG = [
    rec(INSTRUCTION="CONSTANT", NAME="junk"),  # 1: before START: skipped
    rec(INSTRUCTION="MEMORY", NAME="junk", MEMORY="9"),  # 2
    rec(INSTRUCTION="CALL", NAME="junk_op", ARGS=["junk"], RESULT=["j2"], TIME="5"),  # 3
    START,  # 4
    rec(INSTRUCTION="CONSTANT", NAME="w"),  # 5
    rec(INSTRUCTION="MEMORY", NAME="w", MEMORY="400"),  # 6
    rec(INSTRUCTION="CONSTANT", NAME="x"),  # 7
    rec(INSTRUCTION="MEMORY", NAME="x", MEMORY="800"),  # 8
    rec(INSTRUCTION="CALL", NAME="split", ARGS=["x", "w"], RESULT=["a", "b"],
        TIME="1500"),  # 9
    rec(INSTRUCTION="MEMORY", NAME="a", MEMORY="300"),  # 10
    rec(INSTRUCTION="ALIAS", NAME="a", ALIAS="-1"),  # 11
    rec(INSTRUCTION="MEMORY", NAME="b", MEMORY="800"),  # 12: an alias: 0 bytes of its own
    rec(INSTRUCTION="ALIAS", NAME="b", ALIAS="0"),  # 13
    rec(INSTRUCTION="COPY", SRC="a", DST="a2"),  # 14
    rec(INSTRUCTION="RELEASE", NAME="never"),  # 15: unknown: ignored
    "",  # 16: blank
    rec(INSTRUCTION="ANNOTATE", ANNOTATION="BACKWARD"),  # 17
    rec(INSTRUCTION="MUTATE", NAME="add_", ARGS=["w", "a"], MUTATE=[0], TIME="700"),  # 18
    rec(INSTRUCTION="COPY_FROM", SRC="a2", DST="b"),  # 19
    rec(INSTRUCTION="RELEASE", NAME="a"),  # 20
    rec(INSTRUCTION="ANNOTATE", ANNOTATION="SOMETHING"),  # 21: ignored
]

# names numbered from 1 in order of first definition after START: w 1, x 2, a 3, b 4, a2 5
LOG_EVENTS = [
    (PUT, 5, 1, 400, "constant"),
    (PUT, 7, 2, 800, "constant"),
    (CALL, 9, "split", (2, 1), (3, 4), (300, 0), (-1, 0), 1500.0, ()),
    (COPY, 14, 3, 5),
    (PHASE, 17, "backward"),
    (CALL, 18, "add_", (1, 3), (), (), (), 700.0, (0,)),
    (COPY_FROM, 19, 5, 4),
    (RELEASE, 20, 3),
]


def test_dtr_log_import(tmp_path):
    path = write_log(tmp_path / "resnet32-56-9000000000.0-x-default.log", LOG)
    tr = read_dtr_log(path)
    assert tr.events == LOG_EVENTS
    assert tr.header["model"] == "resnet32" and tr.header["batch"] == 56
    assert tr.header["cost_unit"] == "ns"
    assert tr.header["source"] == f"dtr-log:{path.name}"
    assert tr.name == "resnet32"


def test_dtr_log_replays_with_hand_computed_baseline(tmp_path):
    # Baseline: w 400 + x 800 + a 300 (b is a view of x): 1500 B; the add_ on w makes a new
    # 400 B version of w while the old one is still held: peak 1900 B (then the rebinding
    # releases the old w, which the baseline drops). Cost 1500 + 700, two ops.
    tr = read_dtr_log(write_log(tmp_path / "m-1-x.log", LOG))
    base = measure_baseline(tr)
    assert base.cost == 2200 and base.ops == 2
    assert base.peak_bytes == 1900


@pytest.mark.parametrize("records, line, words", [
    ([START, rec(INSTRUCTION="CALL", NAME="f", ARGS=["nope"], RESULT=["r"], TIME="1")],
     2, "used before it is defined"),
    ([START, rec(INSTRUCTION="CONSTANT", NAME="w"),
      rec(INSTRUCTION="MEMORY", NAME="w", MEMORY="lots")], 3, "MEMORY must be an integer"),
    ([START, rec(INSTRUCTION="CONSTANT", NAME="w"),
      rec(INSTRUCTION="MEMORY", NAME="w", MEMORY="-5")], 3, ">= 0"),
    ([START, rec(INSTRUCTION="CONSTANT", NAME="w"),
      rec(INSTRUCTION="MEMORY", NAME="v", MEMORY="5")], 3, "expected MEMORY for 'w'"),
    ([START, rec(INSTRUCTION="CONSTANT", NAME="w")], 3, "log ends"),
    ([START, rec(INSTRUCTION="CONSTANT", NAME="w"),
      rec(INSTRUCTION="MEMORY", NAME="w", MEMORY="5"),
      rec(INSTRUCTION="CALL", NAME="f", ARGS=["w"], RESULT=["r"], TIME="1"),
      rec(INSTRUCTION="MEMORY", NAME="r", MEMORY="5"),
      rec(INSTRUCTION="ALIAS", NAME="r", ALIAS="1")], 6, "not an argument index"),
    ([START, rec(INSTRUCTION="CONSTANT", NAME="w"),
      rec(INSTRUCTION="MEMORY", NAME="w", MEMORY="5"),
      rec(INSTRUCTION="CALL", NAME="f", ARGS=["w"], RESULT=["r"], TIME="1"),
      rec(INSTRUCTION="MEMORY", NAME="r", MEMORY="5"),
      rec(INSTRUCTION="ALIAS", NAME="r", ALIAS="-3")], 6, "ALIAS must be -1"),
    ([START, rec(INSTRUCTION="CONSTANT", NAME="w"),
      rec(INSTRUCTION="MEMORY", NAME="w", MEMORY="5"),
      rec(INSTRUCTION="CALL", NAME="f", ARGS=["w"], RESULT=["r"], TIME="soon"),
      rec(INSTRUCTION="MEMORY", NAME="r", MEMORY="5"),
      rec(INSTRUCTION="ALIAS", NAME="r", ALIAS="-1")], 4, "TIME must be an integer"),
    ([START, rec(INSTRUCTION="CONSTANT", NAME="w"),
      rec(INSTRUCTION="MEMORY", NAME="w", MEMORY="5"),
      rec(INSTRUCTION="CALL", NAME="f", ARGS=["w"], RESULT=["r"]),
      rec(INSTRUCTION="MEMORY", NAME="r", MEMORY="5"),
      rec(INSTRUCTION="ALIAS", NAME="r", ALIAS="-1")], 4, "lacks 'TIME'"),
    ([START, rec(INSTRUCTION="CONSTANT", NAME="w"),
      rec(INSTRUCTION="MEMORY", NAME="w", MEMORY="5"),
      rec(INSTRUCTION="MUTATE", NAME="f_", ARGS=["w"], MUTATE=[1], TIME="1")],
     4, "MUTATE index out of range"),
    ([START, rec(INSTRUCTION="MEMORY", NAME="w", MEMORY="5")], 2, "unexpected MEMORY"),
    ([START, rec(INSTRUCTION="ALIAS", NAME="w", ALIAS="-1")], 2, "unexpected ALIAS"),
    ([START, rec(INSTRUCTION="COPY", SRC="ghost", DST="d")], 2, "used before it is defined"),
    ([START, "{oops"], 2, "malformed JSON"),
    ([START, rec(INSTRUCTION="EXPLODE")], 2, "not a DTR log record"),
    ([rec(INSTRUCTION="CONSTANT", NAME="w")], 1, "no ANNOTATE START"),
])
def test_dtr_log_errors_name_the_line(tmp_path, records, line, words):
    path = write_log(tmp_path / "m-1.log", records)
    with pytest.raises(TraceError) as ei:
        read_dtr_log(path)
    assert ei.value.line == line, str(ei.value)
    assert str(ei.value).startswith(f"{path}:{line}: ")
    assert words in str(ei.value)


# ---------------------------------------------------------------------------------- detection
def test_load_trace_detects_the_format_from_content(tmp_path):
    log = write_log(tmp_path / "model-3.jsonl", LOG)  # a DTR log with a v1-looking name
    v1 = tmp_path / "model-3.log"  # a v1 trace with a DTR-looking name
    write_trace(v1, HEADER, EVENTS)
    assert load_trace(log).events == LOG_EVENTS
    assert load_trace(log).header["source"].startswith("dtr-log:")
    assert strip_lines(load_trace(v1).events) == strip_lines(EVENTS)
    gz = tmp_path / "log.gz"
    gz.write_bytes(gzip.compress(log.read_bytes()))
    assert load_trace(gz).events == LOG_EVENTS
    assert first_record(gz) == json.loads(LOG[0])
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    assert first_record(junk) is None
    with pytest.raises(TraceError):
        load_trace(junk)


def test_zip_members_and_expand_sources(tmp_path):
    v1 = tmp_path / "v1.jsonl"
    write_trace(v1, HEADER, EVENTS)
    log = write_log(tmp_path / "resnet32-56-x.log", LOG)
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.write(v1, "dir/v1.jsonl")
        z.write(log, "dir/resnet32-56-x.log")
        z.writestr("dir/manifest.json", "{}")
        z.writestr("dir/", "")
    sources = expand_sources([str(archive), str(v1)])
    assert sources == [f"{archive}::dir/resnet32-56-x.log", f"{archive}::dir/v1.jsonl",
                       str(v1)]
    tr = load_trace(sources[0])
    assert tr.events == LOG_EVENTS and tr.name == "resnet32"
    assert strip_lines(load_trace(sources[1]).events) == strip_lines(EVENTS)
    # a member may be named by a unique prefix of its base name
    assert load_trace(f"{archive}::resnet").events == LOG_EVENTS
    with pytest.raises(TraceError, match="no members match 'nothing'"):
        load_trace(f"{archive}::nothing")
    with pytest.raises(TraceError, match="no such file"):
        expand_sources([str(tmp_path / "missing.zip")])


def test_every_expanded_zip_source_loads(tmp_path):
    gz = tmp_path / "t.jsonl.gz"
    write_trace(gz, HEADER, EVENTS)
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.write(gz, "t.jsonl.gz")
    (source,) = expand_sources([str(archive)])
    assert strip_lines(load_trace(source).events) == strip_lines(EVENTS)


def test_replay_of_unknown_handle_names_the_line():
    tr = Trace({"model": "m"}, [(PUT, 2, 1, 8, "leaf"), (RELEASE, 3, 1), (GET, 4, 1)],
               "mem.jsonl")
    from membudget.core import Engine

    with pytest.raises(TraceError) as ei:
        replay(Engine(100, "lru"), tr.events, tr.path)
    assert ei.value.line == 4 and "not live" in str(ei.value)
    assert str(ei.value).startswith("mem.jsonl:4:")
