"""One live environment per trial, as Harbor runs it (docker and podman).

Harbor starts one environment from the task's image (its ENTRYPOINT running, the CMD replaced by
``sh -c "sleep infinity"``), runs the agent (or oracle) in it, then uploads ``tests/`` into the same
environment and runs ``test.sh`` there: the servers, packages and files the agent left are what the
tests check. Run per phase in fresh containers, public oracles that start a server with ``setsid
... &``, install nginx, or ``ssh-keygen -f ~/.ssh/id_rsa`` scored 0 where Harbor's scored 1.

:class:`LiveTrial` is that environment: ``start()`` creates the container once, with the image's
ENTRYPOINT, the task's limits (``--pids-limit``/``--memory``/``--cpus`` are per trial: every phase
shares them, except the pids and memory of a phase given its own in ``phase_pids`` and
``phase_memory_mb``: ``phasecgroup.py``) and
the most privilege any phase needs; waits for ``[environment.healthcheck]``; starts the trial's
relays (model proxy, the registries' filtering proxy) in the container's own PID namespace.
Each phase is then a ``docker exec`` of ``_trialinit.py``, which builds the phase's namespaces and
drops to the phase's user and capabilities (:meth:`view` gives the ``Sandbox`` a phase runs in, so
the rollout's harness runner and the verifier stay as they are). ``stop()`` removes the container
and everything in it.

Privileges per phase (``caps_for``): the oracle and the verifier get the package manager's
capabilities (Docker's default set, as Harbor's containers have) and the registries through the
egress filter; the agent the same unless the run denies them (``agent_privileged=False``: no
capability, no registry). Never the open internet (``network none``; the filter's allow list).

Where a phase's binds cannot be known when the container is created (the harness install, the
verifier's /logs/verifier, the uv stand-in), the host bind-mounts them under the trial's dir,
which the container sees at /run/polar-trial with slave propagation, and the phase's init binds
them at their place in the phase's own mount namespace. A harness's HOME (``spec.home_copy``) is
mounted there read-only too, for the init to copy into the agent user's passwd HOME as that user;
what the harness leaves there is read back after each agent phase (``harnesshome.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_trial.sandbox.base import Sandbox, SandboxError, SandboxResult, SandboxSpec, Stream, supervise

INSIDE = "/run/polar-trial"
#: capability numbers: Docker's default set, which Harbor's containers run with (package managers
#: chown, drop to _apt, bind low ports, chroot in postinst scripts)
PACKAGE_CAPS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6, "SETUID": 7,
                "SETPCAP": 8, "NET_BIND_SERVICE": 10, "NET_RAW": 13, "SYS_CHROOT": 18, "MKNOD": 27,
                "AUDIT_WRITE": 29, "SETFCAP": 31}
#: what our init alone holds in the container: SYS_ADMIN (a phase's namespaces and mounts) and
#: SYS_PTRACE (opening the namespaces of the environment's holder, which no phase can trace)
INIT_CAPS = ("SYS_ADMIN", "SYS_PTRACE")
#: covered in the environment's mount namespace (empty read-only tmpfs mounts, made at boot while
#: the disk is empty): our dir (the verifier's output, the phase binds), where the tests will be
#: copied, and /logs. A mount point cannot be removed where it is one, so /tests and /logs stay on
#: the shared disk for the verifier's own mounts even when the sample deleted what it could and
#: filled the rest (an rm -rf /logs and a full disk left the verifier no mount point: no verdict)
AGENT_COVERS = (INSIDE, "/tests", "/logs")
HEALTHCHECK_LIMIT_S = 300.0


class TrialError(SandboxError):
    """The trial's environment could not be started (the message says why)."""


@dataclass
class TrialConfig:
    image: str
    workdir_host: Path
    workdir: str = "/app"
    #: the trial's limits, shared by its phases
    pids: int | None = None
    memory_mb: int | None = None
    cpus: float | None = None
    disk_mb: int | None = None
    #: the model proxy's host loopback port (relayed inside at 127.0.0.1:<port>)
    proxy_port: int | None = None
    #: registries reachable through the egress filter (the phases that may use them)
    registries: tuple[str, ...] = ()
    #: the agent gets the package manager's capabilities and the registries (Harbor's default)
    agent_privileged: bool = True
    #: the agent phase reaches public hosts too (``allow_internet = true`` and the run's flag; the
    #: egress proxy's public-address rule, ``sandbox/publicnet.py``)
    agent_internet: bool = False
    #: the user the agent phase runs as (``[agent] user``; None: the image's USER, else root)
    agent_user: str | None = None
    verifier_user: str | None = None
    #: Harbor's ``[environment.healthcheck]`` (command, interval_sec, timeout_sec, retries,
    #: start_period_sec), waited on before the agent starts
    healthcheck: dict | None = None
    #: a multi-container task's services (``tasks/compose.py``'s plan, started by ``services.py`` in
    #: this container's network namespace) and how each one's image is had (present, pulled, a
    #: stand-in, or an error naming it)
    services: Any = None
    service_image: Any = None
    env: dict[str, str] = field(default_factory=dict)
    #: a phase's own pids limit under the trial's (``phasecgroup.py``: a sub-cgroup made from the
    #: host, cgroup v1), e.g. {"agent": 64}: what the agent leaves cannot hold the verifier's pids
    phase_pids: dict[str, int] = field(default_factory=dict)
    #: a phase's own memory limit in MiB under the trial's ``memory_mb``, the same way, e.g.
    #: {"agent": 2048}: what the agent leaves cannot take the verifier's memory
    phase_memory_mb: dict[str, int] = field(default_factory=dict)


def caps_for(phase: str, privileged: bool) -> list[int]:
    if phase == "agent" and not privileged:
        return []  # a run option denies the agent the package manager's privileges
    return sorted(PACKAGE_CAPS.values())


class LiveTrial:
    """``with LiveTrial(backend, cfg) as trial: trial.view("agent") ... trial.view("verifier")``."""

    def __init__(self, backend, cfg: TrialConfig):
        self.backend, self.cfg = backend, cfg
        self.runtime: str = backend.runtime
        self.name = f"polar-trial-{uuid.uuid4().hex[:12]}"
        self.dir: Path | None = None
        self.holder: int | None = None  # the agent namespaces' PID 1 (container's pid)
        self.notes: list[str] = []
        self.owner: int | None = None  # the host uid of the container's root (userns remap)
        self._relays: list = []
        self.egress = None
        self._mounted: list[Path] = []
        self._agent_binds: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._n = 0
        self._image_user: str | None = None
        self._workdir_given = False
        self._disk = None  # the work dir's disk image (``diskimage.py``), for the trial's life
        self._workdir_src: Path | None = None  # what is bound at the work dir: the image's copy
        self._cgroups: list[Path] = []  # the phases' sub-cgroups (``phase_pids``/``_memory_mb``), removed at the end
        self.services = None  # services.Services of a multi-container task
        self._owned: list[Path] = []  # the first agent phase's writable binds: the container's root owns them

    # ---- lifetime ---------------------------------------------------------------------------

    def __enter__(self) -> LiveTrial:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([self.runtime, *args], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise TrialError(f"`{self.runtime} {args[0]}` failed: {(r.stderr or r.stdout).strip()[-600:]}")
        return r

    def start(self, first: SandboxSpec | None = None) -> None:
        """Create the environment. ``first``: the first agent phase's spec, whose binds (the
        harness install, its HOME, the model proxy's CA) are the container's, seen by every
        later agent phase; binds of the verifier are made per phase."""
        from polar_trial.sandbox.egress import EgressProxy, egress_port
        from polar_trial.sandbox.hostpython import HostPythonError, host_python
        from polar_trial.sandbox.relay import UnixToTcpRelay
        from polar_trial.sandbox.remap import chown_tree, remapped_root

        cfg = self.cfg
        if first is not None and cfg.proxy_port is None:
            cfg.proxy_port = first.proxy_port
        if first is not None and first.network:
            raise TrialError("a live trial has no network but the relays: the model proxy must be on this host")
        stand_in = self.backend.image_ready(cfg.image)
        if stand_in:
            self.notes.append(f"STAND-IN IMAGE: {stand_in}")
        self.owner = remapped_root(self.runtime)
        d = Path(tempfile.mkdtemp(prefix="polar-trial-"))
        os.chmod(d, 0o755)  # the container's (remapped) root reads our scripts; it writes nothing here
        self.dir = d
        try:
            hp = host_python()
        except HostPythonError as e:
            raise TrialError(str(e)) from None
        # our dir, a shared mount of its own: what the host mounts under x/ later reaches the container
        _sh(["mount", "--bind", str(d), str(d)])
        self._mounted.append(d)
        _sh(["mount", "--make-private", str(d)])
        _sh(["mount", "--make-shared", str(d)])
        for sub in ("x", "reports"):
            (d / sub).mkdir()
        shutil.copy(Path(__file__).with_name("_init.py"), d / "init.py")
        shutil.copy(Path(__file__).with_name("_trialinit.py"), d / "trialinit.py")
        shutil.copy(Path(__file__).with_name("_homeinit.py"), d / "homeinit.py")
        cfg.workdir_host.mkdir(parents=True, exist_ok=True)
        if self.owner is not None:
            chown_tree(cfg.workdir_host, self.owner)
            os.chown(d / "reports", self.owner, self.owner)
        self._workdir_src = self._stage_workdir()
        self._python = [*hp.argv(), f"{INSIDE}/trialinit.py"]
        inspect = self.docker("image", "inspect", "--format", "{{json .Config}}", cfg.image)
        conf = json.loads(inspect.stdout or "{}") or {}
        self._image_user = (conf.get("User") or "").split(":")[0] or None
        # The container's PID 1 is our init (its ``boot``): the image's ENTRYPOINT runs under it with
        # Harbor's command, in the environment's namespaces, with the phase capabilities only
        entry = list(conf.get("Entrypoint") or [])
        boot = {"mode": "boot", "argv": entry + ["sh", "-c", "sleep infinity"], "caps": caps_for("oracle", True),
                "user": self._image_user or "0", "workdir": conf.get("WorkingDir") or "/",
                "covers": list(AGENT_COVERS), "report_path": f"{INSIDE}/reports/boot.json"}
        a = ["run", "-d", "--name", self.name, "--cap-drop", "ALL",
             "--security-opt", "no-new-privileges", "--network", "none", "--user", "0:0",
             "--workdir", cfg.workdir, "--log-driver", "none"]
        # the phases' set, and INIT_CAPS for our init alone (it builds each phase's namespaces and
        # drops them; in the container's own user namespace where the daemon remaps)
        for cap in [*PACKAGE_CAPS, *INIT_CAPS]:
            a += ["--cap-add", cap]
        from polar_trial.sandbox.docker import limit_flags

        a += limit_flags(cfg.pids, cfg.memory_mb, cfg.cpus)
        a += ["--tmpfs", f"/tmp:size={cfg.disk_mb or 1024}m,exec,nosuid,nodev"]
        from polar_trial.sandbox.quotaroot import size_for, storage_opt_supported

        if cfg.disk_mb and storage_opt_supported(self.runtime):  # what it writes outside its binds
            a += ["--storage-opt", size_for(cfg.image, cfg.disk_mb, self.runtime)]
            self.notes.append(f"disk: the environment's own writes capped at {cfg.disk_mb} MiB (a btrfs quota group)")
        # our dir read-only (its scripts run privileged), the reports' dir writable by our init
        a += ["-v", f"{self._workdir_src}:{cfg.workdir}", "-v", f"{d}:{INSIDE}:ro,rslave",
              "-v", f"{d / 'reports'}:{INSIDE}/reports"]
        for host, dest in hp.binds():
            a += ["-v", f"{host}:{dest}:ro"]
        for host, dest, rw in (first.mounts() if first is not None else []):
            if (host, dest) == (cfg.workdir_host, cfg.workdir):
                continue
            from polar_trial.sandbox.docker import COPIED_IN

            if dest in COPIED_IN:
                continue
            if rw:
                self._owned.append(host)
                if self.owner is not None:
                    chown_tree(host, self.owner)
            a += ["-v", f"{host}:{dest}" + ("" if rw else ":ro")]
            self._agent_binds.add((str(host), dest))
        for svc in (cfg.services.names if cfg.services else []):
            a += ["--add-host", f"{svc}:127.0.0.1"]  # its services share this network namespace
        for k, v in cfg.env.items():
            a += ["-e", f"{k}={v}"]
        a += ["--entrypoint", self._python[0], cfg.image, *self._python[1:], json.dumps(boot)]
        if getattr(self.backend, "userns_per_container", False):  # podman: its root's uid known once created
            from polar_trial.sandbox.podman import create_owned

            self.owner = create_owned(a, self.name, cfg.disk_mb, self.notes, self._own)
        else:
            self.docker(*a)
        self._wait_running()
        boot_report = self.dir / "reports" / "boot.json"
        deadline = time.monotonic() + 30
        while not _read_json(boot_report) and time.monotonic() < deadline:
            time.sleep(0.05)
        rep = _read_json(boot_report)
        if not rep.get("ok") or not isinstance(rep.get("holder"), int):
            raise TrialError(f"the environment's namespaces could not be made: {rep.get('error') or 'no report'}")
        self.holder = rep["holder"]
        relays = []
        if cfg.proxy_port:
            r = UnixToTcpRelay(d / "proxy.sock", cfg.proxy_port)
            self._relays.append(r)
            relays.append([cfg.proxy_port, f"{INSIDE}/proxy.sock"])
        self.egress_port = egress_port(SandboxSpec(workdir_host=cfg.workdir_host, proxy_port=cfg.proxy_port))
        if cfg.registries:
            self.egress = EgressProxy(d / "egress.sock", ())  # opened per phase (``_phase_egress``)
            self._relays.append(self.egress)
            relays.append([self.egress_port, f"{INSIDE}/egress.sock"])
        for sock in ("proxy.sock", "egress.sock"):
            if (d / sock).exists():
                os.chmod(d / sock, 0o666)  # the container's (remapped) root connects
        if relays:
            self.docker("exec", "-d", "--user", "0:0", self.name, *self._python,
                        json.dumps({"mode": "relay", "relays": relays}))
        if cfg.services:  # in this container's network namespace; main's depends_on holds before the agent
            from polar_trial.sandbox.services import ServiceError, Services

            self.services = Services(self.runtime, cfg.services, cfg.service_image, caps=list(PACKAGE_CAPS),
                                     pids=cfg.pids, memory_mb=cfg.phase_memory_mb.get("agent") or cfg.memory_mb,
                                     cpus=cfg.cpus, disk_mb=cfg.disk_mb)
            try:
                self.services.start(self.name)
                self.services.wait(cfg.services.main_depends_on, "the agent")
            except (ServiceError, SandboxError, ValueError) as exc:  # ValueError: an image unreachable here
                raise TrialError(str(exc)) from None
            finally:
                self.notes += self.services.notes
        if cfg.healthcheck:
            self._healthcheck(cfg.healthcheck)

    def _own(self, owner: int) -> None:
        """What the container's root writes, owned by it, where its uid is known only once the
        container exists (podman's ``--userns=auto``): the work dir (its disk image's copy), our
        reports dir, the first agent phase's writable binds."""
        from polar_trial.sandbox.remap import chown_tree

        assert self.dir is not None
        if self._disk is not None:
            self._disk.uid = owner
            chown_tree(self._disk.mnt, owner)
        else:
            chown_tree(self.cfg.workdir_host, owner)
        os.chown(self.dir / "reports", owner, owner)
        for host in self._owned:
            chown_tree(host, owner)

    def _wait_running(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = self.docker("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", self.name, check=False)
            state = r.stdout.split()
            if state and state[0] == "running":
                return
            if state and state[0] in ("exited", "dead"):
                raise TrialError(f"the environment exited (code {state[1]}) as it started: its ENTRYPOINT "
                                 "did not keep running (Harbor's command is `sh -c \"sleep infinity\"`)")
            time.sleep(0.2)
        raise TrialError(f"the environment was not running after {timeout_s:g} s")

    def _healthcheck(self, hc: dict) -> None:
        """Harbor's rule: run the command until it passes; failures during ``start_period_sec``
        do not count; ``retries`` consecutive failures after it fail the trial."""
        cmd = str(hc["command"])
        interval = float(hc.get("interval_sec", 5.0))
        start_interval = float(hc.get("start_interval_sec", interval))
        per = float(hc.get("timeout_sec", 30.0))
        retries = int(hc.get("retries", 3))
        t0 = time.monotonic()
        grace = t0 + float(hc.get("start_period_sec", 0.0))
        failures = 0
        while time.monotonic() - t0 < HEALTHCHECK_LIMIT_S:
            rc = self._exec_plain(["sh", "-c", cmd], timeout=per)
            if rc == 0:
                self.notes.append(f"healthcheck passed after {time.monotonic() - t0:.1f} s")
                return
            in_grace = time.monotonic() < grace
            if not in_grace:
                failures += 1
                if failures >= retries:
                    raise TrialError(f"the environment's healthcheck failed {failures} time(s) (`{cmd}`)")
            time.sleep(start_interval if in_grace else interval)
        raise TrialError(f"the environment's healthcheck did not pass within {HEALTHCHECK_LIMIT_S:g} s")

    def _exec_plain(self, argv: list[str], timeout: float) -> int:
        # in the environment's namespaces, as Harbor execs it into the main container: what it
        # starts lives beside the ENTRYPOINT's processes, never in our init's namespace
        cfg = {"mode": "agent", "join": self.holder, "caps": caps_for("verifier", True), "user": "0",
               "workdir": self.cfg.workdir}
        try:
            r = subprocess.run([self.runtime, "exec", "--user", "0:0", self.name, *self._python, json.dumps(cfg),
                                "--", *argv], capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return -9
        return r.returncode

    def _stage_workdir(self) -> Path:
        """The work dir on a disk image of ``disk_mb`` for the trial's life (root only; as the
        per-phase backends cap it): a write past the cap fails with ENOSPC. Copied back to the
        host by :meth:`sync_workdir` and at the end."""
        from polar_trial.sandbox.diskimage import DiskImage

        cfg = self.cfg
        if not cfg.disk_mb or os.geteuid() != 0:
            return cfg.workdir_host
        try:
            self._disk = DiskImage(cfg.disk_mb, self.owner if self.owner is not None else os.getuid())
            src = self._disk.stage([cfg.workdir_host])[cfg.workdir_host]
        except Exception as exc:  # noqa: BLE001 - any failure: the host dir, uncapped, said
            if self._disk is not None:
                self._disk.close()
            self._disk = None
            self.notes.append(f"work dir uncapped: its disk image is unavailable ({exc})")
            return cfg.workdir_host
        self.notes.append(f"disk: the work dir capped at {cfg.disk_mb} MiB (a disk image, for the trial)")
        return src

    def sync_workdir(self) -> None:
        """The work dir as the phases left it, copied back to the host (before the host reads it
        while the trial still runs: a separate verifier's artifacts)."""
        if self._disk is not None:
            self._disk.unstage()
            self._disk.unstaged = False  # copied back again at the end

    def stop(self) -> None:
        if self.services is not None:
            self.services.stop()
        try:
            subprocess.run([self.runtime, "rm", "-f", "-v", self.name], capture_output=True, timeout=120,
                           stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            # a loaded daemon: the container is killed first (SIGKILL to every process), then removed
            # once more; a sample's end must never raise out of the rollout
            for args in (["kill", self.name], ["rm", "-f", "-v", self.name]):
                try:
                    subprocess.run([self.runtime, *args], capture_output=True, timeout=300,
                                   stdin=subprocess.DEVNULL, check=False)
                except subprocess.TimeoutExpired:
                    self.notes.append(f"the daemon did not remove container {self.name} in time")
        from polar_trial.sandbox import phasecgroup

        for sub in self._cgroups:
            phasecgroup.remove(sub)
        self._cgroups.clear()
        if self._disk is not None:  # every process gone: the work dir copied back, the image removed
            self._disk.release()
            self._disk = None
        for r in self._relays:
            r.close()
        self._relays.clear()
        for m in reversed(self._mounted):
            subprocess.run(["umount", "-l", str(m)], capture_output=True, check=False)
        self._mounted.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # ---- phases -----------------------------------------------------------------------------

    def view(self, phase: str, *, passwd_home: bool = False) -> TrialSandbox:
        """The ``Sandbox`` one phase (``agent`` or ``verifier``) runs in: the rollout passes it
        where it passed the backend. ``passwd_home``: HOME is the phase user's home from the
        image's /etc/passwd (the oracle, nop), not the spec's (a harness's prepared config)."""
        return TrialSandbox(self, phase, passwd_home)

    def _host_bind(self, host: Path, writable: bool) -> str:
        """``host`` mounted under the trial's x/ (read-only unless ``writable``); its path inside."""
        assert self.dir is not None
        with self._lock:
            self._n += 1
            k = self._n
        target = self.dir / "x" / str(k)
        if host.is_dir():
            target.mkdir()
        else:
            target.touch()
        _sh(["mount", "--bind", str(host), str(target)])
        self._mounted.append(target)
        if not writable:
            _sh(["mount", "-o", "remount,bind,ro", str(target)])
        return f"{INSIDE}/x/{k}"

    def run_phase(self, phase: str, spec: SandboxSpec, argv: list[str], *, stdout: Stream, stderr: Stream,
                  passwd_home: bool) -> SandboxResult:
        from polar_trial.sandbox import phasecgroup
        from polar_trial.sandbox.docker import COPIED_IN
        from polar_trial.sandbox.egress import egress_env
        from polar_trial.sandbox.remap import chown_tree

        if self.dir is None:
            self.start(spec if phase == "agent" else None)
        assert self.dir is not None and self.holder is not None
        cfg = self.cfg
        notes = list(self.notes)
        binds, copies = [], []
        for host, dest, rw in spec.mounts():
            if (host, dest) == (cfg.workdir_host, cfg.workdir):
                continue
            if not host.exists():
                raise SandboxError(f"sandbox bind source {host} does not exist")
            if phase == "agent" and (str(host), dest) in self._agent_binds:
                continue  # one of the container's binds
            if rw and self.owner is not None:
                chown_tree(host, self.owner)
            inside = self._host_bind(host, rw)
            if dest in COPIED_IN:
                copies.append([inside, dest])
            elif phase == "agent":
                notes.append(f"bind {dest} not made: an agent phase sees the binds its trial started with")
            else:
                binds.append([inside, dest])
        home_cfg, home_names = None, []
        if spec.home_copy is not None and phase == "agent":  # read by our init, copied into the user's HOME
            from polar_trial.sandbox.harnesshome import init_config, top_names

            home_names = top_names(spec.home_copy)
            if self.owner is not None:  # the container's remapped root reads it
                chown_tree(spec.home_copy, self.owner)
            home_cfg = init_config(spec.home_copy, self._host_bind(spec.home_copy, False))
        privileged = phase != "agent" or cfg.agent_privileged
        env = dict(spec.env)
        if self.egress is not None:
            from polar_trial.sandbox.publicnet import PUBLIC

            internet = phase == "agent" and cfg.agent_internet
            self.egress.allow = (tuple(cfg.registries) if privileged else ()) + ((PUBLIC,) if internet else ())
            if self.egress.allow:
                env.update(egress_env(self.egress_port))
                if cfg.services:  # its services are on this loopback, never behind the proxy
                    for k in ("NO_PROXY", "no_proxy"):
                        env[k] = ",".join([env[k], *cfg.services.names])
        user = (cfg.agent_user if phase == "agent" else cfg.verifier_user) or self._image_user or "0"
        if phase == "agent" and user not in ("0", "root") and not self._workdir_given:
            self._give_workdir(user)
        rid = uuid.uuid4().hex[:12]
        report = self.dir / "reports" / f"{rid}.json"
        cgroups = self._phase_cgroups(phase, rid, notes)
        init_cfg = {"mode": phase, "join": self.holder, "binds": binds, "copy_in": copies, "covers": [INSIDE],
                    "cgroups": cgroups, "oom_score_adj": phasecgroup.score_adj(self._cgroups, phase),
                    "caps": caps_for(phase, privileged), "user": user, "passwd_home": passwd_home, "home": home_cfg,
                    "workdir": spec.workdir, "report_path": f"{INSIDE}/reports/{rid}.json"}
        cmd = [self.runtime, "exec", "--user", "0:0", "--workdir", "/"]
        for k, v in env.items():
            cmd += ["-e", f"{k}={v}"]
        cmd += [self.name, *self._python, json.dumps(init_cfg), "--", *argv]
        from polar_trial.sandbox.docker import oom_kills_of

        oom_before = oom_kills_of(self.runtime, self.name) if cfg.memory_mb else None
        own_before = phasecgroup.oom_snapshot(self._cgroups)
        try:
            rc, timed_out, _, wall = supervise(cmd, env=None, cwd=None, stdout=stdout, stderr=stderr,
                                               timeout_s=spec.timeout_s)
            rep = _read_json(report)
            if timed_out:
                # the agent's command and its session go (what left the session stays, as a server
                # the agent started would); the verifier's namespace ends with its PID 1
                pid = rep.get("session") if phase == "agent" else rep.get("holder")
                if isinstance(pid, int):
                    self._sweep(pid, everything=phase != "agent")
                notes.append(f"timed out after {spec.timeout_s:g} s: the phase's processes killed")
            elif isinstance(rep.get("returncode"), int):
                rc = rep["returncode"] if rep["returncode"] >= 0 else rc
        finally:
            self._unmount_phase()
        if home_cfg is not None:  # the harness's sessions, for the run dir
            from polar_trial.sandbox.harnesshome import home_notes

            notes += home_notes(self.runtime, self.name, rep.get("home"), spec.home_copy, home_names, user)
        oom_after = oom_kills_of(self.runtime, self.name) if oom_before is not None else None
        if oom_before is not None and oom_after is not None and oom_after > oom_before:
            notes.append(f"memory limit hit: the OOM killer ended {oom_after - oom_before} process(es) of the "
                         f"{phase} phase at the trial's {cfg.memory_mb} MiB")
        notes += phasecgroup.oom_notes(phase, own_before, phasecgroup.oom_snapshot(self._cgroups),
                                       cfg.phase_memory_mb, cfg.memory_mb)
        notes.append(f"live trial {self.name}: {phase} phase "
                     + ("in the environment's namespaces" if phase == "agent" else
                        "in PID and mount namespaces of its own")
                     + f", user {user}, {len(caps_for(phase, privileged))} capabilities")
        notes.append(f"pids/memory/cpu limits per trial ({self.backend.limits_by}), shared by its phases"
                     + (" but for the phases' own (sub-cgroups)" if self._cgroups else ""))
        if self.egress is not None:
            if phase == "agent" and cfg.agent_internet:
                notes.append("public hosts reachable through the filtering proxy (allow_internet and the run's flag)")
            notes.append("package registries reachable through the filtering proxy" if privileged
                         else "no package registry (the run denies the agent privileges)")
        return SandboxResult(rc if not timed_out else -9, timed_out, notes, wall)

    def _phase_cgroups(self, phase: str, rid: str, notes: list[str]) -> list[str]:
        """The phase's own pids and memory limits (``cfg.phase_pids``, ``cfg.phase_memory_mb``):
        sub-cgroups of the container's, made here once per phase name (``rid`` unused), bound into
        our dir; their paths inside, for the init to join. None where none is asked or the host has
        no cgroup v1 hierarchy of that controller for the container (said in the notes)."""
        from polar_trial.sandbox import phasecgroup

        out = []
        for controller, what, limit in (("pids", "pids limit", self.cfg.phase_pids.get(phase)),
                                        ("memory", "memory limit", self.cfg.phase_memory_mb.get(phase))):
            if not limit:
                continue
            shown = f"{limit} MiB" if controller == "memory" else str(limit)
            base = phasecgroup.container_cgroup(self.runtime, self.name, controller)
            why = "the container's cgroup is not a v1 hierarchy this host can write"
            # one per phase name for the trial: an agent's later turns share the first's (and its leftovers')
            sub = None if base is None else next(
                (c for c in self._cgroups if c.parent == base and c.name == f"polar-{phase}"), None)
            if sub is None and base is not None:
                try:
                    sub = phasecgroup.make(base, f"polar-{phase}", controller, limit, self.owner)
                    self._cgroups.append(sub)
                except OSError as exc:
                    why = str(exc)
            if sub is None:
                notes.append(f"no {what} of the {phase} phase's own ({why}): the trial's limit holds"
                             + (self._memory_back_to(limit) if controller == "memory" else ""))
                continue
            notes.append(f"the {phase} phase's own {what}: {shown}, under the trial's (a sub-cgroup made from the host)")
            out.append(self._host_bind(sub, writable=True))
        return out

    def _memory_back_to(self, limit: int) -> str:
        """The container's memory limit lowered to the phase's own ``limit`` (it was made with the
        verifier's room on top, for a sub-cgroup that could not be made), so that no phase gets
        more than the task's memory; the note's tail."""
        if self.cfg.memory_mb == limit:
            return ""
        r = self.docker("update", "--memory", f"{limit}m", "--memory-swap", f"{limit}m", self.name, check=False)
        if r.returncode != 0:
            return f", at {self.cfg.memory_mb} MiB (lowering it failed: {(r.stderr or r.stdout).strip()[-200:]})"
        self.cfg.memory_mb = limit
        return f", lowered to the phase's {limit} MiB"

    def _give_workdir(self, user: str) -> None:
        """The work dir to a non-root agent user (``[agent] user``, the image's USER), once: the
        task's Dockerfile chowned its WORKDIR to that user, which the copy out of the build does not
        keep. Its uid and gid are the image's (``id``), shifted into the remapped range."""
        from polar_trial.sandbox.remap import chown_tree

        self._workdir_given = True
        ids = []
        for flag in ("-u", "-g"):
            r = subprocess.run([self.runtime, "exec", "--user", "0:0", self.name, "id", flag, user],
                               capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            if r.returncode != 0 or not r.stdout.strip().isdigit():
                self.notes.append(f"work dir left to root: the image does not know user {user!r}")
                return
            ids.append(int(r.stdout.strip()))
        base = self.owner or 0
        chown_tree(self._workdir_src or self.cfg.workdir_host, base + ids[0], base + ids[1])
        self.notes.append(f"work dir owned by {user} ({ids[0]}:{ids[1]}), the agent's user")

    def _unmount_phase(self) -> None:
        assert self.dir is not None
        keep = []
        for m in self._mounted:
            if m.parent == self.dir / "x":
                subprocess.run(["umount", "-l", str(m)], capture_output=True, check=False)
            else:
                keep.append(m)
        self._mounted = keep

    def _sweep(self, pid: int, everything: bool) -> None:
        cfg = {"mode": "sweep", "pid": pid, "all": everything}
        try:
            subprocess.run([self.runtime, "exec", "--user", "0:0", self.name, *self._python, json.dumps(cfg)],
                           capture_output=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:  # a loaded daemon: the trial's end removes the container anyway
            self.notes.append(f"the sweep of a timed-out phase did not answer in 60 s (pid {pid})")


class TrialSandbox(Sandbox):
    """One phase's view of a live trial: ``run`` execs the phase in the trial's environment."""

    isolates = True

    def __init__(self, trial: LiveTrial, phase: str, passwd_home: bool = False):
        self.trial, self.phase, self.passwd_home = trial, phase, passwd_home
        self.name = trial.backend.name
        self.builds_images = getattr(trial.backend, "builds_images", False)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def run(self, spec: SandboxSpec, argv: list[str], *, stdout: Stream = None,
            stderr: Stream = None) -> SandboxResult:
        return self.trial.run_phase(self.phase, spec, argv, stdout=stdout, stderr=stderr,
                                    passwd_home=self.passwd_home)


def _sh(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise TrialError(f"{' '.join(argv)} failed: {r.stderr.strip()}")


def _read_json(path: Path) -> dict:
    """A report of our init's, read as any file of a dir a container can write: no link followed,
    no FIFO or device opened (a blocking open hung the worker for good), at most 64 KiB."""
    from polar_trial.sandbox.hostfs import read_bytes

    try:
        data = json.loads(read_bytes(path.parent, path, limit=65536))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def task_healthcheck(task) -> dict | None:
    """``[environment.healthcheck]`` of a Harbor task's task.toml (a table with ``command``), or None."""
    import tomllib

    root = getattr(task, "root", None)
    if root is None or not (Path(root) / "task.toml").is_file():
        return None
    try:
        data = tomllib.loads((Path(root) / "task.toml").read_text())
    except (OSError, ValueError):
        return None
    hc = (data.get("environment") or {}).get("healthcheck")
    return hc if isinstance(hc, dict) and isinstance(hc.get("command"), str) else None


def separate_verifier(backend, cfg: TrialConfig, sample_workdir: Path, fresh_workdir, artifacts: list,
                      vwork: Path, trial: LiveTrial | None = None) -> LiveTrial:
    """Harbor's ``[verifier] environment_mode = "separate"``: a fresh environment from the task's
    image whose work dir ``vwork`` is the task's built one (``fresh_workdir(vwork)`` makes it) with
    only ``artifacts`` (paths in the work dir) copied in from the sample's; nothing else the agent
    did reaches the verifier (an image's pytest it replaced, a server it left). With no artifacts
    (a run that forces separation on a task that declares none) the sample's whole work dir."""
    import dataclasses
    import posixpath

    from polar_trial.sandbox.hostfs import copy_tree

    if vwork.exists():
        shutil.rmtree(vwork)
    if trial is not None:
        trial.sync_workdir()
    if artifacts:
        fresh_workdir(vwork)
        for a in artifacts:
            rel = posixpath.relpath(posixpath.normpath(posixpath.join(cfg.workdir, a)), cfg.workdir)
            src, dst = sample_workdir / rel, vwork / rel
            if rel.startswith("..") or not (src.exists() or src.is_symlink()):
                continue
            if src.is_dir() and not src.is_symlink():
                copy_tree(src, dst)
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                copy_tree(src.parent, dst.parent, ignore=lambda r, n=src.name: r.split("/")[0] != n)
    else:
        copy_tree(sample_workdir, vwork)
    return LiveTrial(backend, dataclasses.replace(cfg, workdir_host=vwork, agent_user=None))


def uses_live_trial(backend) -> bool:
    """Whether a backend runs a trial as one live environment (docker, podman)."""
    return getattr(backend, "runtime", None) in ("docker", "podman") and getattr(backend, "host_init", False)
