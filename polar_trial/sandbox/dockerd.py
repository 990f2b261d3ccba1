"""A private Docker daemon: started and stopped by Polar, for machines where none runs.

Most GPU boxes and CI runners we use run as root with no Docker daemon. Debian's ``docker.io``
installs in seconds and its ``dockerd`` runs here, but a system-wide daemon would take the host's
network (iptables rules, a ``docker0`` bridge) and ``/var/lib/docker``. This one keeps to a
directory of its own::

    <root>/data      --data-root (images, containers; overlay2)
    <root>/exec      --exec-root (containerd's state and sockets)
    <root>/docker.sock, docker.pid, dockerd.log

with ``--iptables=false --ip6tables=false --bridge=none``: it never touches the host's firewall
or interfaces, and a container gets no network but ``--network none`` (the sandbox's) or the
host's. Clients find it by ``DOCKER_HOST=unix://<root>/docker.sock`` (``polar docker env``).

Hardening: ``--userns-remap`` (``remap.py``: container uid 0 is host uid 1,500,000,000, owning
nothing here; the data root is then ``data/<uid>.<gid>``), ``--log-driver none`` (no json log
of a container's output grows on the host's disk), and the data root on a loop-mounted btrfs with
the btrfs storage driver (``quotaroot.py``), where ``--storage-opt size=`` caps each container's
writes.

``start`` is idempotent (a daemon already answering on the socket is reused) and installs
``docker.io`` with apt when ``dockerd`` is missing; ``stop`` ends the daemon it finds in the pid
file only if that process is a dockerd with this data root (never another process whose pid was
reused), SIGTERM first, SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from polar_core import paths


class DaemonError(RuntimeError):
    """The private daemon could not be started (the message says why, with its log's tail)."""


def default_root() -> Path:
    return paths.polar_home() / "dockerd"


def ensure_installed(packages: tuple[str, ...] = ("docker.io",), command: str = "dockerd") -> None:
    """``apt-get install`` the packages when ``command`` is missing (root only; nothing when present)."""
    if shutil.which(command) or Path("/usr/sbin", command).exists():
        return
    if os.getuid() != 0:
        raise DaemonError(f"{command} is not installed and this is not root: apt-get install {' '.join(packages)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:  # a stale package index: update once, then try again
        subprocess.run(["apt-get", "update"], capture_output=True, env=env, stdin=subprocess.DEVNULL)
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise DaemonError(f"apt-get install {' '.join(packages)} failed: {(r.stderr or r.stdout)[-800:]}")


def docker_cli() -> str:
    exe = shutil.which("docker")
    if exe is None:
        raise DaemonError("the docker CLI is not installed (apt-get install docker.io)")
    return exe


@dataclass
class PrivateDockerd:
    """One private daemon under ``root`` (default ``$POLAR_HOME/dockerd``)."""

    root: Path
    storage_driver: str = "overlay2"
    #: containers in a user namespace of their own (``remap.py``): their root is not the host's
    userns_remap: bool = True
    #: the data root on a loop-mounted btrfs of this many GiB, the ``btrfs`` storage driver, so that
    #: ``--storage-opt size=`` caps what a container writes outside its binds (``quotaroot.py``);
    #: None: overlay2 on the host's disk
    data_quota_gb: int | None = 32

    def __post_init__(self) -> None:
        self.root = Path(os.path.abspath(self.root))

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def pidfile(self) -> Path:
        return self.root / "docker.pid"

    @property
    def log(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def host(self) -> str:
        """The value of ``DOCKER_HOST`` that names this daemon."""
        return f"unix://{self.socket}"

    def env(self) -> dict[str, str]:
        """The caller's environment with DOCKER_HOST pointing here (for a docker CLI child)."""
        return dict(os.environ, DOCKER_HOST=self.host)

    def answers(self, timeout_s: float = 10.0) -> bool:
        if not self.socket.exists():
            return False
        try:
            r = subprocess.run([docker_cli(), "-H", self.host, "version", "--format", "{{.Server.Version}}"],
                               capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired, DaemonError):
            return False
        return r.returncode == 0

    def pid(self) -> int | None:
        """The pid in the pid file, when that process is a dockerd of this data root."""
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        if not cmdline or not cmdline[0].endswith(b"dockerd"):
            return None
        return pid if str(self.root / "data").encode() in cmdline else None

    def argv(self) -> list[str]:
        dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
        return [dockerd, "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
                "--pidfile", str(self.pidfile), "-H", self.host, "--iptables=false", "--ip6tables=false",
                "--bridge=none", "--storage-driver", self.storage_driver, "--log-level", "warn",
                # no container log kept: a phase's 300 MB of stdout grew the json log to 287 MiB;
                # Polar reads every phase's output from the CLI's own streams
                "--log-driver", "none", *self.remap_args()]

    def remap_args(self) -> list[str]:
        if not self.userns_remap:
            return []
        from polar_trial.sandbox.remap import ensure_remap_user

        return ["--userns-remap", ensure_remap_user()]

    def start(self, timeout_s: float = 90.0, install: bool = True) -> bool:
        """Start the daemon unless one already answers here; True when this call started it.
        Raises DaemonError with the log's tail when it does not answer within ``timeout_s``."""
        from polar_core.processes import file_lock

        self.root.mkdir(parents=True, exist_ok=True)
        with file_lock(self.root / ".start.lock"):
            if self.answers():
                return False
            if install:
                ensure_installed()
            if self.data_quota_gb:
                from polar_trial.sandbox.quotaroot import DRIVER, QuotaRootError, mount_data_root

                self.storage_driver = DRIVER
                try:
                    mount_data_root(self.root, self.data_quota_gb, ensure_installed)
                except QuotaRootError as e:
                    raise DaemonError(f"the data root's storage quota: {e}") from None
            if self.userns_remap:
                _traversable(self.root / "data")
            if len(str(self.root / "exec" / "containerd" / "containerd.sock")) > 100:
                raise DaemonError(f"{self.root}: too long for containerd's socket path (108 bytes); use a shorter dir")
            stale = self.pid()
            if stale is not None:  # a daemon of ours that no longer answers
                self._end(stale)
            for leftover in (self.socket, self.pidfile):
                leftover.unlink(missing_ok=True)
            with open(self.log, "ab") as log:
                proc = subprocess.Popen(self.argv(), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise DaemonError(f"dockerd exited {proc.returncode}: {self._tail()}")
                if self.answers(timeout_s=5):
                    return True
                time.sleep(0.5)
            self._end(proc.pid)
            raise DaemonError(f"dockerd did not answer on {self.socket} within {timeout_s:g} s: {self._tail()}")

    def stop(self, grace_s: float = 30.0) -> bool:
        """Stop the daemon of this root; True when one was running."""
        pid = self.pid()
        if pid is None:
            return False
        self._end(pid, grace_s)
        self.socket.unlink(missing_ok=True)
        if self.data_quota_gb:
            from polar_trial.sandbox.quotaroot import unmount_data_root

            unmount_data_root(self.root)
        return True

    def _end(self, pid: int, grace_s: float = 30.0) -> None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
                break
            time.sleep(0.2)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(pid, os.WNOHANG)  # our child (started in this process): reap it
        except ChildProcessError:
            pass

    def _tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


def _traversable(path: Path) -> None:
    """o+x (search only, never read) on ``path``'s existing parents: a remapping dockerd refuses a
    data root the remapped root cannot reach ("restricts access to the remapped root uid/gid"), and
    $POLAR_HOME under /root (0700) is one."""
    path.mkdir(parents=True, exist_ok=True)
    for p in [path, *path.parents]:
        mode = p.stat().st_mode
        if not mode & 0o001:
            os.chmod(p, mode | 0o001)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
