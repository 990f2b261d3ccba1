"""The harness's HOME, copied into the image user's own HOME inside a container: run by the
container's init (``_init.py``, per-phase containers) and the live trial's (``_trialinit.py``);
stdlib only, copied beside them.

On a container backend the sample's host HOME, where the preset wrote its config
(``harnesses.py``: Codex's ``config.toml`` under ``CODEX_HOME``, Pi's ``models.json``, Claude Code's
``settings.json``, OpenCode's ``opencode.json``, ...), is not bound into the task's image any more:
it is bound read-only at a staging path the phase never sees, :func:`read_tree` reads it there (as
root, before the drop: directories and regular files only, no link followed, at most
:data:`LIMIT` bytes), and :func:`write_tree` writes it into the passwd HOME of the user the phase
runs as, *as that user* (after the drop to its uid): every file is the user's, and a link the
sample planted in its own HOME on an earlier turn (``~/.codex -> /etc``) is replaced, never
written through; even followed, it could only lead where the user may write anyway.

Every environment value and argument that names the host HOME or a path under it (``HOME``,
``XDG_*``, ``CODEX_HOME``, ``PI_CODING_AGENT_DIR``, ``CLAUDE_CONFIG_DIR``, ``OPENCODE_CONFIG``)
is moved to the same place under the image's HOME (:func:`moved`). What the harness leaves there
(its sessions, which a follow-up turn's ``resume``/``--continue`` reads) is read back by the host
through ``docker cp`` and ``safetar`` (``harnesshome.py``), never by following a path of the
container's.
"""

from __future__ import annotations

import errno
import os
import stat

#: what a harness's prepared config may weigh (a few KiB in practice; Codex's is 0.5 KiB)
LIMIT = 16 << 20
MAX_ENTRIES = 10_000
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def moved(value: str, prefix: str, home: str) -> str:
    """``value`` with a leading ``prefix`` (the host HOME, as a whole path component) replaced by
    ``home``; any other value unchanged (``/h/home2`` is not under ``/h/home``)."""
    prefix = prefix.rstrip("/") or "/"
    if not prefix.startswith("/") or prefix == "/":
        return value
    if value == prefix:
        return home
    if value.startswith(prefix + "/"):
        return home.rstrip("/") + value[len(prefix):]
    return value


def rewrite(env: dict[str, str], argv: list[str], prefix: str, home: str) -> tuple[dict[str, str], list[str]]:
    """The phase's environment and argv with the host HOME moved to ``home``; HOME is ``home``."""
    env = {k: moved(v, prefix, home) for k, v in env.items()}
    env["HOME"] = home
    return env, [moved(a, prefix, home) for a in argv]


def read_tree(src: str, limit: int = LIMIT, skipped: list[str] | None = None) -> list[tuple[str, int, bytes | None]]:
    """(relative path, mode, bytes; None for a directory) of every directory and regular file
    under ``src``, parents first, walked by fds without following any link; links and special
    files are left out, and files this process may not open (named in ``skipped``). Raises
    OSError past ``limit`` bytes or :data:`MAX_ENTRIES` entries."""
    out: list[tuple[str, int, bytes | None]] = []
    total = 0

    def walk(dfd: int, rel: str) -> None:
        nonlocal total
        for name in sorted(os.listdir(dfd)):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            path = f"{rel}/{name}" if rel else name
            if len(out) >= MAX_ENTRIES:
                raise OSError(errno.EFBIG, f"more than {MAX_ENTRIES} entries in the harness's HOME")
            if stat.S_ISDIR(st.st_mode):
                out.append((path, stat.S_IMODE(st.st_mode), None))
                fd = os.open(name, _DIR, dir_fd=dfd)
                try:
                    walk(fd, path)
                finally:
                    os.close(fd)
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total > limit:
                    raise OSError(errno.EFBIG, f"the harness's HOME passes {limit} bytes (at {path})")
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                except PermissionError:  # a read-back 0600 file a remapped root may not open: not config
                    if skipped is not None:
                        skipped.append(path)
                    continue
                try:
                    chunks, n = [], 0
                    while n <= st.st_size:
                        b = os.read(fd, 1 << 20)
                        if not b:
                            break
                        chunks.append(b)
                        n += len(b)
                finally:
                    os.close(fd)
                out.append((path, stat.S_IMODE(st.st_mode), b"".join(chunks)[: st.st_size]))

    root = os.open(src, _DIR)
    try:
        walk(root, "")
    finally:
        os.close(root)
    return out


def _clear(dfd: int, name: str) -> None:
    """Remove the entry ``name`` (a link, a file, or an empty directory) if there is one."""
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        os.rmdir(name, dir_fd=dfd)
    except PermissionError:  # Linux answers EPERM for unlink of a directory
        os.rmdir(name, dir_fd=dfd)


def _subdir(dfd: int, name: str) -> int:
    try:
        return os.open(name, _DIR, dir_fd=dfd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        _clear(dfd, name)  # a link or a file where the harness's directory goes: replaced
    os.mkdir(name, 0o700, dir_fd=dfd)
    return os.open(name, _DIR, dir_fd=dfd)


def write_tree(home: str, files: list[tuple[str, int, bytes | None]]) -> list[str]:
    """Write what :func:`read_tree` read under ``home``, as the calling user (the phase's), no
    link followed below ``home``; the problems met, one sentence each (the rest is written)."""
    problems: list[str] = []
    try:
        root = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the image's HOME, as it is
    except OSError as exc:
        return [f"the harness's HOME {home} cannot be opened: {exc}"]
    try:
        for rel, mode, data in files:
            parts = rel.split("/")
            fds = [os.dup(root)]
            try:
                for p in parts[:-1]:
                    fds.append(_subdir(fds[-1], p))
                if data is None:
                    os.close(_subdir(fds[-1], parts[-1]))
                    continue
                _clear(fds[-1], parts[-1])
                # the user's alone: a config holds the session's key
                fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600 | (mode & 0o100), dir_fd=fds[-1])
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
            except OSError as exc:
                problems.append(f"{home}/{rel} not written: {exc}")
            finally:
                for d in fds:
                    os.close(d)
    finally:
        os.close(root)
    return problems


def ensure_home(home: str, uid: int, gid: int) -> None:
    """Before the drop (root): the user's HOME made where the image's /etc/passwd names it and
    the image has none (``mkdir``, then owned by the user), its parents walked without links."""
    parts = [p for p in home.split("/") if p]
    if not parts:
        return
    fd = os.open("/", _DIR)
    try:
        for p in parts[:-1]:
            nfd = os.open(p, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
        try:
            os.mkdir(parts[-1], 0o700, dir_fd=fd)
        except FileExistsError:
            return
        os.chown(parts[-1], uid, gid, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


def passwd_home(uid: int, passwd: str = "/etc/passwd") -> str:
    """The HOME of ``uid`` in the image's /etc/passwd, read as a file (a per-phase container runs
    as the caller's uid); ``/root`` for root and ``/tmp/home`` for a uid the image does not know."""
    try:
        with open(passwd, errors="replace") as fh:
            for ln in fh:
                e = ln.rstrip("\n").split(":")
                if len(e) >= 7 and e[2] == str(uid) and e[5].startswith("/"):
                    return e[5]
    except OSError:
        pass
    return "/root" if uid == 0 else "/tmp/home"
