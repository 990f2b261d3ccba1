"""Podman's store of our own: images and containers on a capped file system, never the host's.

Podman is daemonless: each ``podman`` command opens the store that its configuration names. Left
to its defaults, as root, that is ``/var/lib/containers/storage`` with overlay on the host's ext4
(no per-container cap possible there) and the host's own containers beside ours. This module makes
a store under a directory of its own (default ``$POLAR_HOME/podman``)::

    <root>/data.img, data/  the graph root on a loop-mounted btrfs with simple quotas
                            (``quotaroot.py``, the same as the private dockerd's data root)
    <root>/storage.conf     driver btrfs, graphroot data/storage, the auto user-namespace
                            range's user
    <root>/containers.conf  runtime runc, no container log, no event log, the ulimits below
    /run/polar/podman-<hash of root>/   runroot and libpod's tmp dir (conmon's sockets: short)

and every ``podman`` child of this process finds it through ``CONTAINERS_STORAGE_CONF`` and
``CONTAINERS_CONF`` (:meth:`PodmanRoot.env`; ``use`` sets them in ``os.environ``), as every docker
child finds the private dockerd through ``DOCKER_HOST``.

What Debian 12's podman 4.3.1 does here (measured 2026-12-07, kernel 6.18, cgroup v1 as root):

* **crun** (1.8.1, the newer runtime Debian carries) refuses every container on this host's
  cgroup layout: "crun: cgroups in hybrid mode not supported, drop all controllers from
  cgroupv2" (v1 controllers plus an empty v2 hierarchy). **runc** 1.1.5 runs them: it is the one
  named here.
* podman lowers its own RLIMIT_NPROC to 32768 and asks the runtime for nofile 1048576 and a
  larger nproc; without CAP_SYS_RESOURCE (this machine's root lacks it) runc then fails:
  "setrlimit `RLIMIT_NPROC`: Operation not permitted". So ``default_ulimits`` are the caller's
  hard nofile and min(its hard nproc, 32768).
* ``rm -f`` stops a container with SIGTERM and waits ``stop_timeout`` (10 s) before SIGKILL: a
  service whose PID 1 ignores SIGTERM (busybox httpd) took 10.3 s to remove. ``stop_timeout = 0``
  kills at once, as docker's ``rm -f`` does.
* ``podman run --storage-opt size=`` is taken as a *global* driver option by 4.3 and the btrfs
  driver refuses it ("Error: unknown option size"); ``btrfs.size`` neither exists. The cap is
  put on from the host instead (``podman.cap_writes``): ``btrfs qgroup limit`` on the
  container's own subvolume between ``podman create`` and ``start``; measured: with 64 MiB a
  ``dd`` of 200 MiB to /var stops at 64 MiB.
* ``--userns=auto`` takes its ranges from the subordinate ids of :data:`AUTO_USER` (a system
  user made here, as ``remap.py`` makes dockerd's): :data:`AUTO_COUNT` ids from
  :data:`AUTO_BASE`, i.e. 64 containers of 65536 ids at once, above dockerd's range and below
  the bubblewrap sandboxes' slots (2e9). Each container gets a range no other container of this
  store holds; the image's layers are copied once per range and kept (a btrfs snapshot, chowned).
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from polar_core import paths

#: the user whose subordinate ids ``--userns=auto`` hands out (``root-auto-userns-user``)
AUTO_USER = "polar-podman"
AUTO_BASE = int(os.environ.get("POLAR_PODMAN_UID_BASE", "1600000000"))
#: ids per container (``--userns=auto:size=``): a full 16-bit range, as the image's files
#: (``nobody`` is 65534) and dockerd's remap have
CONTAINER_IDS = 65536
AUTO_COUNT = 64 * CONTAINER_IDS
#: the OCI runtime: crun 1.8.1 refuses this host's hybrid cgroups (module docstring)
RUNTIME = "runc"
#: podman caps its own RLIMIT_NPROC at this before it starts the runtime
PODMAN_NPROC = 32768


class PodmanRootError(RuntimeError):
    """The store could not be made (the message says why)."""


def default_root() -> Path:
    return paths.polar_home() / "podman"


def ulimits() -> list[str]:
    """``default_ulimits`` no higher than this process may hand on without CAP_SYS_RESOURCE."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = PODMAN_NPROC if nproc == resource.RLIM_INFINITY else min(nproc, PODMAN_NPROC)
    nofile = 1048576 if nofile == resource.RLIM_INFINITY else nofile
    return [f"nofile={nofile}:{nofile}", f"nproc={nproc}:{nproc}"]


@dataclass
class PodmanRoot:
    """One store under ``root``; ``start()`` makes it (idempotent), ``stop()`` removes its
    containers and unmounts it."""

    root: Path
    #: the graph root on a loop-mounted btrfs of this many GiB (sparse; its total caps every
    #: image, layer and container of the store together)
    data_quota_gb: int = 32

    def __post_init__(self) -> None:
        self.root = Path(os.path.abspath(self.root))

    @property
    def storage_conf(self) -> Path:
        return self.root / "storage.conf"

    @property
    def containers_conf(self) -> Path:
        return self.root / "containers.conf"

    @property
    def run_dir(self) -> Path:
        # conmon's sockets live under it: short, whatever the root's path
        return Path("/run/polar/podman-" + hashlib.sha256(str(self.root).encode()).hexdigest()[:10])

    def env(self) -> dict[str, str]:
        return {"CONTAINERS_STORAGE_CONF": str(self.storage_conf), "CONTAINERS_CONF": str(self.containers_conf)}

    def use(self) -> None:
        """This process's podman children use this store."""
        os.environ.update(self.env())

    def configs(self) -> tuple[str, str]:
        """(storage.conf, containers.conf) as :meth:`start` writes them."""
        storage = (f'[storage]\ndriver = "btrfs"\ngraphroot = "{self.root / "data" / "storage"}"\n'
                   f'runroot = "{self.run_dir / "storage"}"\n'
                   f'[storage.options]\nroot-auto-userns-user = "{AUTO_USER}"\n'
                   f"auto-userns-min-size = {CONTAINER_IDS}\nauto-userns-max-size = {CONTAINER_IDS}\n")
        limits = ", ".join(f'"{u}"' for u in ulimits())
        containers = ('[containers]\n# no container log: a phase\'s 300 MB of stdout grew dockerd\'s json log '
                      'to 287 MiB\nlog_driver = "none"\n'
                      f"default_ulimits = [{limits}]\n"
                      f'[engine]\nruntime = "{RUNTIME}"\nevents_logger = "none"\ncgroup_manager = "cgroupfs"\n'
                      "stop_timeout = 0\n"
                      f'tmp_dir = "{self.run_dir / "libpod"}"\n')
        return storage, containers

    def start(self, install: bool = True) -> None:
        from polar_core.processes import file_lock
        from polar_trial.sandbox.dockerd import DaemonError, ensure_installed
        from polar_trial.sandbox.quotaroot import QuotaRootError, mount_data_root
        from polar_trial.sandbox.remap import RemapError, ensure_subid_user

        if os.geteuid() != 0:
            raise PodmanRootError("Polar's podman store needs root (a loop-mounted btrfs, subordinate ids)")
        self.root.mkdir(parents=True, exist_ok=True)
        with file_lock(self.root / ".start.lock"):
            try:
                if install:
                    ensure_installed(("podman", RUNTIME), "podman")
                mount_data_root(self.root, self.data_quota_gb, ensure_installed if install else None)
                ensure_subid_user(AUTO_USER, AUTO_BASE, AUTO_COUNT)
            except (DaemonError, QuotaRootError, RemapError) as e:
                raise PodmanRootError(f"podman's store under {self.root}: {e}") from None
            storage, containers = self.configs()
            for path, text in ((self.storage_conf, storage), (self.containers_conf, containers)):
                if not path.exists() or path.read_text() != text:
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(text)
                    tmp.replace(path)

    def mounted(self) -> bool:
        from polar_trial.sandbox.quotaroot import is_mounted

        return is_mounted(self.root / "data")

    def stop(self) -> None:
        """Every container of this store removed (they are ours alone), then the store unmounted."""
        from polar_trial.sandbox.quotaroot import unmount_data_root

        if shutil.which("podman") and self.mounted():
            subprocess.run(["podman", "rm", "-f", "-a", "-v"], capture_output=True, timeout=300,
                           env=dict(os.environ, **self.env()), stdin=subprocess.DEVNULL, check=False)
        unmount_data_root(self.root)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def use_private_root() -> PodmanRoot | None:
    """The store this process's podman children use: the one ``CONTAINERS_STORAGE_CONF`` names
    already (the caller's choice; None), else :func:`default_root`'s, started and named in
    ``os.environ``. Root only (rootless podman has a store of the user's own: None)."""
    if os.environ.get("CONTAINERS_STORAGE_CONF") or os.geteuid() != 0:
        return None
    r = PodmanRoot(default_root())
    r.start()
    r.use()
    return r
