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
opens its own file description) shares the slots safely. A lease is taken in ~5 us when the
first slots are free.

The range's maps are written by the host (:class:`MapWriter`), not by the sandbox's init: writing
uid 0 into another uid's user namespace takes CAP_SETUID/SETGID, CAP_SETFCAP and CAP_SYS_ADMIN
over it, and the init then held CAP_SYS_ADMIN in the host's user namespace; now it keeps only
CAP_SETUID/SETGID, to become unprivileged.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import struct
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


class MapWriter:
    """The host's half of a sandbox's uid/gid maps. ``child_fd`` goes to the init (one end of a
    Unix socket pair); the init's child, once it is the range's base uid in a user namespace of
    its own, writes one byte there, and a thread here learns its pid and uid from the kernel
    (SCM_CREDENTIALS, translated to the host's PID namespace: nothing the sandbox says is taken
    on trust), writes ``0 <base> <UID_COUNT>`` into that process's uid_map and gid_map when it
    is that uid in a user namespace other than the host's, and answers ``m``. ``close()`` after
    the sandbox ends."""

    def __init__(self, uids: UidRange):
        self.uids = uids
        self._host, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._host.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.child_fd = child.detach()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._serve, name="uid-map", daemon=True)
        self._thread.start()

    def started(self) -> None:
        """The sandbox holds its copy: drop ours, so its end means EOF here."""
        if self.child_fd >= 0:
            os.close(self.child_fd)
            self.child_fd = -1

    def _serve(self) -> None:
        try:
            size = struct.calcsize("iII")
            data, anc, _, _ = self._host.recvmsg(1, socket.CMSG_SPACE(size))
            if data != b"u":
                return
            creds = [d for lvl, typ, d in anc if lvl == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS]
            pid, uid, _ = struct.unpack("iII", creds[0][:size])
            base = self.uids.base
            if uid != base:
                raise OSError(errno.EPERM, f"the map request came from uid {uid}, not the range's {base}")
            if os.readlink(f"/proc/{pid}/ns/user") == os.readlink("/proc/self/ns/user"):
                raise OSError(errno.EPERM, f"pid {pid} has no user namespace of its own")
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as fh:
                    fh.write(f"0 {base} {UID_COUNT}\n")
            self._host.sendall(b"m")
        except (OSError, IndexError, struct.error) as exc:
            self.error = str(exc)
        finally:
            self._host.close()  # the child's read sees EOF when nothing was mapped

    def close(self) -> None:
        self.started()
        try:
            self._host.shutdown(socket.SHUT_RDWR)  # a sandbox that never asked: the thread ends
        except OSError:
            pass
        self._thread.join(5)
