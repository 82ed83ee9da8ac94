"""Worker processes: run a solver's function in another Python process, relaying its
progress reports.

OR-Tools bundles its own libhighs.so.1 and highspy ships another with the same soname: one
process can load only one of them, so a solver whose rival library is already loaded here
runs in a worker process instead (``mip_backends.run_mip`` decides). A worker is a fresh
interpreter (``python -m membudget.plan.solver_worker``) that imports nothing of the solvers
until its first job; there is one per name, started on first use, kept for later jobs,
killed if a job fails or the worker dies (a new one starts next time) and told to exit when
this process exits.

Protocol, pickles over the worker's stdin and stdout: the parent sends ``(function, args)``
(``function`` defined at a module's top level, so that it pickles by reference); the worker
answers ``("started", None)``, calls ``function(*args, relay)``, answers ``("progress",
values)`` for each ``relay(*values)`` and then ``("done", result)``, and exits at end of
input. Anything the solver prints to file descriptor 1 goes to the worker's stderr instead.

Ctrl-C: the worker runs in a session of its own, out of reach of the terminal's SIGINT. Once
it has started a job, Ctrl-C here (:mod:`.interrupt`) sends it one SIGINT, which stops its
solver as it would here: the job answers with the best result it had. A second Ctrl-C here
kills it.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from membudget.plan import interrupt

T = TypeVar("T")

_WORKERS: dict[str, subprocess.Popen] = {}


def call(name: str, function: Callable[..., T], args: tuple[Any, ...],
         report: Callable[..., None] | None = None) -> T:
    """``function(*args, relay)`` in the worker process ``name``, passing each progress
    report to ``report``; Ctrl-C stops it (see the module). If this fails (a second Ctrl-C)
    or the worker dies, the worker is killed."""
    w = _worker(name)
    assert w.stdin is not None and w.stdout is not None
    try:
        pickle.dump((function, args), w.stdin)
        w.stdin.flush()
        pickle.load(w.stdout)  # ("started", None): the job's SIGINT handler is in place
        with interrupt.stopping(_interrupter(w)):
            while True:
                kind, payload = pickle.load(w.stdout)
                if kind == "done":
                    return payload
                if report is not None:
                    report(*payload)
    except BaseException as e:
        w.kill()
        w.wait()
        del _WORKERS[name]
        if isinstance(e, (EOFError, OSError, pickle.UnpicklingError)):
            raise RuntimeError(f"the {name} worker process died ({e!r}); see its "
                               "stderr") from e
        raise


def _interrupter(w: subprocess.Popen) -> Callable[[], None]:
    """A stop for ``w``'s job that sends it SIGINT once (a second would abort it)."""
    sent = False

    def stop() -> None:
        nonlocal sent
        if not sent:
            sent = True
            w.send_signal(signal.SIGINT)

    return stop


def _worker(name: str) -> subprocess.Popen:
    """The worker process ``name`` (started on first use, or again if it died)."""
    w = _WORKERS.get(name)
    if w is None or w.poll() is not None:
        src = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        w = _WORKERS[name] = subprocess.Popen(
            [sys.executable, "-m", "membudget.plan.solver_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, start_new_session=True)
    return w


@atexit.register
def _stop_workers() -> None:
    for w in _WORKERS.values():
        if w.stdin is not None:
            w.stdin.close()  # the worker exits at end of input
        try:
            w.wait(timeout=5)
        except subprocess.TimeoutExpired:
            w.kill()


def _serve() -> None:
    """Worker loop: read pickled jobs from stdin, answer on the original stdout (solver
    output that goes to file descriptor 1 is sent to stderr instead)."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, lambda *_: None)  # a stop sent as its job ended: nothing

    def answer(kind: str, payload: object) -> None:
        pickle.dump((kind, payload), out)
        out.flush()

    while True:
        try:
            function, args = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        with interrupt.sigint_stops():
            answer("started", None)
            result = function(*args, lambda *values: answer("progress", values))
        answer("done", result)


if __name__ == "__main__":
    _serve()
