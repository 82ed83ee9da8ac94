"""Bad input through every command, as a careful user and a security-minded reviewer try it.

Each case runs the real command line (``python -m membudget.cli``) on a bad file, a bad option
or a bad output path, and is judged from the outside: a *clear refusal* is exit status 2 with
exactly one line on stderr that starts ``error:`` and no traceback; an input the command
*accepts* (a valid edge case, such as a trace with no events) must exit 0, or 1 where the
command reports a run that does not complete. Anything else (a traceback, several lines, a
crash, a hang past 20 s) is a failure. Every input file is hashed before and after: no command
may change one. Writes docs/results/bad-input.md.
Run: python benchmarks/bad_input.py [--workers N]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from membudget.bench.report import git_state
from membudget.outputs import write_text

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT.parent / "shared" / "dtr-logs" / "logs.zip"
CSV = ROOT.parent / "shared" / "minimalloc" / "A.1048576.csv"
LIMIT_S = 20.0
HEADER = {"membudget_trace": 1, "model": "bad"}
PUT = {"ev": "put", "t": 1, "bytes": 64}


def lines(*objs: object) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def call(**kw: object) -> dict:
    return {"ev": "call", "op": "f", "in": [1], "out": [2], "bytes": [64], "cost": 1, **kw}


def trace(*events: object) -> bytes:
    return lines(HEADER, PUT, *events)


def dtr(*records: dict) -> bytes:
    start = ({"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"},
             {"INSTRUCTION": "CONSTANT", "NAME": "w"},
             {"INSTRUCTION": "MEMORY", "NAME": "w", "MEMORY": "64"})
    return lines(*start, *records)


def zipped(name: str, data: bytes) -> bytes:
    path = Path(tempfile.mktemp(suffix=".zip"))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(name, data)
    out = path.read_bytes()
    path.unlink()
    return out


# bad traces (membudget v1 and DTR logs): name -> bytes (None: a directory)
TRACES: dict[str, bytes | None] = {
    "empty.jsonl": b"",
    "blank.jsonl": b"\n \n\t\n",
    "header-only.jsonl": lines(HEADER),
    "not-json.jsonl": b"hello\n",
    "array-header.jsonl": b"[1, 2]\n",
    "version-2.jsonl": lines({"membudget_trace": 2}),
    "binary.jsonl": bytes(range(256)) * 4,
    "utf8-header.jsonl": b'{"membudget_trace": 1, "model": "\xff"}\n',
    "utf8-event.jsonl": trace() + b'{"ev": "phase", "name": "\xfe\xff"}\n',
    "nan-cost.jsonl": trace() + b'{"ev":"call","op":"f","in":[1],'
                      b'"out":[2],"bytes":[64],"cost":NaN}\n',
    "inf-cost.jsonl": trace() + b'{"ev":"call","op":"f","in":[1],"out":[2],"bytes":[64],'
                      b'"cost":Infinity}\n',
    "negative-cost.jsonl": trace(call(cost=-1)),
    "string-cost.jsonl": trace(call(cost="1")),
    "huge-size.jsonl": trace(call(bytes=[10**30])),
    "huge-put.jsonl": lines(HEADER, {"ev": "put", "t": 1, "bytes": 10**30}),
    "negative-size.jsonl": trace(call(bytes=[-64])),
    "digits.jsonl": trace() + b'{"ev":"get","t":' + b"7" * 5000 + b"}\n",
    "nested.jsonl": trace() + b"[" * 100_000 + b"\n",
    "long-field.jsonl": trace(call(op="x" * (16 << 20))),
    "unknown-event.jsonl": trace({"ev": "explode"}),
    "missing-field.jsonl": trace({"ev": "call", "op": "f"}),
    "bool-id.jsonl": trace({"ev": "get", "t": True}),
    "float-id.jsonl": trace({"ev": "get", "t": 1.0}),
    "alias-range.jsonl": trace(call(alias=[3])),
    "mut-range.jsonl": trace(call(mut=[4])),
    "unequal-lists.jsonl": trace(call(bytes=[64, 64])),
    "rebind-input.jsonl": trace(call(out=[1])),
    "rebind-twice.jsonl": trace(call(out=[2, 2], bytes=[64, 64])),
    "rebind-put.jsonl": trace(PUT),
    "use-undefined.jsonl": trace(call(**{"in": [9]})),
    "release-twice.jsonl": trace({"ev": "release", "t": 1}, {"ev": "release", "t": 1}),
    "markup-name.jsonl": lines({**HEADER, "model": "[/x][bold]"}, PUT, call(op="[/y]")),
    "markup-error.jsonl": trace({"ev": "[/x]"}),
    "truncated.jsonl.gz": gzip.compress(trace(*[{"ev": "get", "t": 1}] * 500))[:80],
    "not-gzip.jsonl.gz": b"\x1f\x8b this is not gzip",
    "not-a-zip.zip": b"PK\x03\x04 not an archive",
    "truncated.zip": zipped("t.jsonl", trace(*[{"ev": "get", "t": 1}] * 500))[:100],
    "empty.zip": zipped("readme.txt", b"nothing here"),
    "bomb.zip": zipped("bomb.jsonl", lines(HEADER) + b"\n" * (300 << 20)),
    "a-directory": None,
    "dtr-nested.log": dtr() + b"[" * 100_000 + b"\n",
    "dtr-utf8.log": dtr() + b'{"INSTRUCTION": "RELEASE", "NAME": "\xff"}\n',
    "dtr-long-name.log": dtr({"INSTRUCTION": "COPY", "SRC": "x" * (16 << 20), "DST": "y"}),
    "dtr-no-start.log": lines({"INSTRUCTION": "CONSTANT", "NAME": "w"}),
    "dtr-inf-time.log": dtr({"INSTRUCTION": "MUTATE", "NAME": "f", "ARGS": ["w"],
                             "MUTATE": [0], "TIME": 1e400}),
    "dtr-neg-memory.log": dtr({"INSTRUCTION": "CALL", "NAME": "f", "ARGS": ["w"],
                               "RESULT": ["a"], "TIME": "1"},
                              {"INSTRUCTION": "MEMORY", "NAME": "a", "MEMORY": "-5"}),
    "dtr-huge-memory.log": dtr({"INSTRUCTION": "CALL", "NAME": "f", "ARGS": ["w"],
                                "RESULT": ["a"], "TIME": "1"},
                               {"INSTRUCTION": "MEMORY", "NAME": "a", "MEMORY": "9" * 30}),
    "dtr-args-dict.log": dtr({"INSTRUCTION": "CALL", "NAME": "f", "ARGS": {"a": 1},
                              "RESULT": [], "TIME": "1"}),
    "dtr-name-list.log": dtr({"INSTRUCTION": "RELEASE", "NAME": ["w"]}),
    "dtr-rebind.log": dtr({"INSTRUCTION": "CALL", "NAME": "f", "ARGS": ["w"], "RESULT": ["w"],
                           "TIME": "1"}, {"INSTRUCTION": "MEMORY", "NAME": "w", "MEMORY": "8"},
                          {"INSTRUCTION": "ALIAS", "NAME": "w", "ALIAS": "-1"}),
    "dtr-alias.log": dtr({"INSTRUCTION": "CALL", "NAME": "f", "ARGS": ["w"], "RESULT": ["a"],
                          "TIME": "1"}, {"INSTRUCTION": "MEMORY", "NAME": "a", "MEMORY": "8"},
                         {"INSTRUCTION": "ALIAS", "NAME": "a", "ALIAS": "7"}),
}
# accepted as valid (edge cases): by these commands, with exit status 0 or 1
READERS = {"simulate", "sweep", "timeline", "optimum", "plan"}
VALID = {"header-only.jsonl": READERS - {"plan"}, "markup-name.jsonl": READERS,
         "long-field.jsonl": READERS}  # (a 16 MB op name is long, not wrong)
CSVS: dict[str, bytes] = {
    "empty.csv": b"",
    "bom-only.csv": b"\xef\xbb\xbf",
    "header-only.csv": b"id,lower,upper,size\n",
    "no-size.csv": b"id,lower,upper\n0,0,1\n",
    "extra-column.csv": b"id,lower,upper,size,colour\n0,0,1,8,red\n",
    "short-row.csv": b"id,lower,upper,size\n0,0,1\n",
    "not-int.csv": b"id,lower,upper,size\n0,0,1,eight\n",
    "float.csv": b"id,lower,upper,size\n0,0,1,8.5\n",
    "huge.csv": b"id,lower,upper,size\n0,0,1," + b"9" * 30 + b"\n",
    "digits.csv": b"id,lower,upper,size\n0,0,1," + b"9" * 5000 + b"\n",
    "zero-size.csv": b"id,lower,upper,size\n0,0,1,0\n",
    "empty-life.csv": b"id,lower,upper,size\n0,3,3,8\n",
    "duplicate.csv": b"id,lower,upper,size\n0,0,1,8\n0,1,2,8\n",
    "utf8.csv": b"id,lower,upper,size\n\xff,0,1,8\n",
    "nul.csv": b"id,lower,upper,size\n0,0,1,8\x00\n",
    "long-field.csv": b"id,lower,upper,size\n" + b"x" * (16 << 20) + b",0,1,8\n",
    "quote.csv": b'id,lower,upper,size\n"0,0,1,8\n',
    "binary.csv": bytes(range(256)) * 4,
    "bad-offset.csv": b"id,lower,upper,size,offset\n0,0,1,8,-x\n",
}
VALID_CSV = {"header-only.csv"}


@dataclass
class Case:
    group: str
    args: list[str]
    accept: bool = False  # a valid edge case: exit 0 or 1
    env: dict[str, str] | None = None


def cases(d: Path) -> list[Case]:
    """Every case, with its files written under ``d``."""
    out: list[Case] = []
    o = str(d / "out" / "result")
    for name, data in TRACES.items():
        path = d / name
        if data is None:
            path.mkdir()
        else:
            path.write_bytes(data)
        src = f"{path}::t" if name in ("not-a-zip.zip", "truncated.zip") else str(path)
        env = {"MEMBUDGET_MAX_INPUT": "64MiB"}
        for cmd in (["simulate", src, "--ratio", "0.5"],
                    ["sweep", src, "--ratios", "0.5", "--policies", "dtr", "--workers", "1"],
                    ["timeline", src, "--ratio", "0.5", "-o", o + ".png"],
                    ["optimum", src, "--ratio", "0.5", "--time-limit", "2"],
                    ["plan", src, "--time-limit", "2", "-o", o + ".json"],
                    ["import", "dtr-log", src, "-o", o + ".jsonl"]):
            out.append(Case("trace file", cmd, cmd[0] in VALID.get(name, ()), env))
    for name, data in CSVS.items():
        (d / name).write_bytes(data)
        out.append(Case("CSV file", ["pack", str(d / name), "-o", o + ".csv"],
                        name in VALID_CSV))
    good = d / "good.jsonl.gz"
    subprocess.run([sys.executable, "-m", "membudget.cli", "import", "dtr-log",
                    f"{LOGS}::unet", "-o", str(good)], check=True, capture_output=True)
    g, p = str(good), str(CSV)
    options = [
        ["simulate", g], ["simulate", g, "--ratio", "0.5", "--budget", "1GB"],
        *[["simulate", g, "--ratio", x] for x in ("0", "-1", "nan", "inf", "1e400", "abc")],
        ["simulate", g, "--budget", "lots"], ["simulate", g, "--budget", "-5"],
        ["simulate", g, "--ratio", "0.5", "--policy", "nope"],
        ["simulate", g, "--ratio", "0.5", "--allocator", "nope"],
        ["simulate", g, "--ratio", "0.5", "--inplace", "nope"],
        ["simulate", g, "--ratio", "0.5", "--swap", "nope"],
        *[["simulate", g, "--ratio", "0.5", "--overhead-limit", x] for x in ("0.5", "nan",
                                                                              "-1")],
        *[["sweep", g, "--ratios", x] for x in ("", ",", "0", "0.5,abc", "inf", "-0.5")],
        ["sweep", g, "--ratios", "0.5", "--policies", ""],
        ["sweep", g, "--ratios", "0.5", "--policies", "dtr,nope"],
        ["sweep", g, "--ratios", "0.5", "--swap", ""],
        ["sweep", g, "--ratios", "0.5", "--workers", "-3"],
        ["timeline", g, "--ratio", "0.5", "-o", str(d / "out")],
        ["optimum", g, "--ratio", "0.5", "--time-limit", "-1"],
        ["optimum", g, "--ratio", "0.5", "--time-limit", "nan"],
        ["optimum", g],
        ["plan", g, "--time-limit", "0"], ["plan", g, "--solver", "nope"],
        ["plan", "nope-not-a-model"], ["plan", "unet", "--batch", "0"],
        ["plan", "unet", "--device-spec", "nope"], ["plan", "unet", "--optimizer", "nope"],
        ["pack", p, "--capacity", "-1"], ["pack", p, "--capacity", "0"],
        ["pack", p, "--time-limit", "-1"], ["pack", p, "--time-limit", "nan"],
        ["trace", "nope", "-o", o], ["trace", "unet", "-o", o, "--batch", "0"],
        ["trace", "unet", "-o", o, "--fake", "--batch", str(10**18)],
        ["trace", "unet", "-o", o, "--batch", str(10**18)],
        ["trace", "unet", "-o", o, "--device", "nope"],
        ["trace", "unet", "-o", o, "--device", "cuda:3"],
        ["trace", "unet", "-o", o, "--device", "meta"],
        ["trace", "unet", "-o", o, "--fake", "--device", "cpu"],
        ["trace", "unet", "-o", o, "--fake", "--device-spec", "nope"],
        ["trace", "unet", "-o", o, "--fake", "--optimizer", "nope"],
        ["demo", "--steps", "0"], ["demo", "--ratio", "0"], ["demo", "--ratio", "nan"],
        ["demo", "--steps", "1", "--policy", "nope"],
        ["simulate", str(d / "missing.jsonl"), "--ratio", "0.5"],
        ["simulate", f"{LOGS}::nope", "--ratio", "0.5"],
        ["simulate", g, "--ratio", "0.5", "--json"],
    ]
    out += [Case("option", a) for a in options[:-1]]
    out.append(Case("option", options[-1], accept=True))
    out.append(Case("option", ["simulate", g, "--ratio", "0.5"],
                    env={"MEMBUDGET_MAX_INPUT": "lots"}))
    outputs = [
        ["plan", g, "--time-limit", "1", "-o", g],
        ["import", "dtr-log", g, "-o", g],
        ["sweep", g, "--ratios", "0.5", "--policies", "dtr", "--json", g],
        ["sweep", g, "--ratios", "0.5", "--policies", "dtr", "--plot", g],
        ["timeline", g, "--ratio", "0.5", "-o", g],
        ["timeline", g, "--ratio", "0.5", "-o", o + ".png", "--snapshot", g],
        ["optimum", g, "--ratio", "0.5", "--plan-out", g],
        ["pack", p, "-o", p],
        ["plan", g, "--export-problem", g],
        *[[*c, x] for c in (["plan", g, "--time-limit", "1", "-o"], ["pack", p, "-o"],
                            ["timeline", g, "--ratio", "0.5", "-o"],
                            ["trace", "unet", "--fake", "-o"])
          for x in (str(d), "/dev/null", "/dev/full", f"{LOGS}::x.csv", "/proc/nope/x",
                    "/sys/x")],
    ]
    out += [Case("output path", a) for a in outputs]
    return out


@dataclass
class Outcome:
    case: Case
    code: int | None
    stderr: str
    seconds: float

    @property
    def verdict(self) -> str:
        err = self.stderr.strip().splitlines()
        if self.code is None:
            return "over 20 s"
        if "Traceback" in self.stderr or self.code not in (0, 1, 2):
            return "crash or traceback"
        if self.case.accept:
            return "accepted" if self.code in (0, 1) else "refused a valid input"
        if self.code == 2 and len(err) == 1 and err[0].startswith("error:"):
            return "one clear line"
        return "accepted a bad input" if self.code == 0 else "unclear error"


def run(case: Case) -> Outcome:
    t0 = time.perf_counter()
    env = {**os.environ, **(case.env or {})}
    try:
        r = subprocess.run([sys.executable, "-m", "membudget.cli", *case.args],
                           capture_output=True, text=True, timeout=LIMIT_S, env=env)
        code, stderr = r.returncode, r.stderr
    except subprocess.TimeoutExpired:
        code, stderr = None, ""
    return Outcome(case, code, stderr, time.perf_counter() - t0)


def digest(d: Path) -> dict[str, str]:
    files = [*d.glob("*"), LOGS, CSV]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        todo = cases(d)
        before = digest(d)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.workers) as pool:
            done = []
            for i, r in enumerate(pool.map(run, todo), 1):
                done.append(r)
                print(f"\r{i}/{len(todo)} cases", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        after = digest(d)
    changed = sorted(f for f in before if before[f] != after.get(f))
    groups = sorted({c.group for c in todo})
    verdicts = sorted({r.verdict for r in done})
    rows = ["| cases | " + " | ".join(verdicts) + " | total |",
            "|---|" + "---:|" * (len(verdicts) + 1)]
    for gname in groups:
        mine = [r for r in done if r.case.group == gname]
        rows.append(f"| {gname} | " + " | ".join(str(sum(r.verdict == v for r in mine))
                                                  for v in verdicts) + f" | {len(mine)} |")
    rows.append("| **all** | " + " | ".join(str(sum(r.verdict == v for r in done))
                                            for v in verdicts) + f" | {len(done)} |")
    bad = [r for r in done if r.verdict not in ("one clear line", "accepted")]
    slow = max(done, key=lambda r: r.seconds)
    text = [
        "# Bad input through every command", "",
        f"`python benchmarks/bad_input.py` · {time.strftime('%Y-%m-%d')} · {git_state(ROOT)} · "
        f"{len(done)} cases in {time.perf_counter() - t0:.0f} s on {args.workers} workers", "",
        "Each case runs the real command line on a bad trace or DTR log (every command that "
        "reads one), a bad MiniMalloc CSV (`pack`), a bad option, or a bad output path. A "
        "*clear refusal* is exit status 2 with one `error:` line on stderr and no traceback; a "
        "valid edge case (a trace with no events, brackets in a model's name, a 16 MB op name) "
        "must be *accepted* (exit 0, or 1 for a run that does not complete).", "",
        *rows, "",
        f"Input files changed by any command: {len(changed)}"
        + (f" ({', '.join(changed)})" if changed else "") + ".",
        f"Slowest case: {slow.seconds:.1f} s (`membudget {' '.join(slow.case.args)[:120]}`); "
        f"limit {LIMIT_S:.0f} s.", "",
    ]
    if bad:
        text += ["## Cases that are not a clear line", ""]
        text += [f"- `membudget {' '.join(r.case.args)[:160]}`: {r.verdict}, exit {r.code}: "
                 f"{r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else ''}"
                 for r in bad]
    else:
        text += ["Every case is a clear refusal or an accepted valid input."]
    write_text(ROOT / "docs" / "results" / "bad-input.md", "\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
