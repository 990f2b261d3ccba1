"""The escape attempts as Harbor tasks whose reference solution is the attack, run by the ``oracle``
preset through the rollout runner (the path every sample takes): one rollout, every sample returns a
row, the host is unchanged, and each row's ``sandbox_notes`` say what was contained. No model.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from polar_runtime import rollout as r
from polar_runtime.harnesses import Endpoint, get_preset
from polar_trial.sandbox import available
from polar_trial.tasks import load_tasks

pytestmark = pytest.mark.skipif(available().get("bubblewrap") is not None,
                                reason=f"bubblewrap unavailable: {available().get('bubblewrap')}")

REPO = Path(__file__).resolve().parents[3]
HOST_HOME = Path(os.path.expanduser("~"))
HOST_PID_NS = os.readlink("/proc/self/ns/pid")
#: POLAR_SANDBOX_UNDER_TEST=host runs the same attacks with no sandbox (they then fail); the fork
#: bomb and kill -9 -1 check for a PID namespace of their own first and do nothing without one
BACKEND = os.environ.get("POLAR_SANDBOX_UNDER_TEST", "bubblewrap")
REWARD = "echo 1 > /logs/verifier/reward.txt\n"


def harbor_task(root: Path, name: str, solve: str, toml: str = "") -> None:
    d = root / name
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text('version = "1.0"\n' + textwrap.dedent(toml))
    (d / "instruction.md").write_text(f"{name}\n")
    (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
    (d / "tests" / "test.sh").write_text("#!/usr/bin/env bash\n" + REWARD)
    (d / "solution" / "solve.sh").write_text("#!/usr/bin/env bash\n" + textwrap.dedent(solve))


def test_escape_attempts_through_the_oracle(tmp_path):
    tag = uuid.uuid4().hex[:8]
    key_dir = HOST_HOME / f".polar-sandbox-oracle-{tag}"
    home_mark, tmp_mark = HOST_HOME / f".polar-sandbox-oracle-w-{tag}", Path(f"/tmp/polar-sandbox-oracle-{tag}")
    other = tmp_path / "other-sample"
    other.mkdir()
    (other / "answer.txt").write_text("OTHER-SAMPLE-SECRET\n")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    service = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []
    threading.Thread(target=lambda: accepted.append(service.accept()[0].fileno()), daemon=True).start()
    ds = tmp_path / "ds"
    harbor_task(ds, "steal", f"""
        cat {key_dir}/id_rsa {HOST_HOME}/.ssh/id_rsa {other}/answer.txt {REPO}/pyproject.toml > stolen.txt 2>&1
        true
    """)
    harbor_task(ds, "write-out", f"""
        echo x > {home_mark}; echo x > {tmp_mark}; echo x > {REPO}/escaped-{tag}; echo x > ../escaped; true
    """)
    harbor_task(ds, "net-and-kill", f"""
        kill -9 {victim.pid}
        /usr/bin/python3 -c "import socket; socket.create_connection(('127.0.0.1', {service.getsockname()[1]}), timeout=2)" \\
            2> connect.txt
        [ "$(readlink /proc/self/ns/pid)" != "{HOST_PID_NS}" ] && kill -9 -1
        true
    """)
    harbor_task(ds, "late-writer", """
        setsid sh -c 'sleep 1.5; echo late > late.txt' > /dev/null 2>&1 < /dev/null &
        sleep 0.3
    """)
    harbor_task(ds, "fork-bomb", f"""
        [ "$(readlink /proc/self/ns/pid)" = "{HOST_PID_NS}" ] && exit 99
        b() {{ b | b & }}; b
        sleep 30
    """, toml="[agent]\ntimeout_sec = 4\n")
    harbor_task(ds, "fill-disk", f"""
        head -c 100M /dev/zero > {tmp_mark}.big; rm -f {tmp_mark}.big; head -c 100M /dev/zero > big
        i=0; while [ $i -lt 300 ]; do head -c 1M /dev/zero > f$i || break; i=$((i+1)); done
    """, toml="[environment]\nstorage_mb = 32\n")
    key_dir.mkdir()
    (key_dir / "id_rsa").write_text("HOSTKEY-SECRET\n")
    try:
        t0 = time.monotonic()
        cfg = r.RolloutConfig(tasks=load_tasks(ds),
                              preset=get_preset("oracle"), capture_dir=tmp_path / "cap",
                              endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"), model="m",
                              settle_s=0.0, timeout=20.0, samples=1, concurrency=2, pids=128, sandbox=BACKEND,
                              work_root=tmp_path / "work")
        rows = {row["task_id"]: row for row in r.run_rollout(cfg).to_dicts()}
        wall = time.monotonic() - t0
        time.sleep(1.5)  # the late writer's moment
        alive = victim.poll() is None
        escaped = {p: p.exists() for p in (home_mark, tmp_mark, REPO / f"escaped-{tag}")}
    finally:
        victim.kill()
        victim.wait()
        service.close()
        for p in (key_dir / "id_rsa", home_mark, tmp_mark, Path(f"{tmp_mark}.big"), REPO / f"escaped-{tag}"):
            p.unlink(missing_ok=True)
        key_dir.rmdir()
    assert set(rows) == {"steal", "write-out", "net-and-kill", "late-writer", "fork-bomb", "fill-disk"}
    assert wall < 45, f"the rollout must go on ({wall:.0f} s)"
    notes = {k: row["sandbox_notes"] or "" for k, row in rows.items()}
    work = {k: Path(row["workdir"]) for k, row in rows.items()}
    stolen = (work["steal"] / "stolen.txt").read_text()
    used = sum(p.stat().st_size for p in work["fill-disk"].iterdir())
    breaches = [what for what, bad in [
        ("read the planted key in the host's HOME", "HOSTKEY-SECRET" in stolen),
        ("read another sample's work dir", "OTHER-SAMPLE-SECRET" in stolen),
        ("read the repository", "[project]" in stolen),
        ("wrote into the host's HOME", escaped[home_mark]),
        ("wrote into the host's /tmp", escaped[tmp_mark]),
        ("wrote into the repository", escaped[REPO / f"escaped-{tag}"]),
        ("killed a host process", not alive),
        ("reached a host loopback service", bool(accepted)),
        ("a process outlived the oracle phase", (work["late-writer"] / "late.txt").exists()),
        ("no note of the leftover process", "leftover" not in notes["late-writer"]),
        ("no pids cap on the fork bomb", "pids limit hit" not in notes["fork-bomb"]),
        # hard (a disk image of 32 MiB for the work dir and HOME): no poll gap to overshoot in,
        # whatever the load (the watchdog it replaced let 141 MiB through in a loaded CI run)
        (f"the work dir reached {used / 2**20:.1f} MiB with storage_mb = 32", used > 33 * 1024 * 1024),
        ("no note of the disk cap", "disk limit hit" not in notes["fill-disk"]),
        ("not run in bubblewrap", any(row["sandbox"] != "bubblewrap" for row in rows.values())),
    ] if bad]
    assert not breaches, "; ".join(breaches)
