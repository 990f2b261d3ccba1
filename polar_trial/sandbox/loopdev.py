"""Loop devices for the disk images (``diskimage.py``): who owns an image, a janitor that frees the
images of runs whose process is gone, and a queue when every device is held.

Why: the kernel here has 8 loop devices (``max_loop=8``) and a ``polar`` killed mid-phase (kill -9,
an OOM kill, a test that kills a loop) runs no clean-up, so its image stays mounted and its device
held; after one clean-clone ``bash scripts/test.sh`` 7 of the 8 were held that way, and the next
runs lost their disk cap. So each image's dir (``/tmp/polar-disk-*``) records its owner (pid and
the process's start time from ``/proc/<pid>/stat``, so a reused pid is not taken for the owner),
and the first image a process makes (or :func:`janitor` called directly) frees the dirs of dead
owners: lazy unmount, detach of the image's devices (found in ``/sys/block/loop*/loop/backing_file``),
removal.

When every device is held by live runs, :func:`wait_for_device` polls with backoff (the devices are
the kernel's, so the queue spans processes) and raises :class:`LoopDeviceTimeout`, naming who holds
the devices, only after ``POLAR_LOOP_WAIT_S`` (default 600 s).

Why not one shared file system with a quota per sample (one device for every sandbox): measured,
this machine kind's kernel has no quota support at all: an XFS image mounted ``prjquota`` fails
("quota support not available in this kernel"), an ext4 one too ("not built with CONFIG_QUOTA").
So each phase keeps an image of its own, and the devices are shared by the queue.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

PREFIX = "polar-disk-"
OWNER_FILE = "owner"
#: an image dir without an owner file (made before owners were recorded) is reaped only when older
LEGACY_AGE_S = 12 * 3600


class LoopDeviceTimeout(OSError):
    """No loop device became free within the wait: the disk cap cannot be enforced."""


class NoFreeLoop(OSError):
    """``mount -o loop`` found no free device (another process took the last one)."""


def proc_start(pid: int) -> str | None:
    """The start time of ``pid`` (clock ticks since boot, field 22 of /proc/<pid>/stat), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[19]


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"


def write_owner(d: Path) -> None:
    """Record this process as the owner of the image dir ``d`` (before anything is mounted): its
    pid, start time and PID namespace (a pid means nothing in another namespace sharing /tmp)."""
    (d / OWNER_FILE).write_text(f"{os.getpid()} {proc_start(os.getpid())} {_pid_ns()}\n")


def owner_alive(d: Path) -> bool | None:
    """Whether the process that made ``d`` still runs; None when ``d`` records no owner, or one of
    another PID namespace (its liveness cannot be told from here)."""
    try:
        pid_s, start, *ns = (d / OWNER_FILE).read_text(errors="replace")[:200].split()
        pid = int(pid_s)
    except (OSError, ValueError):
        return None
    if ns and ns[0] != _pid_ns():
        return None
    return proc_start(pid) == start


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point in this process's mount namespace."""
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as fh:
        return any(_unescape(line.split()[4]) == target for line in fh)


def backing_files() -> dict[str, str]:
    """Bound loop devices: ``/dev/loopN`` -> its backing file (`` (deleted)`` stripped)."""
    out = {}
    for f in glob.glob("/sys/block/loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            dev = "/dev/" + f.split("/")[3]
            out[dev] = Path(f).read_text().rstrip("\n").removesuffix(" (deleted)")
    return out


def devices_of(image: Path) -> list[str]:
    """The loop devices backed by ``image``."""
    image_s = os.path.abspath(image)
    return sorted(dev for dev, f in backing_files().items() if f == image_s)


def _quiet(argv: list[str]) -> None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)


def reap(d: Path) -> None:
    """Free an image dir whose owner is gone: lazy unmount, detach its devices, remove it."""
    mnt, image = d / "mnt", d / "disk.img"
    with contextlib.suppress(OSError):
        if mounted(mnt):
            _quiet(["umount", "-l", str(mnt)])
    for dev in devices_of(image):
        _quiet(["losetup", "-d", dev])  # a device still referenced elsewhere is marked autoclear
    shutil.rmtree(d, ignore_errors=True)


def janitor(tmp: str | None = None) -> list[str]:
    """Free the image dirs under ``tmp`` (the temp dir) whose owner process is gone, and detach
    devices still bound to an image whose dir is gone; returns what was freed."""
    tmp = tmp or tempfile.gettempdir()
    freed = []
    for name in sorted(os.listdir(tmp)):
        if not name.startswith(PREFIX):
            continue
        d = Path(tmp) / name
        alive = owner_alive(d)
        if alive is None:
            with contextlib.suppress(OSError):
                alive = time.time() - d.stat().st_mtime < LEGACY_AGE_S
        if alive is False:
            reap(d)
            freed.append(str(d))
    for dev, f in backing_files().items():
        p = Path(f)
        if p.parent.name.startswith(PREFIX) and str(p.parent.parent) == os.path.abspath(tmp) \
                and not p.parent.exists():
            _quiet(["losetup", "-d", dev])
            freed.append(dev)
    return freed


_ran: set[str] = set()
_ran_lock = threading.Lock()


def janitor_once(tmp: str | None = None) -> list[str]:
    """:func:`janitor`, the first time a process asks (the first disk image it makes)."""
    tmp = tmp or tempfile.gettempdir()
    with _ran_lock:
        if tmp in _ran:
            return []
        _ran.add(tmp)
    return janitor(tmp)


def max_devices() -> int | None:
    """The kernel's limit on loop devices (``max_loop``), or None when it adds them on demand."""
    try:
        n = int(Path("/sys/module/loop/parameters/max_loop").read_text())
    except (OSError, ValueError):
        return None
    return n or None


def free_devices() -> int:
    """How many more loop devices can be bound now (a large number when the kernel adds them)."""
    limit = max_devices()
    if limit is None:
        return 1 << 20
    return max(0, limit - len(backing_files()))


#: how often a waiting run looks again for the devices of dead runs
RECLAIM_EVERY_S = 5.0


def wait_timeout_s() -> float:
    with contextlib.suppress(ValueError):
        return float(os.environ.get("POLAR_LOOP_WAIT_S", "600"))
    return 600.0


def wait_for_device(attach: Callable[[], None], *, probe: Callable[[], int] = free_devices,
                    timeout_s: float | None = None, sleep: Callable[[float], None] = time.sleep,
                    reclaim: Callable[[], object] | None = None) -> float:
    """Run ``attach`` (which binds a device, raising :class:`NoFreeLoop` when it lost the race)
    once ``probe`` says a device is free, polling with backoff (0.05 s doubling to 2 s, jittered);
    returns the seconds waited. While none is free, ``reclaim`` (the janitor: a run killed since
    this process started holds one) runs at most every :data:`RECLAIM_EVERY_S`. Raises
    :class:`LoopDeviceTimeout` after ``timeout_s``."""
    timeout_s = wait_timeout_s() if timeout_s is None else timeout_s
    t0 = time.monotonic()
    delay, reclaimed = 0.05, None
    while True:
        if probe() > 0:
            try:
                attach()
                return time.monotonic() - t0
            except NoFreeLoop:
                pass
        waited = time.monotonic() - t0
        if reclaim is not None and (reclaimed is None or waited - reclaimed >= RECLAIM_EVERY_S):
            reclaimed = waited
            reclaim()
            if probe() > 0:
                continue
        if waited >= timeout_s:
            held = backing_files()
            shown = ", ".join(f"{dev}: {f}" for dev, f in sorted(held.items())[:8])
            raise LoopDeviceTimeout(
                f"no free loop device after {waited:.0f} s (POLAR_LOOP_WAIT_S): {len(held)} held "
                f"(max_loop={max_devices()}): {shown}; the disk cap cannot be enforced")
        sleep(min(delay, max(0.0, timeout_s - waited)) * (1 + 0.5 * random.random()))
        delay = min(delay * 2, 2.0)
