"""The user namespace a private dockerd remaps containers into (``--userns-remap``).

Without it, a container's uid 0 is the host's uid 0: with its capabilities dropped, but any file
of the host's root that a bind, a kernel bug or a runtime bug lets it reach is its own, and a
capability the container keeps (the package manager's CHOWN, DAC_OVERRIDE, SETUID) works on host
files too. With it, the daemon runs every container in a user namespace whose uid 0..65535 are
host uids ``BASE..BASE+65535``: an unused range, owning nothing on the host, holding no capability
over anything the host's root owns.

dockerd takes the range from ``/etc/subuid`` and ``/etc/subgid`` under a user name (it refuses a
name that is not a user), so this module adds a system user ``polar-remap`` with no home and no
shell, and its one range, when they are missing (root only; idempotent). The range sits below
the bubblewrap sandboxes' uid slots (``uidrange.py``: 2e9 and up), so the two never overlap.

What the host must do for a bind: a directory the container writes (the work dir, HOME, the
verifier's dir) is owned by the container's root, i.e. ``chown`` to :data:`BASE` (``chown_tree``);
the host's root still reads it (it is root).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

USER = "polar-remap"
#: the first host uid (and gid) of the range: container uid 0
BASE = int(os.environ.get("POLAR_REMAP_BASE", "1500000000"))
COUNT = 65536


class RemapError(RuntimeError):
    """The remap user or its range could not be set up."""


def _has_range(path: Path, user: str = USER) -> bool:
    try:
        return any(line.split(":")[0] == user for line in path.read_text().splitlines())
    except FileNotFoundError:
        return False


def ensure_remap_user() -> str:
    """``polar-remap`` with its subordinate uid/gid range, made when missing; the value of
    ``--userns-remap``."""
    ensure_subid_user(USER, BASE, COUNT)
    return f"{USER}:{USER}"


def ensure_subid_user(user: str, base: int, count: int) -> None:
    """A system user ``user`` (no home, no shell: the name is reserved, nothing runs as it) and its
    range ``base``..``base+count-1`` in /etc/subuid and /etc/subgid, made when missing (root only;
    idempotent, under a lock). dockerd's ``--userns-remap`` and podman's ``--userns=auto``
    (``podmanroot.py``: ``root-auto-userns-user``) take their ranges from such an entry."""
    import pwd

    if os.geteuid() != 0:
        raise RemapError(f"the subordinate id range of {user} needs root")
    lock = os.open("/etc/.polar-remap.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            pwd.getpwnam(user)
        except KeyError:
            r = subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                                "--shell", "/usr/sbin/nologin", user], capture_output=True, text=True,
                               stdin=subprocess.DEVNULL)
            if r.returncode not in (0, 9):  # 9: it exists (another process made it)
                raise RemapError(f"useradd {user} failed: {r.stderr.strip()}")
        for name in ("/etc/subuid", "/etc/subgid"):
            path = Path(name)
            if not _has_range(path, user):
                with open(path, "a") as fh:
                    fh.write(f"{user}:{base}:{count}\n")
    finally:
        os.close(lock)


def remapped_root(runtime: str = "docker") -> int | None:
    """The host uid of the container's root on the daemon ``DOCKER_HOST`` names: BASE when that
    daemon remaps (``docker info`` lists ``name=userns``), None when it does not. Cached per
    daemon. None for podman: there each container gets a range of its own (``--userns=auto``),
    known once it is created (``podman.container_root``)."""
    key = (runtime, os.environ.get("DOCKER_HOST", ""))
    if key not in _cache:
        if runtime != "docker":
            _cache[key] = None
        else:
            r = subprocess.run([runtime, "info", "--format", "{{json .SecurityOptions}}"], capture_output=True,
                               text=True, timeout=30, stdin=subprocess.DEVNULL)
            _cache[key] = _range_base() if r.returncode == 0 and "name=userns" in r.stdout else None
    return _cache[key]


_cache: dict[tuple[str, str], int | None] = {}


def _range_base() -> int:
    for line in Path("/etc/subuid").read_text().splitlines():
        parts = line.split(":")
        if parts[0] == USER and len(parts) == 3:
            return int(parts[1])
    return BASE


def chown_tree(root: Path, uid: int, gid: int | None = None) -> None:
    """Every file under ``root`` owned by ``uid``:``gid`` (default ``uid``), never following a
    link (``hostfs.chown_tree``: walked with directory fds)."""
    from polar_trial.sandbox.hostfs import chown_tree as safe_chown

    safe_chown(root, uid, uid if gid is None else gid)
