"""One host uid range per running bubblewrap sandbox of a root caller.

A root caller's phase runs as an unprivileged host uid range (uid 0..65535 inside a user
namespace of its own; ``_init.py``), and the init drops to a uid of its own beside it. The kernel
counts some limits per uid, not per sandbox: inotify instances (``fs.inotify.max_user_instances``,
128 here), user namespaces (``user.max_user_namespaces`` per user), RLIMIT_NPROC. When every
concurrent sample was the same uid, one sample holding its 128 inotify instances made another
sample's ``inotify_init1`` fail with EMFILE. So each running sandbox leases a range of its own.

Slot ``i`` is the range ``[BASE + i * STRIDE, + UID_COUNT)`` with the init's uid just past it. A
slot is held by an ``flock`` on ``LOCK_DIR/<i>`` (a root-owned 0700 dir on /run, a tmpfs): the
kernel drops the lock when the lease is released or its holder dies, so a killed ``polar`` leaves
no stale lease behind, and every ``polar`` process on the machine (and every thread: each lease
opens its own file description) shares the slots safely. A lease is taken in ~10 us when the
first slots are free.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from pathlib import Path

#: slot 0's first uid: a range no account of a normal system uses (POLAR_SANDBOX_UID_BASE)
BASE = int(os.environ.get("POLAR_SANDBOX_UID_BASE", "2000000000"))
#: uids per range (uid 0..65535 inside)
UID_COUNT = 65536
#: a slot's span: its range, then its init's uid, then unused (ranges stay 65536-aligned)
STRIDE = 2 * UID_COUNT
#: how many sandboxes may run at once on this machine (2e9 + 4096 * 131072 < 2**32 - 1)
SLOTS = 4096
LOCK_DIR = Path(os.environ.get("POLAR_SANDBOX_UID_DIR", "/run/polar/uid-slots"))

_dir_checked = threading.Lock()
_dir_ok = False


class UidRangeError(OSError):
    """No uid range could be leased (every slot is held, or the lock dir is unsafe)."""


class UidRange:
    """A leased range: ``base`` .. ``base + UID_COUNT - 1`` for the phase, ``init_uid`` for the
    init. ``release()`` (or leaving a ``with`` block) gives it back."""

    def __init__(self, slot: int, fd: int):
        self.slot, self._fd = slot, fd
        self.base = BASE + slot * STRIDE
        self.init_uid = self.base + UID_COUNT

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only fd of the open file description drops the flock
            self._fd = -1

    def __enter__(self) -> UidRange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"UidRange(slot={self.slot}, base={self.base}, init_uid={self.init_uid})"


def _lock_dir() -> Path:
    """LOCK_DIR, made 0700 and checked: a real directory of this (root) process's uid that no one
    else can write, or a local user could hold every slot's file (or plant links there)."""
    global _dir_ok
    with _dir_checked:
        if not _dir_ok:
            LOCK_DIR.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            try:
                LOCK_DIR.mkdir(mode=0o700)
            except FileExistsError:
                pass
            st = os.lstat(LOCK_DIR)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise UidRangeError(errno.EPERM, f"{LOCK_DIR}: not a directory of uid {os.geteuid()} that only it "
                                                 "can write; no uid range leased")
            _dir_ok = True
    return LOCK_DIR


def lease_uid_range() -> UidRange:
    """The lowest free slot's range, held until ``release()`` or this process's end."""
    d = _lock_dir()
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for slot in range(SLOTS):
            fd = os.open(str(slot), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            return UidRange(slot, fd)
    finally:
        os.close(dfd)
    raise UidRangeError(errno.EAGAIN, f"all {SLOTS} sandbox uid ranges are in use ({d})")
