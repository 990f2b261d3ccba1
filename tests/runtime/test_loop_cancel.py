"""Per-group cancel of the local placement (``LocalPlacement.cancel_group``, ``polar_core/cancel.py``):
a dropped straggler group of the asynchronous loop is stopped at once, nothing else is disturbed.

Real parts: ``LocalPlacement.rollout_group`` (the loop's worker path), the rollout runner's
``run_sample``, the generic harness preset as a real process tree (``bash`` starting ``sleep``: a
child that outlives a killed leader unless its process group is killed), the ``host`` sandbox
backend's ``supervise``. Stand-ins: the proxy's control client (it records what it is told) and the
settings a ``start`` would have made (no vLLM: the harness calls no model).

Two groups run at once, two samples each: "slow" (each sample sleeps 300 s; the timeout is 600 s)
and "fast" (each sample sleeps ~1.5 s, then writes a marker). "slow" is cancelled while "fast" is
running. It FAILS without the cancel (checked by hand: ``cancel_group`` made a no-op, the slow
group's sleeps live on and the test stops at its 20 s wait for them to die).
Time on the 2-core dev box (shared): ~3 s.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from polar_runtime import rollout as r
from polar_runtime.harnesses import Endpoint, get_preset
from polar_runtime.loop import config as c
from polar_runtime.loop.placement import LocalPlacement

# each sample writes its pid file, starts a child that holds its process group, and waits for it
HARNESS = ('echo $$ > "$POLAR_PIDS/$POLAR_SESSION.pid"; '
           'if [ "$POLAR_TASK_ID" = slow ]; then sleep 300 & else sleep 1.5 & fi; wait; '
           'touch "$POLAR_PIDS/$POLAR_SESSION.done"')


class Control:
    """The proxy's control client, recording the sessions registered and closed."""

    def __init__(self) -> None:
        self.registered: list[str] = []
        self.forgotten: list[str] = []

    def register_sessions(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        self.registered += [i["session_id"] for i in items]
        return {"keys": {i["session_id"]: "polar-sk-test" for i in items}}

    def forget_session(self, sid: str) -> dict[str, Any]:
        self.forgotten.append(sid)
        return {"forgotten": sid}

    def sessions(self) -> dict[str, Any]:
        return {"sessions": {}}


def _placement(tmp_path: Path) -> tuple[LocalPlacement, Control]:
    cfg = c.parse_config('out = "run"\n[rollout]\nsamples_per_group = 2\n[harness]\nconcurrency = 2\ntimeout_s = 600\n'
                         '[sandbox]\nbackend = "host"\n')
    p = LocalPlacement(cfg, tmp_path / "run", log=lambda _m: None)
    control = Control()
    pids = tmp_path / "pids"
    pids.mkdir()
    preset = get_preset("generic", command=f"export POLAR_PIDS={pids} POLAR_TASK_ID={{task}}; {HARNESS}")
    # what start() sets up, without vLLM and the proxy: the harness calls no model
    p.preset, p.served = preset, "tiny"
    p.tasks = {t: r.Task(t, t, evaluator="true") for t in ("slow", "fast")}
    p.endpoint = Endpoint(mode="base_url", base_url="http://127.0.0.1:9")
    p.proxy = SimpleNamespace(control=control)
    return p, control


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


def _children(pid: int) -> list[int]:
    from polar_core.processes import child_pids

    return child_pids(pid)


def test_a_dropped_group_is_stopped_and_nothing_else_is_disturbed(tmp_path: Path) -> None:
    p, control = _placement(tmp_path)
    pids = tmp_path / "pids"
    results: dict[str, list[dict[str, Any]]] = {}

    def group(task: str) -> None:
        results[task] = p.rollout_group(3, task, 0)

    threads = {t: threading.Thread(target=group, args=(t,)) for t in ("slow", "fast")}
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + 20
    while len(list(pids.glob("slow.*.pid"))) < 2 or len(list(pids.glob("fast.*.pid"))) < 2:
        assert time.monotonic() < deadline, "the samples never started"
        time.sleep(0.05)
    slow = [int(f.read_text()) for f in pids.glob("slow.*.pid")]
    sleeps = [k for pid in slow for k in _children(pid)]
    assert len(sleeps) == 2  # each slow sample's sleep, in its process group

    res = p.cancel_group(3, "slow")
    assert res == {"group": "slow.st3", "processes_killed": 2, "sessions_closed": 2}
    deadline = time.monotonic() + 20
    while any(_alive(x) for x in slow + sleeps):
        assert time.monotonic() < deadline, "the cancelled group's processes live on"
        time.sleep(0.05)
    threads["slow"].join(20)
    assert not threads["slow"].is_alive()
    assert results["slow"] == []  # nothing of a dropped group comes back to be trained
    assert sorted(control.forgotten) == ["slow.st3.s0", "slow.st3.s1"]  # only its sessions are closed

    threads["fast"].join(60)
    assert sorted(row["status"] for row in results["fast"]) == ["ok", "ok"]  # the other group finished
    assert sorted(f.name for f in pids.glob("*.done")) == ["fast.st3.s0.done", "fast.st3.s1.done"]
    assert p.cancelled_groups == [res]
    # the store never records the dropped group's samples (a resume would not reuse them)
    assert not any(r.ResultStore(p.captures).done(r.sample_key("slow", 3, i)) for i in range(2))


def test_a_cancel_before_the_group_starts_refuses_its_samples(tmp_path: Path) -> None:
    p, control = _placement(tmp_path)
    res = p.cancel_group(5, "slow")  # the loop may drop a restored group whose thread has not run yet
    assert res["processes_killed"] == 0
    assert p.rollout_group(5, "slow", 0) == [] and control.registered == []
    assert not list((tmp_path / "pids").glob("*.pid"))
