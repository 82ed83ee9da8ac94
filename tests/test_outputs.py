"""Bad input through the real commands: an output that is one of the inputs is refused and
the input kept, files are written whole or not at all, and bad options get one line on
stderr and exit status 2 before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from membudget.errors import MembudgetError
from membudget.outputs import check_output, replacing
from membudget.trace import load_trace, write_trace

LOGS = Path(__file__).resolve().parents[1].parent / "shared" / "dtr-logs" / "logs.zip"


def cli(*args: str, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the command line as a user does, with ``env`` added to the environment."""
    return subprocess.run([sys.executable, "-m", "membudget.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "lstm.jsonl.gz"
    assert cli("import", "dtr-log", f"{LOGS}::lstm", "-o", str(path)).returncode == 0
    return path


def refused(result: subprocess.CompletedProcess, words: str) -> bool:
    lines = result.stderr.strip().splitlines()
    return result.returncode == 2 and len(lines) == 1 and words in lines[0]


@pytest.mark.parametrize("command", [
    ["plan", "{t}", "--time-limit", "1", "-o", "{t}"],
    ["plan", "{t}", "--export-problem", "{t}"],
    ["import", "dtr-log", "{t}", "-o", "{t}"],
    ["sweep", "{t}", "--policies", "dtr", "--ratios", "0.5", "--json", "{t}"],
    ["sweep", "{t}", "--policies", "dtr", "--ratios", "0.5", "--plot", "{t}"],
    ["timeline", "{t}", "--ratio", "0.5", "-o", "{t}"],
    ["timeline", "{t}", "--ratio", "0.5", "-o", "{d}/t.png", "--snapshot", "{t}"],
    ["optimum", "{t}", "--ratio", "0.5", "--plan-out", "{t}"],
    ["layout", "{t}", "--ratio", "0.5", "-o", "{t}"],
])
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(trace_file, tmp_path,
                                                                   command):
    copy = tmp_path / trace_file.name
    copy.write_bytes(trace_file.read_bytes())
    link = tmp_path / "same.jsonl.gz"  # the same file under another name counts too
    link.symlink_to(copy)
    before = copy.read_bytes()
    for out in (copy, link):
        args = [a.replace("{d}", str(tmp_path)) for a in command]
        args = [str(copy) if a == "{t}" and i == command.index("{t}") else
                (str(out) if a == "{t}" else a) for i, a in enumerate(args)]
        result = cli(*args)
        assert refused(result, "is also an input"), (args, result.stderr)
        assert copy.read_bytes() == before


def test_outputs_that_cannot_be_files_are_refused_before_any_work(trace_file, tmp_path):
    for out, words in ((tmp_path, "is a directory"), ("/dev/null", "not a regular file"),
                       (f"{tmp_path}/x.zip::t.jsonl", "member of an archive")):
        result = cli("timeline", str(trace_file), "--ratio", "0.5", "-o", str(out))
        assert refused(result, words), result.stderr
    assert Path("/dev/null").is_char_device()


def test_a_missing_folder_is_made_for_an_output(trace_file, tmp_path):
    out = tmp_path / "new" / "folder" / "t.png"
    assert cli("timeline", str(trace_file), "--ratio", "0.5", "-o", str(out)).returncode == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(trace_file, tmp_path):
    target = tmp_path / "t.jsonl.gz"
    target.write_bytes(trace_file.read_bytes())
    before = target.read_bytes()
    trace = load_trace(trace_file)

    def events():
        for k, ev in enumerate(trace.events):
            if k == 100:
                raise KeyboardInterrupt  # Ctrl-C, or a full disk, halfway through
            yield ev

    with pytest.raises(KeyboardInterrupt):
        write_trace(target, trace.header, events())
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl.gz"]
    with pytest.raises(MembudgetError, match="could not write"), replacing(target) as tmp:
        tmp.write_text("x")
        raise OSError(28, "No space left on device")
    assert target.read_bytes() == before


def test_check_output_compares_files_not_names(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("x")
    assert check_output(tmp_path / "b.txt", [a]) == tmp_path / "b.txt"
    with pytest.raises(MembudgetError, match="is also an input"):
        check_output(tmp_path / "." / "a.txt", [f"{a}::member"])


@pytest.mark.parametrize(("args", "words"), [
    (["simulate", "{t}", "--ratio", "inf"], "--ratio must be a finite number > 0"),
    (["simulate", "{t}", "--ratio", "nan"], "--ratio must be a finite number > 0"),
    (["simulate", "{t}", "--ratio", "0.5", "--overhead-limit", "nan"], "--overhead-limit"),
    (["simulate", "{t}", "--ratio", "0.5", "--overhead-limit", "-1"], "--overhead-limit"),
    (["sweep", "{t}", "--ratios", ""], "--ratios is empty"),
    (["sweep", "{t}", "--ratios", "0.5,0"], "--ratios must be a finite number > 0"),
    (["sweep", "{t}", "--policies", ","], "--policies is empty"),
    (["sweep", "{t}", "--swap", ""], "--swap is empty"),
    (["optimum", "{t}", "--ratio", "0.5", "--time-limit", "-1"], "--time-limit"),
    (["layout", "{t}", "--ratio", "0.5", "--time-limit", "0"], "--time-limit"),
    (["layout", "{t}", "--ratio", "0.5", "--policy", "nope"], "unknown policy 'nope'"),
    (["layout", "{t}", "--ratio", "0.5", "--policy", "coop"], "chooses by addresses"),
    (["plan", "{t}", "--solver", "nope"], "unknown --solver 'nope'"),
    (["plan", "{t}", "--time-limit", "nan"], "--time-limit"),
    (["timeline", "{t}", "--ratio", "-0.5", "-o", "x.png"], "--ratio"),
    (["demo", "--steps", "0"], "--steps must be at least 1"),
])
def test_bad_options_get_one_line_and_exit_2(trace_file, args, words):
    result = cli(*[str(trace_file) if a == "{t}" else a for a in args])
    assert refused(result, words), result.stderr


def test_simulate_json_exits_1_when_the_run_does_not_complete(trace_file):
    result = cli("simulate", str(trace_file), "--ratio", "0.01", "--json")
    assert result.returncode == 1 and '"status": "oom"' in result.stdout


@pytest.mark.parametrize(("line", "words"), [
    ('{"ev": "call", "t": 2, "op": "f", "in": [1], "out": [2], "bytes": [8], "cost": NaN}',
     "field 'cost' must be a finite number >= 0, got nan"),
    ('{"ev": "call", "t": 2, "op": "f", "in": [1], "out": [2], "bytes": [8], "cost": Infinity}',
     "field 'cost' must be a finite number"),
    ('{"ev": "put", "t": 1, "bytes": 1000000000000000000000000000000}', "within int64"),
    ('{"ev": "put", "t": 1, "bytes": ' + "9" * 5000 + "}", "malformed JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"ev": "' + "x" * 1_000_000 + '"}', "unknown event 'xxx"),
])
def test_a_bad_trace_line_is_named_in_one_short_line(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"membudget_trace": 1}\n{"ev": "put", "t": 1, "bytes": 8}\n' + line + "\n")
    result = cli("simulate", str(path), "--ratio", "0.5")
    assert refused(result, words) and "bad.jsonl:3" in result.stderr, result.stderr[:500]
    assert len(result.stderr) < 400  # a field is quoted in part, never whole


def test_invalid_utf8_and_a_directory_are_named(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"membudget_trace": 1}\n{"ev": "put", "t": 1, "bytes": 8}\n\xff\xfe\n')
    assert refused(cli("simulate", str(path), "--ratio", "0.5"), "bin.jsonl:3")
    assert refused(cli("simulate", str(tmp_path), "--ratio", "0.5"), "is a directory")
