"""The live trial's sweep of a timed-out agent phase, on this host's /proc (no daemon; ~1 s): the
phase's session and every descendant of it go, also a tool the harness started in a session of its
own (setsid); a server that daemonized away (reparented) stays, as a server the agent left would."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SANDBOX = Path(__file__).resolve().parents[3] / "polar_trial" / "sandbox"


@pytest.fixture(scope="module")
def trialinit():
    # the in-container init imports its sibling as `init` (they are copied side by side)
    sys.path.insert(0, str(SANDBOX))
    sys.modules.setdefault("init", importlib.import_module("_init"))
    spec = importlib.util.spec_from_file_location("polar_trialinit_under_test", SANDBOX / "_trialinit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    while str(SANDBOX) in sys.path:  # the module adds its own dir too: its docker.py must shadow nothing
        sys.path.remove(str(SANDBOX))
    yield mod


def test_the_sweep_takes_the_phase_and_its_detached_tools(trialinit, tmp_path):
    pids = tmp_path / "pids"
    # a "harness" leading its session; a "tool" it starts with setsid (a session of its own, still its
    # child); a "server" that daemonizes (double fork: reparented away from the harness)
    script = f"""
setsid sleep 300 & echo tool $! >> {pids}
( setsid sleep 301 & echo server $! >> {pids} ) &
wait
"""
    leader = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while (not pids.exists() or len(pids.read_text().splitlines()) < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        named = dict(line.split() for line in pids.read_text().splitlines())
        time.sleep(0.3)  # the server's intermediate shell has exited: reparented
        got = trialinit._phase_processes(leader.pid)
        assert leader.pid in got and int(named["tool"]) in got, (got, named)
        assert int(named["server"]) not in got, (got, named)
    finally:
        for p in [leader.pid, *(int(v) for v in named.values())] if pids.exists() else [leader.pid]:
            try:
                os.kill(p, 9)
            except OSError:
                pass
        leader.wait(timeout=10)
