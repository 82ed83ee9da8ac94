"""Ctrl-C during a solve: the first SIGINT stops the solvers, which keep the best result they
have; a second one raises KeyboardInterrupt (a hard stop).

``sigint_stops()`` wraps a solve (``pack``, ``plan_trace``, ``optimum``, a worker's job). In
it, SIGINT sets the flag that loops poll (``requested()``) and calls the stops registered
with ``stopping()`` (``CpSolver.stop_search``, ``Highs.cancelSolve``, ...) at once and then
every 0.1 s until the block ends, since a solver may start just after a call. They are called
from a thread of this module: a solver holds the main thread in C++, where Python runs no
signal handler until it returns. Outside such a block, or where SIGINT is ignored (a
script's background job, ``nohup``), SIGINT does what it did.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: Exit status of a command whose solve Ctrl-C stopped (128 + SIGINT, as shells report it).
EXIT_CODE = 130

_requested = threading.Event()
_stops: list[Callable[[], None]] = []
_active = False  # a block is in force
_sigints = 0  # SIGINTs handled in the main thread within it


def requested() -> bool:
    """Whether Ctrl-C has asked the solve to stop."""
    return _requested.is_set()


@contextmanager
def stopping(stop: Callable[[], None]) -> Iterator[None]:
    """Within the block, Ctrl-C calls ``stop`` (from another thread, repeatedly: it must
    be harmless to call again)."""
    _stops.append(stop)
    try:
        yield
    finally:
        _stops.remove(stop)


@contextmanager
def sigint_stops() -> Iterator[None]:
    """Within the block, Ctrl-C stops the solve instead of raising KeyboardInterrupt (see
    the module). Nested in another such block, outside the main thread, or with SIGINT
    ignored (or handled outside Python), the block changes nothing."""
    global _active, _sigints
    if (_active or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None)):
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(read, done), daemon=True)
    _requested.clear()
    _active, _sigints = True, 0
    old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    old_handler = signal.signal(signal.SIGINT, _on_sigint)
    watcher.start()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old_handler)
        signal.set_wakeup_fd(old_fd)
        done.set()
        os.write(write, b"\0")  # wakes the watcher if no signal came
        watcher.join()
        os.close(read)
        os.close(write)
        _active = False
        _requested.clear()


def _on_sigint(signum: int, frame: object) -> None:
    """SIGINT in the main thread: the first asks the solve to stop, a second one raises."""
    global _sigints
    _sigints += 1
    _requested.set()
    if _sigints > 1:
        raise KeyboardInterrupt


def _watch(read: int, done: threading.Event) -> None:
    """Wait for SIGINT (its number on the wakeup pipe), then call the stops every 0.1 s
    until ``done``."""
    while signal.SIGINT not in os.read(read, 64):
        if done.is_set():
            return
    _requested.set()
    while not done.is_set():
        for stop in list(_stops):
            stop()
        done.wait(0.1)
