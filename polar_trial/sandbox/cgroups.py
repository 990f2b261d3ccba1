"""Per-phase cgroups, where this process may create them: the kernel's own process, memory and CPU
limits for a sandbox (bubblewrap has none of its own).

Why cgroups and not rlimits: RLIMIT_NPROC does not bind uid 0 in the initial user namespace
(the kernel exempts INIT_USER from it), and counts all of a user's processes otherwise; RLIMIT_AS
breaks Node (V8 reserves tens of GiB of address space up front). A pids cgroup bounds a fork bomb
whatever the uid, and a memory cgroup bounds resident memory. Both cgroup v1 (one hierarchy per
controller, this machine) and v2 (unified) are handled; where the directory cannot be created
(no delegation), the limit is reported as not enforced, never silently dropped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000


def _own_paths() -> dict[str, str]:
    """controller -> this process's cgroup path ("" key: the v2 unified one)."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    return out


def _mounts() -> dict[str, Path]:
    """controller -> v1 mount point, and "" -> the v2 mount point, from /proc/self/mountinfo."""
    out: dict[str, Path] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            pre, _, post = line.partition(" - ")
            fstype, _, opts = (post.split() + ["", "", ""])[:3]
            mnt = Path(pre.split()[4])
            if fstype == "cgroup2":
                out.setdefault("", mnt)
            elif fstype == "cgroup":
                for o in opts.split(","):
                    if o in ("pids", "memory", "cpu"):
                        out.setdefault(o, mnt)
    return out


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


class Cgroup:
    """One phase's cgroup(s): a directory per controller (v1) or one directory (v2)."""

    def __init__(self, dirs: dict[str, Path], v2: bool):
        self.dirs = dirs  # controller -> directory
        self.v2 = v2

    @classmethod
    def create(cls, *, pids: int | None, memory_mb: int | None, cpus: float | None,
               notes: list[str]) -> "Cgroup | None":
        """A fresh cgroup with the limits asked for, or None; ``notes`` get a sentence per limit
        (enforced, or not and why)."""
        wanted = {"pids": pids, "memory": memory_mb, "cpu": cpus}
        wanted = {k: v for k, v in wanted.items() if v is not None}
        if not wanted:
            return None
        own, mounts = _own_paths(), _mounts()
        name = f"polar-sandbox-{uuid.uuid4().hex[:12]}"
        dirs: dict[str, Path] = {}
        v2 = "" in mounts and not any(c in mounts for c in wanted)
        for ctrl in wanted:
            if v2:
                d = mounts[""] / own.get("", "/").lstrip("/") / name
            elif ctrl in mounts:
                d = mounts[ctrl] / own.get(ctrl, "/").lstrip("/") / name
            else:
                notes.append(f"{ctrl} limit not enforced: no {ctrl} cgroup controller mounted")
                continue
            try:
                d.mkdir(exist_ok=True)
            except OSError as e:
                notes.append(f"{ctrl} limit not enforced: cannot create a cgroup ({e.strerror}; no delegation)")
                continue
            dirs[ctrl] = d
        cg = cls(dirs, v2)
        for ctrl, d in list(dirs.items()):
            ok = cg._limit(ctrl, d, wanted[ctrl])
            if ok:
                notes.append(ok)
            else:
                notes.append(f"{ctrl} limit not enforced: the cgroup would not take it")
                dirs.pop(ctrl)
        if not dirs:
            cg.remove()
            return None
        return cg

    def _limit(self, ctrl: str, d: Path, value: float) -> str | None:
        if ctrl == "pids":
            return f"pids limit enforced: at most {int(value)} processes (cgroup)" if _write(d / "pids.max", str(int(value))) else None
        if ctrl == "memory":
            b = int(value) * 1024 * 1024
            if self.v2:
                ok = _write(d / "memory.max", str(b))
                _write(d / "memory.swap.max", "0")
            else:
                ok = _write(d / "memory.limit_in_bytes", str(b))
                _write(d / "memory.memsw.limit_in_bytes", str(b))  # absent without swap accounting
            return f"memory limit enforced: {int(value)} MiB (cgroup; the OOM killer ends the phase's largest process)" if ok else None
        if ctrl == "cpu":
            quota = max(1000, int(value * CPU_PERIOD_US))
            if self.v2:
                ok = _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                ok = _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US)) and _write(d / "cpu.cfs_quota_us", str(quota))
            return f"cpu limit enforced: {value:g} CPUs (cgroup quota)" if ok else None
        return None

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes its pid to in order to join (all of them)."""
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def _any_dir(self) -> Path:
        return next(iter(self.dirs.values()))

    def pids(self) -> list[int]:
        with contextlib.suppress(OSError):
            return [int(x) for x in (self._any_dir() / "cgroup.procs").read_text().split()]
        return []

    def events(self) -> list[str]:
        """What the limits did this run (the pids cap refused forks, the OOM killer ran)."""
        out = []
        d = self.dirs.get("pids")
        if d is not None:
            with contextlib.suppress(OSError):
                for line in (d / "pids.events").read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == "max" and int(v) > 0:
                        out.append(f"pids limit hit: {v} forks refused")
        d = self.dirs.get("memory")
        if d is not None:
            kills = 0
            with contextlib.suppress(OSError, ValueError):
                f = d / ("memory.events" if self.v2 else "memory.oom_control")
                for line in f.read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == "oom_kill":
                        kills = int(v)
            if kills:
                out.append(f"memory limit hit: the OOM killer ended {kills} process(es)")
        return out

    def kill_all(self) -> int:
        """SIGKILL every process left in the cgroup (until none is left). Returns how many."""
        seen: set[int] = set()
        for _ in range(50):
            left = self.pids()
            if not left:
                break
            for pid in left:
                seen.add(pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        return len(seen)

    def remove(self) -> None:
        for d in self.dirs.values():
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
