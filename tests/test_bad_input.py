"""Bad input files: every reader (trace, DTR log, MiniMalloc CSV) takes any bytes and either
loads them or raises membudget's own error naming the file (and line); through the real
commands, each bad file costs one line on stderr, exit status 2, and nothing on disk."""

from __future__ import annotations

import contextlib
import gzip
import json
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_outputs import cli

from membudget.errors import MembudgetError, TraceError
from membudget.inputs import MAX_INPUT_ENV
from membudget.plan.minimalloc_csv import read_csv
from membudget.sim import simulate
from membudget.trace import load_trace

HEADER = b'{"membudget_trace": 1, "model": "fuzz"}\n'
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

# JSON values of every kind, with the numbers a writer must never accept (NaN, inf, 10^30)
# and the shapes the readers expect (ids, lists of ids)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 6) | st.integers() | st.floats()
    | st.sampled_from([10**30, -(10**30), "12", "-1", "nan", "[/x]"]) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8)
ids = st.integers(0, 5)  # 0-2 are put first; others are bound (or not) by the events
new = st.integers(3, 7)
well_formed = st.one_of(  # events a replay can run, when their ids happen to be live
    st.builds(lambda t, b: {"ev": "put", "t": t, "bytes": b}, new, st.integers(0, 64)),
    st.builds(lambda i, o, b, c, m: {"ev": "call", "op": "f", "in": i, "out": o,
                                     "bytes": [b] * len(o), "cost": c,
                                     **({"mut": m} if m and i else {})},
              st.lists(ids, max_size=3), st.lists(new, max_size=2), st.integers(0, 64),
              st.floats(0, 1e3), st.lists(st.just(0), max_size=1)),
    st.builds(lambda k, t: {"ev": k, "t": t}, st.sampled_from(["release", "get", "pin"]), ids),
    st.builds(lambda k, s, t: {"ev": k, "src": s, "t": t},
              st.sampled_from(["copy", "copy_from"]), ids, new),
    st.just({"ev": "phase", "name": "backward"}))
fields = st.sampled_from(["ev", "t", "src", "in", "out", "bytes", "alias", "mut", "cost", "op",
                          "kind", "overwrite", "name"])
# mostly well formed, one field in four replaced by any JSON value
trace_events = well_formed | st.builds(lambda e, bad: {**e, **bad}, well_formed,
                                       st.dictionaries(fields, json_values, min_size=1,
                                                       max_size=1))
dtr_records = st.fixed_dictionaries(
    {"INSTRUCTION": st.sampled_from(["CONSTANT", "MEMORY", "CALL", "MUTATE", "COPY",
                                     "COPY_FROM", "RELEASE", "ANNOTATE", "ALIAS"])},
    optional={"NAME": st.sampled_from(["a", "b", "c"]) | json_values,
              "ARGS": st.lists(st.sampled_from(["a", "b", "c"]), max_size=3) | json_values,
              "RESULT": st.lists(st.sampled_from(["a", "b", "c"]), max_size=2) | json_values,
              "MEMORY": st.sampled_from(["0", "64", "-5", "1e400", "9" * 30]) | json_values,
              "ALIAS": st.sampled_from(["-1", "0", "1", "-2", "--1"]) | json_values,
              "TIME": st.sampled_from(["10", "x"]) | json_values,
              "MUTATE": st.lists(st.integers(-1, 3) | st.just("0"), max_size=2) | json_values,
              "SRC": st.sampled_from(["a", "b"]), "DST": st.sampled_from(["a", "b", "c"]),
              "ANNOTATION": st.sampled_from(["START", "BACKWARD"])})


def lines(objs: list) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def loads_or_refuses(path: Path) -> None:
    """Load ``path`` as a trace and, if it loads, replay it without a budget: both either
    work or raise membudget's own error."""
    try:
        trace = load_trace(path)
    except MembudgetError as e:
        assert str(path) in str(e) and len(str(e)) < 600
        return
    for budget in ({"budget": 2**62}, {"ratio": 0.5}):
        with contextlib.suppress(MembudgetError):
            simulate(trace, "dtr", **budget)


@FUZZ
@given(data=st.binary(max_size=300) | st.builds(lambda b: HEADER + b, st.binary(max_size=300)))
def test_trace_reader_takes_any_bytes(tmp_path, data):
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    loads_or_refuses(path)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(data)[: max(2, len(data) // 2)])  # truncated gzip
    loads_or_refuses(gz)


@FUZZ
@given(events=st.lists(trace_events, max_size=16))
def test_trace_reader_takes_any_events(tmp_path, events):
    path = tmp_path / "t.jsonl"
    path.write_bytes(HEADER + lines([{"ev": "put", "t": t, "bytes": 8} for t in range(3)])
                     + lines(events))
    loads_or_refuses(path)


@FUZZ
@given(records=st.lists(dtr_records, max_size=12), junk=st.binary(max_size=20))
def test_dtr_log_reader_takes_any_records(tmp_path, records, junk):
    path = tmp_path / "m-1.log"
    start = {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"}
    path.write_bytes(lines([start, *records]) + junk)
    loads_or_refuses(path)


@FUZZ
@given(data=st.binary(max_size=300) | st.builds(
    lambda rows: b"id,lower,upper,size\n" + "\n".join(rows).encode("utf-8", "surrogatepass"),
    st.lists(st.lists(st.sampled_from(["0", "1", "4", "-3", "+-5", "x", "9" * 25, "", '"', "\x00",
                                       "\ud800", "a b"]), max_size=5).map(",".join),
             max_size=6)))
def test_csv_reader_takes_any_bytes(tmp_path, data):
    path = tmp_path / "p.csv"
    path.write_bytes(data)
    try:
        problem = read_csv(path)
    except TraceError as e:
        assert str(path) in str(e) and len(str(e)) < 600
        return
    for b in problem.buffers:  # what loads is what the packers can take
        assert 0 <= b.size <= 2**63 - 1 and b.lower < b.upper


def test_a_live_id_bound_again_is_refused_by_every_reader(tmp_path):
    put = {"ev": "put", "t": 1, "bytes": 8}
    for outs, line in (([1], 3), ([2, 2], 3)):  # its own input; twice in one call
        path = tmp_path / "t.jsonl"
        path.write_bytes(HEADER + lines([put, {"ev": "call", "op": "f", "in": [1],
                                               "out": outs, "bytes": [8] * len(outs),
                                               "cost": 1}]))
        with pytest.raises(TraceError, match="bound again while live") as ei:
            load_trace(path)
        assert ei.value.line == line
    log = tmp_path / "m-1.log"  # a DTR log whose CALL result is a live name
    log.write_bytes(lines([
        {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"},
        {"INSTRUCTION": "CONSTANT", "NAME": "a"}, {"INSTRUCTION": "MEMORY", "NAME": "a",
                                                   "MEMORY": "8"},
        {"INSTRUCTION": "CALL", "NAME": "f", "ARGS": ["a"], "RESULT": ["a"], "TIME": "1"},
        {"INSTRUCTION": "MEMORY", "NAME": "a", "MEMORY": "8"},
        {"INSTRUCTION": "ALIAS", "NAME": "a", "ALIAS": "-1"}]))
    with pytest.raises(TraceError, match="bound again while live"):
        load_trace(log)


def test_the_decompressed_size_limit_is_refused_early(tmp_path, monkeypatch):
    archive = tmp_path / "bomb.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z, \
            z.open("blank.jsonl", "w") as f:
        f.write(HEADER + b"\n" * (3 << 20))
    assert archive.stat().st_size < 10_000
    monkeypatch.setenv(MAX_INPUT_ENV, "1 MiB")
    with pytest.raises(TraceError, match=f"more than 1.00 MiB.*{MAX_INPUT_ENV}"):
        load_trace(f"{archive}::blank")
    monkeypatch.setenv(MAX_INPUT_ENV, "4 MiB")
    assert load_trace(f"{archive}::blank").events == []


# ------------------------------------------------------------------- through the commands
def dtr_log(*records: dict) -> bytes:
    return lines([{"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"}, *records])


CONSTANT = ({"INSTRUCTION": "CONSTANT", "NAME": "w"},
            {"INSTRUCTION": "MEMORY", "NAME": "w", "MEMORY": "64"})
PUT = {"ev": "put", "t": 1, "bytes": 8}
FILES: dict[str, bytes] = {
    "rebind.jsonl": HEADER + lines([PUT, {"ev": "call", "op": "f", "in": [1], "out": [1],
                                          "bytes": [8], "cost": 1}]),
    "twice.jsonl": HEADER + lines([PUT, {"ev": "call", "op": "f", "in": [1], "out": [2, 2],
                                         "bytes": [8, 8], "cost": 1}]),
    "header-only.jsonl": HEADER,
    "truncated.jsonl.gz": gzip.compress(HEADER + lines([PUT] * 200))[:60],
    "not-a-zip.zip": b"PK\x03\x04 this is not an archive",
    "name.log": dtr_log(*CONSTANT, {"INSTRUCTION": "COPY", "SRC": "x" * (1 << 20),
                                    "DST": "y"}),
    "bad-utf8.log": dtr_log(*CONSTANT) + b'{"INSTRUCTION": "RELEASE", "NAME": "\xff"}\n',
    "time-inf.log": dtr_log(*CONSTANT, {"INSTRUCTION": "MUTATE", "NAME": "f", "ARGS": ["w"],
                                        "MUTATE": [0], "TIME": 1e400}),
    "nested.log": dtr_log(*CONSTANT) + b"[" * 100_000 + b"\n",
    "markup.jsonl": HEADER + lines([{"ev": "[/x]"}]),
    # line 100: ":100:" must not become an emoji shortcode, nor ":fire:" in the name
    "x:fire:.jsonl": HEADER + lines([{"ev": "put", "t": t, "bytes": 8} for t in range(1, 99)]
                                    + [{"ev": "cal"}]),
    "bad-utf8.csv": b"id,lower,upper,size\n0,0,4,8\n1,0,4,\xff\n",
    "huge.csv": b"id,lower,upper,size\n0,0,4," + b"9" * 30 + b"\n",
    "field.csv": b"id,lower,upper,size\n" + b"x" * 200_000 + b",0,4,8\n",
    "nul.csv": b"id,lower,upper,size\n0,0,4,8\x00\n",
    "two-signs.csv": b"id,lower,upper,size\n0,0,4,+-5\n",
    "alias.log": dtr_log(*CONSTANT, {"INSTRUCTION": "CALL", "NAME": "f", "ARGS": ["w"],
                                     "RESULT": ["a"], "TIME": "1"},
                         {"INSTRUCTION": "MEMORY", "NAME": "a", "MEMORY": "8"},
                         {"INSTRUCTION": "ALIAS", "NAME": "a", "ALIAS": "--1"}),
    "bom-only.csv": b"\xef\xbb\xbf",
    "good.jsonl": HEADER + lines([PUT, {"ev": "call", "op": "f", "in": [1], "out": [2],
                                        "bytes": [8], "cost": 1}]),
    "empty.zip": bytes.fromhex("504b0506") + bytes(18),  # an archive with no member
}
CASES = [  # (command, what the one line must say)
    (["simulate", "{rebind.jsonl}", "--ratio", "1"], "rebind.jsonl:3: tensor 1 is bound again"),
    (["plan", "{rebind.jsonl}", "--time-limit", "1"], "rebind.jsonl:3: tensor 1 is bound again"),
    (["simulate", "{twice.jsonl}", "--ratio", "1"], "twice.jsonl:3: tensor 2 is bound again"),
    (["plan", "{header-only.jsonl}", "--time-limit", "1"], "nothing to plan"),
    (["simulate", "{truncated.jsonl.gz}", "--ratio", "1"], "truncated or corrupt"),
    (["simulate", "{not-a-zip.zip}::t", "--ratio", "1"], "not a zip archive"),
    (["sweep", "{not-a-zip.zip}", "--ratios", "1"], "not a zip archive"),
    (["import", "dtr-log", "{name.log}", "-o", "{out}"], "characters)"),
    (["import", "dtr-log", "{bad-utf8.log}", "-o", "{out}"], "bad-utf8.log:4: not UTF-8"),
    (["import", "dtr-log", "{time-inf.log}", "-o", "{out}"], "time-inf.log:4: TIME must be"),
    (["import", "dtr-log", "{nested.log}", "-o", "{out}"], "nested too deeply"),
    (["simulate", "{markup.jsonl}", "--ratio", "1"], "unknown event '[/x]'"),
    (["simulate", "{x:fire:.jsonl}", "--ratio", "1"], "x:fire:.jsonl:100: unknown event 'cal'"),
    (["pack", "{bad-utf8.csv}", "-o", "{out}"], "bad-utf8.csv:3: not UTF-8"),
    (["pack", "{huge.csv}", "-o", "{out}"], "huge.csv:2: column 'size' is not an integer"),
    (["pack", "{field.csv}", "-o", "{out}"], "field.csv:2: malformed CSV"),
    (["pack", "{nul.csv}", "-o", "{out}"], "nul.csv:2: column 'size' is not an"),
    (["pack", "{bom-only.csv}", "-o", "{out}"], "empty file"),
    (["pack", "{two-signs.csv}", "-o", "{out}"], "two-signs.csv:2: column 'size' is not an"),
    (["import", "dtr-log", "{alias.log}", "-o", "{out}"], "alias.log:6: ALIAS must be -1"),
    (["trace", "unet", "-o", "{out}", "--device", "nope"], "cannot capture on device 'nope'"),
    (["trace", "unet", "-o", "{out}", "--fake", "--device", "cpu"], "no effect with --fake"),
    (["trace", "unet", "-o", "{out}", "--device", "meta"], "use --fake"),
    (["trace", "unet", "-o", "{out}", "--fake", "--batch", str(10**18)], "smaller --batch"),
    (["trace", "unet", "-o", "{out}", "--fake", "--device-spec", "nope"], "unknown device spec"),
    (["sweep", "{empty.zip}", "--ratios", "0.5"], "holds no trace"),
    (["simulate", "{good.jsonl}", "--ratio", "abc"], "Invalid value for '--ratio'"),
    (["sweep", "{good.jsonl}", "--ratios", "0.5", "--workers", "-3"], "'--workers'"),
    (["simulate", "{good.jsonl}", "--nope"], "No such option: --nope"),
    (["demo", "--policy", "nope"], "unknown policy 'nope'"),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bad")
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
    return folder


@pytest.mark.parametrize(("command", "words"), CASES, ids=[" ".join(c[:2]) for c, _ in CASES])
def test_each_bad_file_gets_one_line_and_changes_nothing(bad_files, tmp_path, command,
                                                         words):
    out = tmp_path / "out" / "result"
    args = [a.replace("{out}", str(out)) for a in command]
    for name in FILES:
        args = [a.replace("{" + name + "}", str(bad_files / name)) for a in args]
    result = cli(*args, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (args, result.stderr[-2000:])
    assert words in lines[0] and len(lines[0]) < 700, lines[0]
    assert not out.exists() and not list(tmp_path.glob("out/.*"))
    for name, data in FILES.items():  # no input changed
        assert (bad_files / name).read_bytes() == data


def test_a_bad_size_limit_is_named(bad_files):
    result = cli("simulate", str(bad_files / "header-only.jsonl"), "--ratio", "1",
                 env={MAX_INPUT_ENV: "lots"}, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and MAX_INPUT_ENV in lines[0], lines


# ------------------------------------------------------------------- through the Python API
@pytest.mark.parametrize("budget", [float("nan"), float("inf"), -1, 0, "abc", "1e400 GB", True,
                                    None, "-5 MB"])
def test_a_bad_budget_is_refused_when_the_session_is_made(budget):
    import membudget

    with pytest.raises(MembudgetError, match="budget"):
        membudget.budget(budget)


@pytest.mark.parametrize(("options", "message"), [
    ({"policy": "nope"}, "unknown policy 'nope'"),
    ({"allocator": "sized"}, "unknown allocator 'sized'; known: .*size-sided"),
    ({"inplace": "later"}, "unknown in-place mode 'later'"),
    ({"policy": "coop", "allocator": "fungible"}, "needs an address-ordered allocator"),
    ({"swap": "al"}, "unknown swap mode 'al'"),
])
def test_bad_session_options_are_refused_when_the_session_is_made(options, message):
    import membudget

    with pytest.raises(MembudgetError, match=message):  # (before: policy, allocator and
        membudget.budget("1 GB", **options)  # in-place mode only when it was entered)


def test_a_record_path_that_cannot_be_written_is_refused_before_the_step(tmp_path):
    import membudget

    with pytest.raises(MembudgetError, match="is a directory"):
        membudget.budget("1 GB", record=tmp_path)  # (before: after the step had run)
    assert membudget.budget(2**30, record=tmp_path / "new" / "t.jsonl").budget_bytes == 2**30


def _embedding_bag(sparse):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(500, 32, sparse=sparse), torch.nn.Tanh(),
                               torch.nn.Flatten(), torch.nn.Linear(32 * 8, 1))


def test_a_sparse_gradient_is_refused_by_name_and_training_goes_on():
    """A sparse layout has no strided storage to count: the op that makes one is named with
    the fix, as a NotImplementedError, and eager training continues as if the step never
    ran (before: torch's "Cannot access storage of SparseTensorImpl" from inside the engine)."""
    import torch

    import membudget

    model, ref = _embedding_bag(True), _embedding_bag(True)
    ids = torch.randint(0, 500, (16, 8))
    refused = pytest.raises(NotImplementedError, match=r"_sparse_coo_tensor.* made a tensor of "
                                                       r"layout torch.sparse_coo.*sparse=False")
    with refused, membudget.budget("1 GB"):
        model(ids).sum().backward()
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        m(ids).sum().backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert type(p) is torch.nn.Parameter and torch.equal(p, q)
    dense = _embedding_bag(False)  # the fix the message names works
    with membudget.budget("1 GB"):
        dense(ids).sum().backward()
    assert dense[0].weight.grad.layout is torch.strided


def test_torch_func_transforms_of_functions_are_budgeted_and_of_modules_refused():
    """Inside a transform the session sees the ops on the tensors the transform wraps: a
    function's gradient comes out bitwise within the budget (by StorageMeter). A module's
    state under functional_call is the transform's wrappers, which hold no storage the
    session can count: refused by name (before: torch's "Cannot access storage of
    TensorWrapper"), and the same call outside the session still works."""
    import torch
    from torch.func import functional_call, grad, vmap

    import membudget
    from membudget.bench.meter import StorageMeter

    torch.manual_seed(0)
    weights = [torch.randn(64, 64) / 8 for _ in range(6)]
    xs = torch.randn(16, 128, 64)

    def f(x):
        for w in weights:
            x = torch.tanh(x @ w)
        return x.pow(2).sum()

    ref = vmap(grad(f))(xs)
    with membudget.budget(10**10) as free:
        vmap(grad(f))(xs)
    budget = int(free.stats.peak_bytes * 0.6)
    with StorageMeter() as meter, membudget.budget(budget) as session:
        got = vmap(grad(f))(xs)
    assert session.stats.evictions > 0 and meter.peak_bytes <= budget
    assert torch.equal(got, ref)

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x):
        return functional_call(model, p, (x,)).sum()

    refused = pytest.raises(membudget.UnsupportedTensorError, match=r"torch\.func transform")
    with refused, membudget.budget("1 GB"):
        vmap(grad(loss), in_dims=(None, 0))(params, xs)
    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, xs)
    assert per_sample["0.weight"].shape == (16, 32, 64)


def test_an_input_too_big_for_the_budget_is_named_by_its_size():
    # The error named the engine's command ('put'), not what the user gave it.
    import torch

    import membudget

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4096, 8)  # 131,072 B, made before the session
    with (pytest.raises(membudget.BudgetTooSmallError, match="taking in a leaf of 131,072 B"),
          membudget.budget("100 KB")):
        lin(x).sum().backward()
