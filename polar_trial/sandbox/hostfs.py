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


def _open_dir(root: Path | int, parts: list[str], create: bool = False) -> int:
    """An fd of root/parts... walked without following any link (``create``: mkdir missing ones);
    ``root`` may be an open directory fd (not closed)."""
    fd = os.dup(root) if isinstance(root, int) else os.open(root, _DIR_FLAGS)
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


#: How deep a host-side walk goes into a sample's tree (one open fd per level). Deeper entries are
#: skipped and counted: a 3,000-level tree must not exhaust the host's fds or its recursion.
MAX_DEPTH = 256


def _walk_dirs(root_fd: int, skipped: list[int] | None = None):
    """Yield (dir fd, entry name, lstat, relative path) for everything under an open directory,
    depth first, entering directories with O_NOFOLLOW from their parent's fd; one fd per level of
    the current path, at most MAX_DEPTH levels (what lies deeper is counted in ``skipped[0]``). The
    yielded fd is valid until the next item."""
    frames: list[tuple[int, list[str], str]] = []

    def push(fd: int, rel: str) -> None:
        with os.scandir(fd) as it:
            names = [e.name for e in it]
        names.reverse()
        frames.append((fd, names, rel))

    push(os.dup(root_fd), "")
    try:
        while frames:
            fd, names, rel = frames[-1]
            if not names:
                os.close(fd)
                frames.pop()
                continue
            name = names.pop()
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            relp = f"{rel}/{name}" if rel else name
            yield fd, name, st, relp
            if stat.S_ISDIR(st.st_mode):
                if len(frames) >= MAX_DEPTH:
                    if skipped is not None:
                        skipped[0] += 1
                    continue
                try:
                    push(os.open(name, _DIR_FLAGS, dir_fd=fd), relp)
                except OSError:
                    pass
    finally:
        for fd, _, _ in frames:
            os.close(fd)


def chown_tree(root: Path, uid: int, gid: int | None = None) -> int:
    """``lchown`` everything under ``root`` (and root) to uid:gid without following any link;
    returns how many entries changed. Walks with dir fds, so a directory swapped for a link while
    walking is not entered."""
    gid = uid if gid is None else gid
    changed = 0
    fd = os.open(root, _DIR_FLAGS)
    try:
        st = os.fstat(fd)
        if st.st_uid != uid or st.st_gid != gid:
            os.fchown(fd, uid, gid)
            changed += 1
        for dfd, name, st, _ in _walk_dirs(fd):
            if st.st_uid != uid or st.st_gid != gid:
                os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
                changed += 1
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


class CopyBudgetExceeded(OSError):
    """A copy stopped at its byte budget (a sample's hard links or sparse files must not multiply
    what it wrote into more than its disk cap on the host)."""


def copy_tree(src: Path | int, dst: Path | int, *, budget: int | None = None,
              ignore=None, special: list[str] | None = None) -> int:
    """Copy the tree ``src`` into the directory ``dst`` (made if missing; either may be an open
    directory fd) as it is: directories, regular files (sparse ones stay sparse, modes and times
    kept, set-id bits dropped), symlinks *as symlinks*, hard links as hard links; never following
    a link (a link where a directory is to be copied raises :class:`UnsafePath`), never opening a
    FIFO, socket or device. ``budget``: the most data bytes to write (:class:`CopyBudgetExceeded`
    past it). ``ignore(rel_path) -> bool`` skips a path. Returns how many entries were skipped
    (special files, and what lies deeper than MAX_DEPTH); ``special`` gets the relative path of
    each special file skipped (the verifier's reward file as a FIFO is a tampered verdict)."""
    skipped, written = [0], 0
    seen: dict[tuple[int, int], str] = {}  # (dev, ino) of a hard-linked file -> its copy, relative to dst
    if isinstance(dst, (str, os.PathLike)):
        os.makedirs(dst, exist_ok=True)
    sfd = os.open(src, _DIR_FLAGS) if not isinstance(src, int) else os.dup(src)
    root = os.open(dst, _DIR_FLAGS) if not isinstance(dst, int) else os.dup(dst)
    dst_fds = {"": os.dup(root)}  # relative dir -> its fd in dst (only along the current path)
    dirs_done: list[tuple[str, os.stat_result]] = []
    try:
        for s_fd, name, st, relp in _walk_dirs(sfd, skipped):
            parent = relp.rpartition("/")[0]
            for k in [k for k in dst_fds if k and not (parent == k or parent.startswith(k + "/"))]:
                os.close(dst_fds.pop(k))  # left that dir: its fd is no longer needed
            d_fd = dst_fds[parent]
            if ignore is not None and ignore(relp):
                continue
            if stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=d_fd)
                try:
                    dst_fds[relp] = os.open(name, _DIR_FLAGS, dir_fd=d_fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnsafePath(exc.errno, f"{relp}: a link or file where a directory is copied; not followed") from exc
                    raise
                dirs_done.append((relp, st))
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=s_fd)
                _remove_entry(d_fd, name)
                os.symlink(target, name, dir_fd=d_fd)
            elif stat.S_ISREG(st.st_mode):
                _remove_entry(d_fd, name)
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in seen:
                    os.link(seen[key], name, src_dir_fd=root, dst_dir_fd=d_fd, follow_symlinks=False)
                    continue
                written += st.st_blocks * 512
                if budget is not None and written > budget:
                    raise CopyBudgetExceeded(errno.EFBIG, f"copy stopped at its {budget} byte budget (at {relp})")
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=s_fd)
                try:
                    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  0o600, dir_fd=d_fd)
                    try:
                        _copy_file_sparse(fd, out, os.fstat(fd).st_size)
                        # never set-id: a copy the host made is the host's (root's), not the sample's
                        os.fchmod(out, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
                        os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
                    finally:
                        os.close(out)
                finally:
                    os.close(fd)
                if st.st_nlink > 1:
                    seen[key] = relp
            else:
                skipped[0] += 1
                if special is not None:
                    special.append(relp)
        for relp, st in reversed(dirs_done):  # modes and times once their contents are in
            with contextlib.suppress(OSError):
                os.chmod(relp, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID), dir_fd=root,
                         follow_symlinks=False)
                os.utime(relp, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=root, follow_symlinks=False)
    finally:
        for fd in (sfd, root, *dst_fds.values()):
            with contextlib.suppress(OSError):
                os.close(fd)
    return skipped[0]


def _remove_entry(dfd: int, name: str) -> None:
    """Make room for ``name`` in ``dfd``: a file or link there is unlinked (never followed); a
    directory there is an error (the copy does not merge a file over a directory)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise UnsafePath(errno.EISDIR, f"{name}: a directory is in the way")
    os.unlink(name, dir_fd=dfd)


def clear_dir(path: Path) -> None:
    """Remove everything inside ``path`` (links removed, never followed) with two open fds, at
    any depth: a subdirectory's entries are renamed up into ``path`` (flattening the tree one
    level at a time), then the emptied directory is removed."""
    fd = os.open(path, _DIR_FLAGS)
    n = 0
    try:
        while True:
            with os.scandir(fd) as it:
                names = [e.name for e in it]
            if not names:
                return
            for name in names:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=fd)
                    continue
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                try:
                    with os.scandir(sub) as it:
                        inner = [e.name for e in it]
                    for x in inner:
                        n += 1
                        os.rename(x, f".polar-clear-{n}", src_dir_fd=sub, dst_dir_fd=fd)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)



#: how many links a resolution follows before it calls the chain a loop (the kernel's own limit)
MAX_LINK_HOPS = 40


def _stays_inside(root_fd: int, where: list[str], target: str) -> bool:
    """Whether a symlink in the directory ``where`` (components under the root) to ``target``
    resolves inside the root, followed as the kernel would but from the root's fd and never through
    anything outside it: an absolute target, a ``..`` above the root, or a loop of links is
    outside. Past a component that does not exist (a dangling tail) the rest is read lexically."""
    stack, pending, hops = list(where), target.split("/")[::-1], 0
    if target.startswith("/") or not target:
        return False
    lexical = False
    while pending:
        c = pending.pop()
        if c in ("", "."):
            continue
        if c == "..":
            if not stack:
                return False
            stack.pop()
            continue
        if not lexical:
            try:
                dfd = _open_dir(root_fd, stack)
            except (OSError, UnsafePath):
                lexical = True  # the kernel would stop here; judge what is left by its text
            else:
                try:
                    st = os.stat(c, dir_fd=dfd, follow_symlinks=False)
                    link = os.readlink(c, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else None
                except OSError:
                    link, lexical = None, True
                finally:
                    os.close(dfd)
                if link is not None:
                    hops += 1
                    if hops > MAX_LINK_HOPS or link.startswith("/") or not link:
                        return False
                    pending.extend(link.split("/")[::-1])  # relative to the link's own directory
                    continue
        stack.append(c)
    return True


def drop_outside_links(root: Path, keep_names: int = 5) -> tuple[int, list[str]]:
    """Remove every symlink under ``root`` whose target resolves outside ``root`` (absolute
    targets included: on the host they name the host's files); links that stay inside are kept.
    A sample's planted ``work/key -> /root/.ssh/id_rsa`` is harmless to Polar, which never follows
    it, but a user's ``cp -L``, ``tar -h`` or upload of the run dir would. A directory deeper than
    :data:`MAX_DEPTH` (where the walk does not go) is removed whole, so no link hides there.
    Returns (how many were removed, the first ``keep_names`` of them as ``path -> target``).
    Nothing may run in ``root``."""
    dropped, names = 0, []
    fd = os.open(root, _DIR_FLAGS)
    try:
        for dfd, name, st, relp in _walk_dirs(fd):
            if stat.S_ISDIR(st.st_mode) and relp.count("/") + 1 >= MAX_DEPTH:  # not entered by the walk
                clear_dir(Path(f"/proc/self/fd/{dfd}/{name}"))
                os.rmdir(name, dir_fd=dfd)
                dropped += 1
                if len(names) < keep_names:
                    names.append(f"{relp[:120]}... (deeper than {MAX_DEPTH} levels: removed whole)")
                continue
            if not stat.S_ISLNK(st.st_mode):
                continue
            try:
                target = os.readlink(name, dir_fd=dfd)
            except OSError:
                continue
            if _stays_inside(fd, relp.split("/")[:-1], target):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
            dropped += 1
            if len(names) < keep_names:
                names.append(f"{relp} -> {target[:120]}")
    finally:
        os.close(fd)
    return dropped, names
