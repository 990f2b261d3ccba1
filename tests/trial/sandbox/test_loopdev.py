"""Loop devices of the disk images (``sandbox/loopdev.py``): a run killed mid-phase leaves its image
mounted and its device held (7 of the kernel's 8 after one test run), so a janitor frees the
images of dead owners; a run that finds every device held waits for one and refuses loudly after
a timeout. The queue tests inject a fake "free devices" probe: the machine's 8 devices are shared
with other runs and must not be exhausted by a test. ~3 s (two real images, 16 MiB each).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from polar_trial.sandbox import loopdev

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root (CI runs as root)")


def _devices_under(root: Path) -> list[str]:
    return [dev for dev, f in loopdev.backing_files().items() if f.startswith(str(root) + "/")]


def _wait_detached(root: Path, timeout_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (held := _devices_under(root)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """Images under a dir of this test's (the janitor only looks there): others' runs untouched."""
    d = Path(tempfile.mkdtemp(prefix="ld-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    yield d
    loopdev.janitor(str(d))
    with open("/proc/self/mountinfo") as fh:  # whatever a failing test left mounted there
        for target in [line.split()[4] for line in fh if line.split()[4].startswith(str(d) + "/")]:
            subprocess.run(["umount", "-l", target], check=False)
    for dev in _devices_under(d):
        subprocess.run(["losetup", "-d", dev], check=False)
    subprocess.run(["rm", "-rf", str(d)], check=False)


KILLED = """
import sys, tempfile, time
tempfile.tempdir = sys.argv[1]
from polar_trial.sandbox.diskimage import DiskImage
img = DiskImage(16, 0)
print(img.dir, flush=True)
time.sleep(120)
"""


def test_the_janitor_frees_the_image_of_a_killed_run(tmp):
    """kill -9 of a process holding an image: its mount and loop device stay (nothing of its
    clean-up ran); the janitor, as the next run's first image calls it, frees both. ~1.5 s."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp)], stdout=subprocess.PIPE, text=True)
    try:
        d = Path(proc.stdout.readline().strip())  # type: ignore[union-attr]
        assert d.parent == tmp, d
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert loopdev.mounted(d / "mnt") and loopdev.devices_of(d / "disk.img"), "the killed run's image is not held"
    assert loopdev.owner_alive(d) is False
    freed = loopdev.janitor(str(tmp))
    assert str(d) in freed
    assert not d.exists() and not loopdev.mounted(d / "mnt")
    assert _wait_detached(tmp) == [], "the killed run's loop device is still bound"


def test_a_live_owner_and_a_recycled_pid_are_told_apart(tmp):
    d = tmp / f"{loopdev.PREFIX}x"
    d.mkdir()
    assert loopdev.owner_alive(d) is None
    loopdev.write_owner(d)
    assert loopdev.owner_alive(d) is True
    (d / loopdev.OWNER_FILE).write_text(f"{os.getpid()} 1\n")  # this pid, another process's start time
    assert loopdev.owner_alive(d) is False
    (d / loopdev.OWNER_FILE).write_text(f"{os.getpid()} 1 pid:[1]\n")  # another PID namespace's: unknown
    assert loopdev.owner_alive(d) is None
    (d / loopdev.OWNER_FILE).write_text(f"{os.getpid()} 1\n")
    assert loopdev.janitor(str(tmp)) == [str(d)] and not d.exists()
    legacy = tmp / f"{loopdev.PREFIX}old"  # no owner file: kept while young (another version's live run)
    legacy.mkdir()
    assert loopdev.janitor(str(tmp)) == [] and legacy.exists()


def test_a_finished_run_leaves_no_loop_device_bound(tmp):
    """The normal path: release() unmounts, and the device goes with the last reference. ~0.5 s."""
    from polar_trial.sandbox.diskimage import DiskImage

    img = DiskImage(16, 0)
    assert loopdev.devices_of(img.image)
    img.release()
    assert not img.dir.exists()
    assert _wait_detached(tmp) == []


def test_the_queue_waits_for_a_free_device_then_attaches():
    free = iter([0, 0, 0, 1, 1])
    slept, attached = [], []

    def attach():
        if not attached:
            attached.append("lost")  # another process took the device between probe and mount
            raise loopdev.NoFreeLoop("failed to setup loop device")
        attached.append("ok")

    loopdev.wait_for_device(attach, probe=lambda: next(free), timeout_s=60, sleep=slept.append)
    assert attached == ["lost", "ok"] and len(slept) == 4
    assert slept[0] < slept[2] and max(slept) <= 3.0  # backoff


def test_a_waiting_run_reclaims_the_devices_of_runs_killed_since_it_started():
    """The janitor runs once per process at its first image; a long run that finds every device
    held looks again for dead owners while it waits."""
    state = {"reclaimed": 0}
    loopdev.wait_for_device(lambda: None, probe=lambda: 1 if state["reclaimed"] else 0, timeout_s=60,
                            sleep=lambda s: None, reclaim=lambda: state.update(reclaimed=state["reclaimed"] + 1))
    assert state["reclaimed"] == 1


def test_no_free_device_refuses_loudly_after_the_timeout(tmp, monkeypatch):
    """Every device held for the whole wait: an error naming the cause, and no image left behind
    (it never falls back silently). ~0.4 s."""
    from polar_trial.sandbox.diskimage import DiskImage

    with pytest.raises(loopdev.LoopDeviceTimeout, match="no free loop device after"):
        loopdev.wait_for_device(lambda: None, probe=lambda: 0, timeout_s=0.2)
    monkeypatch.setenv("POLAR_LOOP_WAIT_S", "0.2")
    with pytest.raises(loopdev.LoopDeviceTimeout, match="disk cap cannot be enforced"):
        DiskImage(16, 0, probe=lambda: 0)
    assert not any(p.name.startswith(loopdev.PREFIX) for p in tmp.iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="the disk image (and so the wait) is a root caller's")
@pytest.mark.parametrize("backend", ["bubblewrap", "docker"])
def test_a_sandbox_with_no_loop_device_refuses_the_phase_instead_of_the_watchdog(tmp_path, monkeypatch, backend):
    """The backends turn the wait's timeout into a refusal of the phase (SandboxError naming the
    cause), never the silent watchdog fallback they use for other image failures. ~0.3 s each."""
    import polar_trial.sandbox.diskimage as diskimage
    from polar_trial.sandbox import SandboxError, SandboxSpec, backend_class

    def no_device(self, *a, **kw):
        raise loopdev.LoopDeviceTimeout("no free loop device after 0.2 s: the disk cap cannot be enforced")

    monkeypatch.setattr(diskimage.DiskImage, "__init__", no_device)
    sb = backend_class(backend)()
    if backend == "docker":
        monkeypatch.setattr(sb, "image_ready", lambda image: None)
    spec = SandboxSpec(workdir_host=tmp_path / "w", disk_mb=16, timeout_s=10, image="polar-test/none:1")
    with pytest.raises(SandboxError, match="no free loop device"):
        sb.run(spec, ["true"])
