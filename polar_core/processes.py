"""Process helpers: stopping a child that leads its own process group, and a lock across processes.

Every long-lived child is started with ``start_new_session=True`` so that Ctrl-C in a terminal
does not reach it half-way and so that one signal stops what it forked (vLLM's engine core,
a harness's helpers).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # Stragglers that outlived their leader (daemons a harness forked) still hold the group id.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created with its folder if missing): one process at
    a time builds a model or installs a harness, whoever else started the same work waits."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; harnesses run in process groups of their own)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def stop_children(sig: int = signal.SIGTERM, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Signal the process group of every child this process started (harness runs, evaluators,
    vLLM, mitmdump: each leads its own group), except ``exclude``. Returns the pids signalled."""
    me, hit = os.getpid(), []
    for pid in child_pids(me):
        if pid in exclude:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            pgid = os.getpgid(pid)
            if pgid == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
            hit.append(pid)
    return hit


@contextlib.contextmanager
def interruptible() -> Iterator[threading.Event]:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (so every ``finally`` and
    context manager runs) and set the returned event (so worker loops stop taking new work)."""
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        stop.set()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def stop_all_children(grace: float = 2.0) -> bool:
    """After an interruption: SIGTERM every child's process group, SIGKILL what is left after
    ``grace`` seconds. The context managers stop what they own; this catches what was started
    half-way. Returns whether anything was left."""
    if not stop_children(signal.SIGTERM):
        return False
    time.sleep(grace)
    stop_children(signal.SIGKILL)
    return True
