"""A hard disk cap for a phase: its writable binds (work dir, HOME, and the verifier's /tests and
/logs/verifier) staged on one loop-mounted ext4 image of ``disk_mb``, so a write past the cap
fails with ENOSPC the moment it happens, for all of them together.

Why an image and not the watchdog it replaces: the root file system here has no quotas, and a
watchdog that walks the work dir every 0.25 s let a fast writer through by what it writes in that
time (382 MiB against a 100 MiB cap under load, and HOME not counted at all: 451 MiB). The image
costs ~0.1 s per phase (truncate + ``mkfs.ext4`` + ``mount -o loop``: 0.03 + 0.05 s for 1 GiB),
plus copying the binds in and out, which is proportional to what they hold. It needs root and a
loop device; elsewhere the backend falls back to the watchdog and says so in the notes.

The copies never follow a link or open a special file (``hostfs.copy_tree``); the image is
mounted ``nosuid,nodev`` in a 0700 directory of its own, and removed with the phase.

Loop devices are few (8 here): each image's dir records its owner process, the first image a
process makes frees the images of dead owners, and an image waits for a free device rather than
failing (``loopdev.py``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from polar_trial.sandbox import loopdev
from polar_trial.sandbox.hostfs import chown_tree, clear_dir, copy_tree, open_under

MKFS = shutil.which("mkfs.ext4") or "/usr/sbin/mkfs.ext4"


class DiskImage:
    """``with DiskImage(size_mb, uid) as img: binds = img.stage(paths) ... img.unstage()``."""

    def __init__(self, size_mb: int, uid: int, *, probe=loopdev.free_devices):
        """``probe``: how many loop devices are free (tests pass a fake one)."""
        self.size_mb, self.uid = size_mb, uid
        #: seconds this image waited for a loop device
        self.waited_s = 0.0
        loopdev.janitor_once()
        self.dir = Path(tempfile.mkdtemp(prefix=loopdev.PREFIX))  # 0700, root's
        self.image, self.mnt = self.dir / "disk.img", self.dir / "mnt"
        self.staged: list[tuple[Path, Path]] = []
        self.mounted = False
        self.unstaged = False
        self.skipped = 0
        #: host paths of the special files (FIFOs, sockets, devices) the phase left and that were
        #: not copied back
        self.special: list[Path] = []
        try:
            loopdev.write_owner(self.dir)  # before anything is mounted: a kill from here on is reaped
            self.mnt.mkdir()
            with open(self.image, "wb") as fh:
                # ext4's own metadata takes ~3% of the image: add it, so disk_mb is what files get
                fh.truncate((size_mb + max(4, size_mb // 16)) * 1024 * 1024)
            self._run([MKFS, "-q", "-F", "-m", "0", "-O", "^has_journal", "-E",
                       f"lazy_itable_init=1,nodiscard,root_owner={uid}:{uid}", str(self.image)])
            self.waited_s = loopdev.wait_for_device(self._mount, probe=probe, reclaim=loopdev.janitor)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(self.mnt / "lost+found")
        except BaseException:
            self.close()
            raise

    def _mount(self) -> None:
        proc = subprocess.run(["mount", "-o", "loop,nosuid,nodev,noatime", str(self.image), str(self.mnt)],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            err = (proc.stderr or proc.stdout).strip()[:300]
            if "loop device" in err:  # "failed to setup loop device": every device was taken
                raise loopdev.NoFreeLoop(err)
            raise OSError(f"mount failed: {err}")
        self.mounted = True

    @staticmethod
    def _run(argv: list[str]) -> None:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise OSError(f"{Path(argv[0]).name} failed: {(proc.stderr or proc.stdout).strip()[:300]}")

    def stage(self, hosts: list[Path]) -> dict[Path, Path]:
        """Copy each host dir (or file) onto the image; host path -> its place on the image."""
        out: dict[Path, Path] = {}
        for i, host in enumerate(hosts):
            dest = self.mnt / f"b{i}"
            if host.is_dir() and not host.is_symlink():
                copy_tree(host, dest)
            else:  # one file: read without following a link or opening a special file
                dest.mkdir()
                dest = dest / host.name
                fd = open_under(host.parent, host)
                with os.fdopen(fd, "rb") as src, open(dest, "xb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
            self.staged.append((host, dest))
            out[host] = dest
        chown_tree(self.mnt, self.uid)
        return out

    def unstage(self) -> None:
        """Copy what the phase left on the image back to the host paths (nothing runs any more),
        at most what the image holds (hard links stay links, sparse files sparse: a sample cannot
        multiply its cap on the host). Raises OSError when it cannot (the host dir is then partial)."""
        self.unstaged = True
        budget = int(self.used_mb() * 2**20) + 2**20
        for host, dest in self.staged:
            if dest.is_dir() and not dest.is_symlink():
                clear_dir(host)
                special: list[str] = []
                self.skipped += copy_tree(dest, host, budget=budget, special=special)
                self.special += [host / rel for rel in special]
            elif dest.is_file() and not dest.is_symlink():
                with contextlib.suppress(FileNotFoundError):
                    host.unlink()
                copy_tree(dest.parent, host.parent, budget=budget)  # the one file, copied without following

    def used_mb(self) -> float:
        st = os.statvfs(self.mnt)
        return (st.f_blocks - st.f_bfree) * st.f_frsize / 2**20

    def release(self) -> None:
        """After the phase, whatever happened: copy back what was not yet (best effort: a phase that
        failed keeps what it left), then unmount and remove the image."""
        try:
            if not self.unstaged:
                with contextlib.suppress(Exception):
                    self.unstage()
        finally:
            self.close()

    def close(self) -> None:
        if self.mounted:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self._run(["umount", "-l", str(self.mnt)])
            self.mounted = False
        shutil.rmtree(self.dir, ignore_errors=True)
