"""Cancel one group of rollout samples: its harness processes, its sandboxes and its proxy sessions.

Why: the asynchronous loop (``polar_runtime/loop/asynchronous.py``) drops a straggler group whole when
it cannot finish within the staleness bound. Without a cancel the group's harnesses run on to their
timeout (``harness.timeout_s``, 300-600 s in the configs) and hold a rollout slot and vLLM's batch
for nothing: the dropped group's result is thrown away anyway. ``terminate_all`` (Ctrl-C of a
rollout) is no answer: it kills every group's harnesses, not one.

How: the thread that runs a sample binds a :class:`CancelScope` (:func:`bound`); the places that start
a sample's processes (``harnesses.run_invocation``, ``sandbox.base.supervise``: the agent, build
steps, the verifier, each in a process group of its own; a container backend removes its container
when its client is killed) :func:`track` them in the current scope; ``rollout.run_sample`` notes its
session id. :meth:`CancelScope.cancel` kills the tracked process groups, refuses every later start in
the scope (a process tracked after the cancel is killed at once), and closes the sessions at the
proxy (``DELETE /_polar/sessions``: the key is revoked, a call still coming is refused). Threads
without a scope (synchronous rollouts, the demo) track nothing: nothing changes for them.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from typing import Any, Iterator, Optional

from polar_core.processes import kill_group

_local = threading.local()


class CancelScope:
    def __init__(self, name: str) -> None:
        self.name = name
        self.cancelled = threading.Event()
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self.sessions: list[str] = []
        self.killed = 0  # process groups killed by the cancel (or at start, after it)

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            if not self.cancelled.is_set():
                self._procs.add(proc)
                return
            self.killed += 1
        kill_group(proc, grace=0.0)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def note_session(self, session_id: str) -> None:
        with self._lock:
            self.sessions.append(session_id)

    def cancel(self, control: Any = None, grace: float = 1.0) -> dict[str, Any]:
        """Kill what runs in the scope, refuse what would start, close its sessions at the proxy
        (``control``: a ``polar_core.control.ProxyControl``; None: no proxy). Returns the counts."""
        with self._lock:
            self.cancelled.set()
            procs, sessions = list(self._procs), list(self.sessions)
            self._procs.clear()
            self.killed += len(procs)
        for proc in procs:
            kill_group(proc, grace=grace)
        closed = 0
        if control is not None:
            for sid in sessions:
                with contextlib.suppress(Exception):  # a proxy that is gone has nothing left to close
                    control.forget_session(sid)
                    closed += 1
        return {"group": self.name, "processes_killed": self.killed, "sessions_closed": closed}


def current() -> Optional[CancelScope]:
    return getattr(_local, "scope", None)


def is_cancelled() -> bool:
    scope = current()
    return scope is not None and scope.cancelled.is_set()


@contextlib.contextmanager
def bound(scope: Optional[CancelScope]) -> Iterator[None]:
    """Run the block with ``scope`` as this thread's scope (pool threads are reused: restored after)."""
    before = current()
    _local.scope = scope
    try:
        yield
    finally:
        _local.scope = before


def track(proc: subprocess.Popen) -> None:
    scope = current()
    if scope is not None:
        scope.add(proc)


def untrack(proc: subprocess.Popen) -> None:
    scope = current()
    if scope is not None:
        scope.discard(proc)


def note_session(session_id: str) -> None:
    scope = current()
    if scope is not None:
        scope.note_session(session_id)
