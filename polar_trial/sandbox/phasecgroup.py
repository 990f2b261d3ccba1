"""A phase's own pids limit inside a live trial's one container: a sub-cgroup made from the host.

The container's ``--pids-limit`` is the trial's, shared by every phase and by what a phase leaves
running, so an agent's fork bomb left behind could hold every pid the verifier needs. Inside the
container the cgroup files are read-only, so the host makes ``<container's cgroup>/polar-<phase>-<id>``
with the phase's ``pids.max``, hands its ``cgroup.procs`` to the container's (remapped) root, and
binds the dir into the trial's dir; the phase's init writes itself into it before it starts the
phase, so the phase and everything it leaves are counted there, under the trial's limit too.

Built for cgroup v1 (this machine: the private dockerd's containers under
``/sys/fs/cgroup/pids/docker/<id>/``). On cgroup v2 a cgroup with children may hold no process of
its own, and ``docker exec`` puts each new process in the container's top cgroup: there the
phase runs without a limit of its own, said in its notes (``container_cgroup`` answers None).
Memory would be the same move with ``memory.limit_in_bytes``; not built.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


#: pids a live trial's container gets beyond the agent's own limit (``polar_trial/phases.py``): the
#: verifier's, which no leftover of the agent can take (a TB2 verifier with uv and pytest: < 20)
VERIFIER_PIDS = 256


def available() -> bool:
    """Whether this host has a cgroup v1 pids hierarchy (where a phase's own limit can be made)."""
    try:
        return _mount_of("pids") is not None
    except OSError:
        return False


def _mount_of(controller: str) -> Path | None:
    """Where this host mounts the cgroup v1 hierarchy of ``controller``."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        t = tail.split()
        if len(t) >= 3 and t[0] == "cgroup" and controller in t[2].split(","):
            return Path(head.split()[4])
    return None


def container_cgroup(runtime: str, name: str, controller: str = "pids") -> Path | None:
    """The host's dir of container ``name``'s ``controller`` cgroup (v1), or None."""
    r = subprocess.run([runtime, "inspect", "--format", "{{.State.Pid}}", name], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    pid = int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else 0
    if pid <= 0:
        return None
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            root = _mount_of(controller)
            d = root / path.lstrip("/") if root is not None else None
            return d if d is not None and d.is_dir() else None
    return None


def make(base: Path, name: str, pids: int, owner: int | None) -> Path:
    """``base/name`` with ``pids.max`` = ``pids``; its ``cgroup.procs`` writable by ``owner`` (the
    container's root on the host), so the phase's init can move itself in."""
    sub = base / name
    sub.mkdir()
    (sub / "pids.max").write_text(str(int(pids)))
    if owner is not None:
        os.chown(sub / "cgroup.procs", owner, owner)
    return sub


def remove(sub: Path) -> None:
    """Remove ``sub`` once its processes are gone (the container removed); never raises."""
    for _ in range(20):
        try:
            sub.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
