"""The host's side of a sample's directories: everything the host reads, writes, walks or changes
under a directory a sample could write to goes through here, and never follows a link or opens a
special file the sample planted there.

A sample's processes can replace any path under its work dir, HOME, ``/logs/verifier`` or
``/tests`` with a symlink (to ``/root/.ssh/id_rsa``, to the checkout's venv) or a FIFO. A host
``open(path)`` or ``chmod(path)`` would follow it with the host's privileges. So every path is
walked from a trusted root one component at a time with ``O_NOFOLLOW`` (``openat`` on the
previous directory's fd), and only directories and regular files are accepted: a link anywhere
on the way is refused with :class:`UnsafePath`, naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path under a sample's directory is a link or a special file; the host did not use it."""


def _parts(root: Path, path: Path) -> list[str]:
    rel = Path(os.path.abspath(path)).relative_to(Path(os.path.abspath(root)))
    parts = list(rel.parts)
    if any(p in ("..", "") for p in parts):
        raise UnsafePath(errno.EINVAL, f"{path}: not under {root}")
    return parts


def _open_dir(root: Path, parts: list[str], create: bool = False) -> int:
    """An fd of root/parts... walked without following any link (``create``: mkdir missing ones)."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for p in parts:
            try:
                nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(p, 0o755, dir_fd=fd)
                nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath(exc.errno, f"{root}/{'/'.join(parts)}: {p!r} is a link or not a directory; not followed") from exc
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_under(root: Path, path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """An fd of ``path`` (under ``root``), no link followed on the way or at the end, a regular
    file only. With ``os.O_CREAT`` in ``flags`` missing directories are made."""
    parts = _parts(root, path)
    if not parts:
        raise UnsafePath(errno.EISDIR, f"{path}: is the root itself")
    dfd = _open_dir(root, parts[:-1], create=bool(flags & os.O_CREAT))
    try:
        try:
            fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath(exc.errno, f"{path}: a symbolic link; not followed") from exc
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafePath(errno.EINVAL, f"{path}: not a regular file; not used")
        os.set_blocking(fd, True)
        return fd
    finally:
        os.close(dfd)


def read_bytes(root: Path, path: Path, limit: int = 1 << 20) -> bytes:
    """At most ``limit`` bytes of a regular file under ``root`` (a sample could plant a huge one)."""
    fd = open_under(root, path)
    with os.fdopen(fd, "rb") as fh:
        return fh.read(limit)


def write_bytes(root: Path, path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` under ``root`` with ``data``: a link or special file planted there is removed,
    never written through."""
    parts = _parts(root, path)
    dfd = _open_dir(root, parts[:-1], create=True)
    try:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise UnsafePath(errno.EISDIR, f"{path}: a directory is in the way")
            os.unlink(parts[-1], dir_fd=dfd)
        fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                     dir_fd=dfd)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    finally:
        os.close(dfd)


def copy_out(root: Path, path: Path, dest: Path, limit: int = 64 << 20) -> None:
    """Copy a regular file under ``root`` to a host path of Polar's own (at most ``limit`` bytes)."""
    fd = open_under(root, path)
    with os.fdopen(fd, "rb") as src, open(dest, "wb") as out:
        shutil.copyfileobj(_Limited(src, limit), out)


class _Limited:
    def __init__(self, fh, left: int):
        self.fh, self.left = fh, left

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        data = self.fh.read(self.left if n < 0 else min(n, self.left))
        self.left -= len(data)
        return data


def chown_tree(root: Path, uid: int, gid: int | None = None) -> int:
    """``lchown`` everything under ``root`` (and root) to uid:gid without following any link;
    returns how many entries changed. Walks with dir fds, so a directory swapped for a link while
    walking is not entered."""
    gid = uid if gid is None else gid
    changed = 0

    def visit(dfd: int) -> None:
        nonlocal changed
        with os.scandir(dfd) as it:
            entries = list(it)
        for e in entries:
            try:
                st = os.stat(e.name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if st.st_uid != uid or st.st_gid != gid:
                os.chown(e.name, uid, gid, dir_fd=dfd, follow_symlinks=False)
                changed += 1
            if stat.S_ISDIR(st.st_mode):
                try:
                    sub = os.open(e.name, _DIR_FLAGS, dir_fd=dfd)
                except OSError:
                    continue
                try:
                    visit(sub)
                finally:
                    os.close(sub)

    fd = os.open(root, _DIR_FLAGS)
    try:
        st = os.fstat(fd)
        if st.st_uid != uid or st.st_gid != gid:
            os.fchown(fd, uid, gid)
            changed += 1
        visit(fd)
    finally:
        os.close(fd)
    return changed


def give_to_sandbox(path: Path, uid: int) -> None:
    """Make a writable bind (a dir tree or one file) the sandbox's: owned by its unprivileged uid,
    which is uid 0 inside (a root caller's phases run as that uid; see ``_init.py``)."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        chown_tree(path, uid)
    elif stat.S_ISREG(st.st_mode) and (st.st_uid, st.st_gid) != (uid, uid):
        os.chown(path, uid, uid, follow_symlinks=False)


def _copy_file_sparse(src_fd: int, dst_fd: int, size: int) -> None:
    """Copy only the data extents (a sample's 1 TB sparse file is a few blocks, and stays so)."""
    off = 0
    while off < size:
        try:
            data = os.lseek(src_fd, off, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past off
                break
            raise
        hole = os.lseek(src_fd, data, os.SEEK_HOLE)
        pos = data
        while pos < hole:
            chunk = os.pread(src_fd, min(1 << 20, hole - pos), pos)
            if not chunk:
                break
            os.pwrite(dst_fd, chunk, pos)
            pos += len(chunk)
        off = hole
    os.ftruncate(dst_fd, size)


def copy_tree(src: Path, dst: Path) -> int:
    """Copy the tree ``src`` into the directory ``dst`` (made if missing) as it is: directories,
    regular files (sparse ones stay sparse, modes and times kept) and symlinks *as symlinks*; never
    following a link, never opening a FIFO, socket or device (those are skipped and counted).
    Returns how many entries were skipped. Used with nothing running in the sandbox."""
    skipped = 0
    os.makedirs(dst, exist_ok=True)

    def visit(sfd: int, dfd: int) -> None:
        nonlocal skipped
        with os.scandir(sfd) as it:
            entries = list(it)
        for e in entries:
            try:
                st = os.stat(e.name, dir_fd=sfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(e.name, 0o700, dir_fd=dfd)
                s2 = os.open(e.name, _DIR_FLAGS, dir_fd=sfd)
                d2 = os.open(e.name, _DIR_FLAGS, dir_fd=dfd)
                try:
                    visit(s2, d2)
                    os.chmod(d2, stat.S_IMODE(st.st_mode))
                    os.utime(d2, ns=(st.st_atime_ns, st.st_mtime_ns))
                finally:
                    os.close(s2)
                    os.close(d2)
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(e.name, dir_fd=sfd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.name, dir_fd=dfd)
                os.symlink(target, e.name, dir_fd=dfd)
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(e.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
                try:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.name, dir_fd=dfd)
                    out = os.open(e.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  0o600, dir_fd=dfd)
                    try:
                        _copy_file_sparse(fd, out, os.fstat(fd).st_size)
                        os.fchmod(out, stat.S_IMODE(st.st_mode))
                        os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
                    finally:
                        os.close(out)
                finally:
                    os.close(fd)
            else:
                skipped += 1

    sfd, dfd = os.open(src, _DIR_FLAGS), os.open(dst, _DIR_FLAGS)
    try:
        visit(sfd, dfd)
    finally:
        os.close(sfd)
        os.close(dfd)
    return skipped


def clear_dir(path: Path) -> None:
    """Remove everything inside ``path`` (links removed, never followed)."""
    fd = os.open(path, _DIR_FLAGS)
    try:
        with os.scandir(fd) as it:
            names = [e.name for e in it]
        for name in names:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
