"""Tar streams whose members someone else chose (a task's image, a container's work dir), read and
written by the host in constant memory, every member checked by us before anything touches disk.

Why our own checks: tarfile's extraction filters are only as good as the interpreter's patch level
(the venv's Python 3.11.7 predates the 2025 tarfile fixes: a hard link to a symlink, a path past
PATH_MAX, escaped the ``data`` filter), and the host extracts as root. So :func:`extract` never
calls tarfile's ``extract``; it reads members one at a time (stream mode, ``r|``) and writes each
through ``hostfs``' no-follow walk from the destination's fd:

* names: relative only, no ``..`` component, no NUL, at most :data:`MAX_NAME` bytes with components
  of at most :data:`MAX_COMPONENT` and at most :data:`MAX_PARTS` levels; an absolute or ``..``
  name raises :class:`UnsafeArchive` (nothing of such an archive is trusted further);
* no member is written *through* an earlier symlink member: every directory on the way is opened
  with ``O_NOFOLLOW`` (a link there raises), and a file replaces the entry at its name, never
  opens it;
* hard links only to a regular file already extracted under the destination (never to a path
  outside it, never to a link or a device);
* symlinks: kept as links (``symlinks="keep"``: a work dir's ``.venv/bin/python ->
  /usr/bin/python3`` must work in the next sandbox; nothing of ours follows it, and the run dir's
  sweep drops it when the sample is done, ``hostfs.drop_outside_links``), or only when their target
  stays inside the destination (``symlinks="inside"``; the others are dropped and counted);
* devices, FIFOs and unknown member types are skipped and counted;
* modes lose set-uid and set-gid; ownership is not restored (files are the extracting user's: a
  container phase runs as that uid without CAP_DAC_OVERRIDE, and an owner from the image's
  ``/etc/passwd`` means nothing on the host);
* sizes: ``max_bytes`` caps the sum of the members' sizes (apparent: a sparse file counts at its
  length); runs of zeros are written as holes, so a sparse file stays sparse on the host.

Memory: tarfile keeps every member's ``TarInfo`` in ``TarFile.members`` (about 1 KiB each: a
100,000-file node_modules would hold ~100 MiB); :func:`extract` and :func:`add_tree` clear that
list after each member, so the host's memory is one member header and one 1 MiB chunk, whatever
the archive holds (measured in tests/trial/sandbox/test_safetar.py).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from polar_trial.sandbox.hostfs import _DIR_FLAGS, UnsafePath, _open_dir, _remove_entry

MAX_NAME = 4096
MAX_COMPONENT = 255
MAX_PARTS = 256
CHUNK = 1 << 20
#: how many skipped or dropped names an :class:`Extracted` keeps (the count is exact)
KEEP_NAMES = 5


class UnsafeArchive(ValueError):
    """A member that would land outside the destination or through a link: the archive is refused."""


@dataclass
class Extracted:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    bytes: int = 0
    #: devices, FIFOs, unknown types: (count, first names)
    skipped: int = 0
    skipped_names: list[str] = field(default_factory=list)
    #: symlinks whose target leaves the destination (``symlinks="inside"`` only)
    dropped_links: int = 0
    dropped_names: list[str] = field(default_factory=list)

    def notes(self) -> list[str]:
        out = []
        if self.skipped:
            out.append(f"{self.skipped} special file(s) in the archive not extracted (devices, FIFOs): "
                       + ", ".join(self.skipped_names))
        if self.dropped_links:
            out.append(f"{self.dropped_links} link(s) pointing outside the tree dropped: " + ", ".join(self.dropped_names))
        return out


def member_parts(name: str, strip: int = 0) -> list[str]:
    """The validated relative components of a member name, less its first ``strip`` ones (docker
    cp names a copied dir's entries ``<dir>/...``). Raises :class:`UnsafeArchive`."""
    if "\0" in name or len(name.encode(errors="surrogateescape")) > MAX_NAME:
        raise UnsafeArchive(f"member name {name[:80]!r}...: a NUL or longer than {MAX_NAME} bytes")
    if name.startswith("/"):
        raise UnsafeArchive(f"member {name[:200]!r}: an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"member {name[:200]!r}: a '..' component")
    if len(parts) > MAX_PARTS or any(len(p.encode(errors="surrogateescape")) > MAX_COMPONENT for p in parts):
        raise UnsafeArchive(f"member {name[:200]!r}: deeper than {MAX_PARTS} levels or a component "
                            f"longer than {MAX_COMPONENT} bytes")
    return parts[strip:]


def link_stays_inside(parts: list[str], target: str) -> bool:
    """Whether a symlink at ``parts`` to ``target`` resolves inside the tree, read lexically (the
    links it may pass through are judged by the same rule)."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    norm = posixpath.normpath(posixpath.join(*parts[:-1], target) if len(parts) > 1 else target)
    return norm != ".." and not norm.startswith("../")


def _write_sparse(src, fd: int, size: int) -> int:
    """Copy ``size`` bytes from ``src`` to ``fd``, runs of zeros as holes; returns bytes on disk."""
    written = pos = 0
    while pos < size:
        chunk = src.read(min(CHUNK, size - pos))
        if not chunk:
            raise UnsafeArchive("the archive ended inside a member")
        if chunk.count(0) != len(chunk):
            os.pwrite(fd, chunk, pos)
            written += len(chunk)
        pos += len(chunk)
    os.ftruncate(fd, size)
    return written


def extract(tf: tarfile.TarFile, dest: Path | str, *, strip: int = 0, symlinks: str = "keep",
            max_bytes: int | None = None) -> Extracted:
    """Extract every member of ``tf`` (opened in stream mode, ``r|``, or any mode) under the
    existing directory ``dest`` with the checks of the module docstring. Raises
    :class:`UnsafeArchive` for a member that would escape, and leaves what was extracted so far."""
    if symlinks not in ("keep", "inside"):
        raise ValueError(f"symlinks must be 'keep' or 'inside', not {symlinks!r}")
    out, total = Extracted(), 0
    root = os.open(dest, _DIR_FLAGS)
    try:
        while True:
            m = tf.next()
            tf.members.clear()  # constant memory: tarfile would keep every header
            if m is None:
                return out
            parts = member_parts(m.name, strip)
            if not parts:  # the destination itself
                continue
            shown = "/".join(parts)
            if m.isdev() or m.isfifo() or not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
                out.skipped += 1
                if len(out.skipped_names) < KEEP_NAMES:
                    out.skipped_names.append(shown)
                continue
            if m.isreg():
                total += m.size
                if max_bytes is not None and total > max_bytes:
                    raise UnsafeArchive(f"the archive's files pass {max_bytes} bytes (at {shown!r}, {m.size} bytes)")
            mode = stat.S_IMODE(m.mode) & ~(stat.S_ISUID | stat.S_ISGID)
            try:
                dfd = _open_dir(root, parts[:-1], create=True) if len(parts) > 1 \
                    else os.dup(root)
            except UnsafePath as exc:
                raise UnsafeArchive(f"member {shown!r} goes through a link: {exc}") from None
            except NotADirectoryError:
                raise UnsafeArchive(f"member {shown!r}: a file is where its directory should be") from None
            name = parts[-1]
            try:
                if m.isdir():
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o700, dir_fd=dfd)
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if not stat.S_ISDIR(st.st_mode):
                        raise UnsafeArchive(f"member {shown!r}: a directory over a link or file")
                    _chmod_dir(dfd, name, mode | 0o700)
                    out.dirs += 1
                    continue
                if m.issym():
                    if len(m.linkname) > MAX_NAME or "\0" in m.linkname:
                        raise UnsafeArchive(f"symlink {shown!r}: its target is longer than {MAX_NAME} bytes")
                    if symlinks == "inside" and not link_stays_inside(parts, m.linkname):
                        out.dropped_links += 1
                        if len(out.dropped_names) < KEEP_NAMES:
                            out.dropped_names.append(f"{shown} -> {m.linkname[:100]}")
                        continue
                    _remove(dfd, name, shown)
                    os.symlink(m.linkname, name, dir_fd=dfd)
                    with contextlib.suppress(OSError, OverflowError, ValueError):  # any mtime an archive says
                        os.utime(name, (m.mtime, m.mtime), dir_fd=dfd, follow_symlinks=False)
                    out.symlinks += 1
                    continue
                if m.islnk():
                    _hardlink(root, dfd, name, shown, member_parts(m.linkname, strip))
                    out.hardlinks += 1
                    continue
                _remove(dfd, name, shown)
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=dfd)
                try:
                    src = tf.extractfile(m)
                    assert src is not None
                    out.bytes += _write_sparse(src, fd, m.size)
                    os.fchmod(fd, mode)
                    with contextlib.suppress(OSError, OverflowError, ValueError):
                        os.utime(fd, (m.mtime, m.mtime))
                finally:
                    os.close(fd)
                out.files += 1
            finally:
                os.close(dfd)
    finally:
        os.close(root)


def _chmod_dir(dfd: int, name: str, mode: int) -> None:
    fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _remove(dfd: int, name: str, shown: str) -> None:
    try:
        _remove_entry(dfd, name)
    except UnsafePath:
        raise UnsafeArchive(f"member {shown!r}: a directory is in the way") from None


def _hardlink(root: int, dfd: int, name: str, shown: str, target: list[str]) -> None:
    """A hard link to a regular file already extracted under the destination, found without
    following any link."""
    if not target:
        raise UnsafeArchive(f"hard link {shown!r}: to the destination itself")
    try:
        tfd = _open_dir(root, target[:-1]) if len(target) > 1 else os.dup(root)
    except (UnsafePath, FileNotFoundError, NotADirectoryError) as exc:
        raise UnsafeArchive(f"hard link {shown!r} -> {'/'.join(target)!r}: no such file in the archive ({exc})") from None
    try:
        try:
            st = os.stat(target[-1], dir_fd=tfd, follow_symlinks=False)
        except FileNotFoundError:
            raise UnsafeArchive(f"hard link {shown!r} -> {'/'.join(target)!r}: no such file in the archive") from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeArchive(f"hard link {shown!r} -> {'/'.join(target)!r}: not a regular file")
        _remove(dfd, name, shown)
        os.link(target[-1], name, src_dir_fd=tfd, dst_dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(tfd)


def add_tree(tf: tarfile.TarFile, root: Path, arcname: str) -> int:
    """Add ``root`` and everything under it to ``tf`` (opened ``w|``) as ``arcname/...``: links as
    links (never followed), no special file (counted and left out), ``tf.members`` cleared after each
    entry. ``root`` must be the host's own tree (a staging dir no process writes to). Returns how
    many entries were left out."""
    left_out = 0

    def one(path: str, name: str) -> None:
        nonlocal left_out
        st = os.lstat(path)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            left_out += 1
            return
        tf.add(path, arcname=name, recursive=False)
        tf.members.clear()

    one(str(root), arcname)
    if not stat.S_ISDIR(os.lstat(root).st_mode):  # a file or a link: os.walk would follow a link
        return left_out
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = os.path.relpath(dirpath, root)
        base = arcname if rel == "." else f"{arcname}/{rel}"
        dirnames.sort()
        for n in sorted(filenames) + dirnames:
            one(os.path.join(dirpath, n), f"{base}/{n}")
    return left_out
