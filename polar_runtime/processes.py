"""Stopping a child that leads its own process group (servers, proxies, harnesses).

Every long-lived child is started with ``start_new_session=True`` so that Ctrl-C in a terminal
does not reach it half-way and so that one signal stops what it forked (vLLM's engine core,
a harness's helpers).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


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
