"""``podman``: the docker backend's run on Podman, whose CLI takes the same ``run`` flags.

As root, every podman child of this process uses Polar's own store (``podmanroot.py``: a
loop-mounted btrfs under ``$POLAR_HOME/podman``, runc, no container log), never the host's
``/var/lib/containers``; a store the caller names in ``CONTAINERS_STORAGE_CONF`` is used as it is.

A live trial (``trial.py``) runs its container with ``--userns=auto``: podman hands each container
a range of 65536 host ids no other container of the store holds, so the container's root is an
unprivileged host uid (1,600,000,000 and up), a different one per trial. The range is known only
once the container exists, so the trial's container is made in three steps (:func:`create_owned`):
``podman create``; the dirs it writes chowned to its root (``remap.chown_tree``, as for a
remapping dockerd) and its writes capped (:func:`cap_writes`); ``podman start``.

Per-phase containers (a task image's RUN steps, per-phase runs) are made the same way
(:meth:`PodmanSandbox.before_start`), and a compose service joins its trial's user namespace
(``services.py``: one of its own cannot mount /sys in the trial's network namespace).

Differences from docker that matter here: ``podman info`` has no ``.ServerVersion`` (the check asks
for ``.Version.Version``); rootless Podman maps the caller to root inside the user namespace, so
``--userns keep-id`` keeps the caller's uid and the bound work dir and HOME stay writable by it
(rootless is not tested here: our machines run as root).
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Callable

from polar_trial.sandbox.base import SandboxError, SandboxSpec, SandboxUnavailable
from polar_trial.sandbox.docker import DockerSandbox
from polar_trial.sandbox.podmanroot import CONTAINER_IDS, PodmanRootError, use_private_root


class PodmanSandbox(DockerSandbox):
    name = "podman"
    runtime = "podman"
    limits_by = "podman's cgroups"
    #: a live trial's container gets its user namespace at creation (``--userns=auto``)
    userns_per_container = True

    probe = ("info", "--format", "{{.Version.Version}}")  # daemonless: no .ServerVersion
    probe_failure = "podman cannot run containers here"
    #: images looked up in podman's store, apart from docker's (the same name may be on one only)
    _images: dict[str, str | None] = {}
    _images_lock = threading.Lock()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """As docker's, but as root with no store named in ``CONTAINERS_STORAGE_CONF`` only the CLI
        is looked for: ``podman info`` would make the host's /var/lib/containers, and Polar's own
        store is made by :meth:`open` (any failure said there)."""
        import shutil

        if os.geteuid() == 0 and not os.environ.get("CONTAINERS_STORAGE_CONF"):
            return None if shutil.which(cls.runtime) else f"the {cls.runtime} CLI is not installed"
        return super().unavailable_reason()

    @classmethod
    def open(cls) -> PodmanSandbox:
        """The backend with this process's podman children on Polar's own store (as root, unless
        the caller named one: ``use_private_root``)."""
        try:
            use_private_root()
        except PodmanRootError as e:
            raise SandboxUnavailable(f"sandbox 'podman' is unavailable: {e}") from None
        return cls()

    def before_start(self, cmd: list[str], name: str, spec: SandboxSpec, private: Path, report_dir: Path,
                     staged: dict[Path, Path], notes: list[str]) -> list[str]:
        """As root, a phase's container (a build step, a per-phase run) gets a user namespace of its
        own as a live trial's does: created with ``--userns=auto``, what it writes (its writable
        binds or their copies on the disk image, the report dir, a harness's HOME to copy in)
        chowned to its root, its writes capped, then ``podman start --attach`` runs it."""
        if os.geteuid() != 0:
            return cmd  # rootless: --userns keep-id (argv)
        from polar_trial.sandbox.remap import chown_tree

        i = cmd.index("run")
        _podman("create", f"--userns=auto:size={CONTAINER_IDS}", *cmd[i + 1:])
        owner = container_root(name)
        os.chmod(private, 0o755)
        os.chown(report_dir, owner, owner)
        for host, _, writable in spec.mounts():
            if writable and host.exists():
                chown_tree(staged.get(host, host), owner)
        if spec.home_copy is not None:
            chown_tree(spec.home_copy, owner)
        if spec.disk_mb:
            notes.append(cap_writes(name, spec.disk_mb).replace("the environment's", "the container's"))
        notes.append(f"user namespace: the container's root is host uid {owner} (podman --userns=auto)")
        return [cmd[0], "start", "--attach", name]

    def argv(self, spec: SandboxSpec, private: Path, name: str, inner: list[str],
             report_dir: Path | None = None, host_binds: list[tuple[str, str]] = (),
             staged: dict[Path, Path] | None = None, tmp_dir: Path | None = None) -> list[str]:
        a = super().argv(spec, private, name, inner, report_dir, host_binds, staged, tmp_dir)
        if os.getuid() != 0:  # rootless: the caller's uid inside too, so its binds stay writable
            a[2:2] = ["--userns", "keep-id"]
        return a


def _podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise SandboxError(f"`podman {args[0]}` failed: {(r.stderr or r.stdout).strip()[-600:]}")
    return r


def container_root(name: str) -> int:
    """The host uid of container ``name``'s root: the first host id of its uid map (podman
    inspect's ``IDMappings``; the gid map is checked to start at the same id)."""
    import json

    r = _podman("inspect", "--format", "{{json .HostConfig.IDMappings}}", name)
    maps = json.loads(r.stdout or "{}") or {}
    firsts = []
    for key in ("UidMap", "GidMap"):
        rows = [m.split(":") for m in maps.get(key) or []]
        first = [int(h) for c, h, _ in rows if c == "0"]
        if not first:
            raise SandboxError(f"container {name} has no {key} for its root: not in a user namespace of its own")
        firsts.append(first[0])
    if firsts[0] != firsts[1] or firsts[0] == 0:
        raise SandboxError(f"container {name}'s root maps to host uid {firsts[0]} / gid {firsts[1]}")
    return firsts[0]


def cap_writes(name: str, cap_mb: int) -> str:
    """Cap what container ``name`` writes outside its binds at ``cap_mb`` MiB: a btrfs quota
    limit on its own subvolume (simple quotas: only its own writes count, not the image's), put
    on from the host before it starts. podman 4.3's ``--storage-opt size=`` cannot
    (``podmanroot.py``). Returns the note; raises SandboxError where the store is not btrfs."""
    path = _podman("mount", name).stdout.strip()
    try:
        r = subprocess.run(["btrfs", "qgroup", "limit", f"{int(cap_mb)}M", path], capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise SandboxError(f"the storage cap of {name} could not be set on {path}: "
                               f"{(r.stderr or r.stdout).strip()[-300:]}")
    finally:
        subprocess.run(["podman", "unmount", name], capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    return f"disk: the environment's own writes capped at {cap_mb} MiB (a btrfs quota group, set from the host)"


def create_owned(args: list[str], name: str, disk_mb: int | None, notes: list[str],
                 own: Callable[[int], None], what: str = "the environment", userns: str | None = None) -> int:
    """A live trial's container from its ``run -d`` arguments: created in a user namespace of its
    own (``--userns=auto``), ``own(host uid of its root)`` called (the trial chowns what the
    container writes), its writes capped at ``disk_mb``, then started. Returns that uid; the
    container is removed again if any step fails."""
    if args[:2] != ["run", "-d"]:
        raise ValueError(f"expected `run -d ...`, got {args[:2]}")
    _podman("create", f"--userns={userns or f'auto:size={CONTAINER_IDS}'}", *args[2:])
    try:
        owner = container_root(name)
        own(owner)
        if disk_mb:
            notes.append(cap_writes(name, disk_mb).replace("the environment", what))
        _podman("start", name)
    except BaseException:
        subprocess.run(["podman", "rm", "-f", "-v", name], capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
        raise
    notes.append(f"user namespace: {what}'s root is host uid {owner} (podman --userns={userns or 'auto'})")
    return owner
