"""``docker``: the same ``SandboxSpec`` on a Docker daemon, where one answers (``docker info``).

``docker run --rm --network none`` (or the default bridge with ``network=True``) on ``spec.image``
(the task's built environment: Harbor tasks ship a Dockerfile), with the work dir and HOME bound
read-write (a harness's HOME, ``spec.home_copy``, is copied into the container user's own instead,
and read back before the container goes: ``harnesshome.py``), the spec's binds, ``--pids-limit``/``--memory``/``--cpus`` (the daemon's cgroups
enforce them), /tmp and the writable binds on a disk image of ``disk_mb`` (below), all capabilities
dropped and no new privileges. The
model proxy reaches the container the same way as bubblewrap's: a job-private Unix socket bound
in, relayed to 127.0.0.1:<port> inside by the same init script; build steps and the verifier
(``spec.egress``) reach the package registries the same way too, through the filtering proxy of
``egress.py`` on a second job-private socket (the container itself has no network). The init runs
on the *host's* Python (``hostpython.py``: its interpreter, libraries and loader bound read-only at
/run/polar-host), so an image without Python, or with a Python of any version, runs every phase
alike. A timeout, or the end of the run, removes the container and every process in it
(``docker rm -f``).

A missing image is stood in for where Polar knows how (``standin.py``: debian, ubuntu, python,
built from Debian packages); every run on a stand-in says so in its notes, which the rollout
records per sample.

The storage cap (``disk_mb``), as root: /tmp, the work dir and HOME live on one loop-mounted ext4
image of that size (``diskimage.py``, as bubblewrap's), so real data past the cap fails with ENOSPC
while a sparse file of any apparent size is allowed, as on the disk of the authors' container. The
earlier tmpfs /tmp plus RLIMIT_FSIZE failed two public tasks: a test that ``truncate``s a sparse
file to the free space + 8 GiB got EFBIG (RLIMIT_FSIZE counts apparent size), and one that uploads
a 5 GiB sparse file in 1 GiB chunks into /tmp was OOM-killed (tmpfs pages count against the
container's memory cap, 4 GiB there). Without root or a loop device: tmpfs and RLIMIT_FSIZE, said.

Podman (``podman.py``) and Apptainer (``apptainer.py``) reuse this class: the same run, relay
and report, their own command line. Podman is tested live (as root, Debian 12's 4.3.1); Apptainer
is not installed here, its tests skip and say why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

from polar_trial.sandbox.base import Sandbox, SandboxError, SandboxResult, SandboxSpec, Stream, supervise
from polar_trial.sandbox import loopdev
from polar_trial.sandbox.diskimage import DiskImage
from polar_trial.sandbox.egress import EgressProxy, egress_env, egress_port
from polar_trial.sandbox.relay import UnixToTcpRelay

PRIVATE = "/run/polar-sandbox"
#: what Harbor uploads into the container rather than mounts: bound at /run/polar-copy/<name> and
#: copied to its place by the init, so a test.sh may move it (public Kotlin tasks: `mv /tests
#: /tmp/tests.hidden` while the program under test runs; on a bind: "Device or resource busy")
COPIED_IN = ("/tests", "/solution")
COPY_MOUNT = "/run/polar-copy"
#: what a phase with ``userns_caps`` (verifier, build steps) gets back: changing uid (a test.sh
#: running the tested program as nobody, apt dropping to _apt) and owning files
USERNS_CAPS = ("SETUID", "SETGID", "CHOWN", "FOWNER", "DAC_OVERRIDE")


class DockerSandbox(Sandbox):
    name = "docker"
    runtime = "docker"
    #: how the task's pids/memory/cpu limits are enforced (said in every run's notes)
    limits_by = "the daemon's cgroups"

    #: the runtime's subcommand that answers only when it can run containers, and what its
    #: failure means
    probe: tuple[str, ...] = ("info", "--format", "{{.ServerVersion}}")
    probe_failure = "no daemon answers"
    #: the init runs on the host's Python bound in (False: the image's own ``python3``)
    host_init = True
    #: a harness's HOME is copied into the image user's own, not bound (``harnesshome.py``)
    copies_home = True
    #: the task's image is built for real (``tasks/imagebuild.py``: RUN steps committed); False: RUN
    #: steps keep only the work dir and every phase runs on the base image
    builds_images = True
    #: image -> its stand-in sentence or None, looked up (and stood in) once per process
    _images: dict[str, str | None] = {}
    _images_lock = threading.Lock()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        exe = shutil.which(cls.runtime)
        if exe is None:
            return f"the {cls.runtime} CLI is not installed"
        probe = f"`{cls.runtime} {cls.probe[0]}`"
        try:
            r = subprocess.run([exe, *cls.probe], capture_output=True, text=True, timeout=20,
                               stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{probe} did not answer ({e})"
        if r.returncode != 0:
            return f"{probe} failed: {cls.probe_failure} ({(r.stderr or r.stdout).strip()[:200]})"
        return None

    def argv(self, spec: SandboxSpec, private: Path, name: str, inner: list[str],
             report_dir: Path | None = None, host_binds: list[tuple[str, str]] = (),
             staged: dict[Path, Path] | None = None, tmp_dir: Path | None = None) -> list[str]:
        """``staged``: writable binds moved onto the disk image (host -> its place there);
        ``tmp_dir``: /tmp's directory on it (None: a size-capped tmpfs)."""
        if not spec.image:
            raise SandboxError(f"the {self.runtime} sandbox needs an image (the task's environment)")
        # no capability, no new privileges, the runtime's default seccomp profile (it refuses
        # mount, keyctl, open_by_handle_at, bpf, module and clock calls), /proc/sys read-only (the
        # runtime's default); the verifier and build steps get back only what changing uid needs
        a = [self.runtime, "run", "--rm", "--name", name, "--init", "--cap-drop", "ALL",
             "--security-opt", "no-new-privileges", "--network", "bridge" if spec.network else "none",
             "--workdir", spec.workdir, "--user", f"{os.getuid()}:{os.getgid()}"]
        if spec.userns_caps:
            for cap in USERNS_CAPS:
                a += ["--cap-add", cap]
        a += limit_flags(spec.pids, spec.memory_mb, spec.cpus)
        from polar_trial.sandbox.quotaroot import size_for, storage_opt_supported

        if spec.disk_mb and storage_opt_supported(self.runtime):  # its writable layer (quotaroot.py)
            a += ["--storage-opt", size_for(spec.image, spec.disk_mb, self.runtime)]
        # exec: docker's --tmpfs is noexec unless told, and a test that builds a program into /tmp
        # and runs it (public Go tasks: `go build -o /tmp/bin`) failed with EACCES; in the real
        # image /tmp is on the image's file system, executable
        tmp = (f"size={spec.disk_mb}m" if spec.disk_mb else "size=1g") + ",exec,nosuid,nodev"
        a += ["--tmpfs", f"/tmp:{tmp}"] if tmp_dir is None else ["-v", f"{tmp_dir}:/tmp"]
        a += ["-v", f"{private}:{PRIVATE}:ro"]
        if report_dir is not None:
            a += ["-v", f"{report_dir}:/run/polar-report"]
        for host, dest in host_binds:  # the host's Python that runs the init
            a += ["-v", f"{host}:{dest}:ro"]
        for host, dest, writable in spec.mounts():
            if not host.exists():
                raise SandboxError(f"sandbox bind source {host} does not exist")
            src = (staged or {}).get(host, host) if writable else host
            if dest in COPIED_IN:
                dest = COPY_MOUNT + dest
            a += ["-v", f"{src}:{dest}" + ("" if writable else ":ro")]
        if spec.home_copy is not None:  # read by the init only, copied into the user's HOME
            from polar_trial.sandbox.harnesshome import STAGE

            a += ["-v", f"{spec.home_copy}:{STAGE}:ro"]
        for k, v in spec.env.items():
            a += ["-e", f"{k}={v}"]
        return a + ["--entrypoint", inner[0], spec.image, *inner[1:]]

    def run(self, spec: SandboxSpec, argv: list[str], *, stdout: Stream = None,
            stderr: Stream = None, commit_to: str | None = None) -> SandboxResult:
        """``commit_to``: a build step; when it exits 0 the container's file system (binds and
        /tmp excluded) is committed as that image before the container is removed."""
        spec.workdir_host.mkdir(parents=True, exist_ok=True)
        if spec.home_host is not None:
            spec.home_host.mkdir(parents=True, exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix="polar-sandbox-"))
        report_dir = Path(tempfile.mkdtemp(prefix="polar-sandbox-report-"))
        name = f"polar-{uuid.uuid4().hex[:12]}"
        relay = egress = None
        image: DiskImage | None = None
        staged: dict[Path, Path] = {}
        tmp_dir: Path | None = None
        notes: list[str] = []
        try:
            if spec.image:
                stand_in = self.image_ready(spec.image)
                if stand_in:
                    notes.append(f"STAND-IN IMAGE: {stand_in}")
            shutil.copy(Path(__file__).with_name("_init.py"), private / "init.py")
            owner = _remapped_owner(self.runtime, spec, private, report_dir)
            cfg: dict = {"report_path": "/run/polar-report/report.json"}
            env = dict(spec.env)
            if spec.proxy_port and not spec.network:
                relay = UnixToTcpRelay(private / "proxy.sock", spec.proxy_port)
                os.chmod(private / "proxy.sock", 0o666)  # the container's user connects to it
                cfg.update(proxy_port=spec.proxy_port, socket=f"{PRIVATE}/proxy.sock")
            if spec.egress and not spec.network:
                egress = EgressProxy(private / "egress.sock", spec.egress)
                os.chmod(private / "egress.sock", 0o666)
                port = egress_port(spec)
                cfg["relays"] = [[port, f"{PRIVATE}/egress.sock"]]
                env.update(egress_env(port))
            if spec.disk_mb and os.geteuid() == 0:
                try:
                    image = DiskImage(spec.disk_mb, os.getuid() if owner is None else owner)
                    staged = image.stage([h for h, _, w in spec.mounts() if w])
                    tmp_dir = image.mnt / "tmp"
                    tmp_dir.mkdir()
                    os.chmod(tmp_dir, 0o1777)
                except loopdev.LoopDeviceTimeout as exc:  # waited its turn and none came: loud
                    raise SandboxError(str(exc)) from exc
                except Exception as exc:  # noqa: BLE001 - any failure: tmpfs and RLIMIT_FSIZE, said
                    notes.append(f"disk image unavailable ({exc}): /tmp a tmpfs, files capped by RLIMIT_FSIZE")
                    if image is not None:
                        image.close()
                    image, staged, tmp_dir = None, {}, None
            if spec.disk_mb and image is None:
                cfg["fsize"] = spec.disk_mb * 1024 * 1024
            copies = [[COPY_MOUNT + d, d] for _, d, _ in spec.mounts() if d in COPIED_IN]
            if copies:
                cfg["copy_in"] = copies
            home_names: list[str] = []
            if spec.home_copy is not None:
                from polar_trial.sandbox.harnesshome import STAGE, init_config, top_names

                shutil.copy(Path(__file__).with_name("_homeinit.py"), private / "homeinit.py")
                home_names = top_names(spec.home_copy)
                cfg["home"] = init_config(spec.home_copy, STAGE)
                if owner is not None:  # a remapped root reads it (a read-back's 0600 session files)
                    from polar_trial.sandbox.remap import chown_tree

                    chown_tree(spec.home_copy, owner)
            host_binds: list[tuple[str, str]] = []
            python = ["python3"]
            if self.host_init:
                from polar_trial.sandbox.hostpython import HostPythonError, host_python

                try:
                    hp = host_python()
                except HostPythonError as e:
                    raise SandboxError(str(e)) from None
                host_binds, python = hp.binds(), hp.argv()
            inner = [*python, f"{PRIVATE}/init.py", json.dumps(cfg), "--", *argv]
            run_spec = spec if env == spec.env else _with_env(spec, env)
            cmd = self.argv(run_spec, private, name, inner, report_dir, host_binds, staged, tmp_dir)
            # kept until inspected (OOMKilled) and, for a build step, committed: the finally below removes it
            if "--rm" in cmd:  # apptainer's exec leaves no container
                cmd.remove("--rm")
            cmd = self.before_start(cmd, name, spec, private, report_dir, staged, notes)
            rc, timed_out, _, wall = supervise(cmd, env=None, cwd=None, stdout=stdout, stderr=stderr,
                                               timeout_s=spec.timeout_s)
            if commit_to and rc == 0 and not timed_out:
                c = subprocess.run([self.runtime, "commit", name, commit_to], capture_output=True, text=True,
                                   timeout=600, stdin=subprocess.DEVNULL)
                if c.returncode != 0:
                    raise SandboxError(f"`{self.runtime} commit` of the build step failed: {c.stderr.strip()[-400:]}")
            if spec.memory_mb and self.oom_killed(name):  # any process of it: measured true for a grandchild
                notes.append(f"memory limit hit: the OOM killer ended a process of the phase at {spec.memory_mb} MiB "
                             f"({self.runtime} says OOMKilled)")
            report, problem = read_report(report_dir)
            if problem:
                notes.append(problem)
            if spec.home_copy is not None:  # before the container goes: the harness's sessions
                from polar_trial.sandbox.harnesshome import home_notes

                notes += home_notes(self.runtime, name, report.get("home"), spec.home_copy, home_names,
                                    str(os.getuid()))  # the container's user: --user below
            notes += [f"{k} limit enforced by {self.limits_by}" for k, v in
                      (("pids", spec.pids), ("memory", spec.memory_mb), ("cpu", spec.cpus)) if v]
            if timed_out:
                notes.append(f"timed out after {spec.timeout_s:g} s: the container and every process in it removed")
            if report.get("leftovers"):
                notes.append(f"killed {report['leftovers']} leftover process(es) when the command exited")
            if image is not None:
                self.remove(name)  # every process of the phase gone before its writes are copied back
                used = image.used_mb()
                try:
                    image.unstage()
                except Exception as exc:  # noqa: BLE001 - the phase's files are at stake
                    raise SandboxError(f"the phase's writes could not be copied back from its disk image: {exc}") from exc
                notes.append(f"disk: /tmp, work dir and HOME capped together at {spec.disk_mb} MiB "
                             f"(a disk image; {used:.1f} MiB used; sparse files allowed)")
            if egress is not None:
                notes.append(f"package registries reachable through the filtering proxy "
                             f"({len(egress.passed)} connection(s) let through, {len(egress.refused)} refused)")
                notes += [f"egress refused: {why}" for why in egress.refused[:5]]
            else:
                notes.append("no network" if not spec.network else "network open (allow_internet)")
            special = [str(p) for p in image.special] if image is not None else []
            return SandboxResult(rc if not timed_out else -9, timed_out, notes, wall, special_files=special)
        finally:
            self.remove(name)
            if image is not None:
                image.release()
            if relay is not None:
                relay.close()
            if egress is not None:
                egress.close()
            shutil.rmtree(private, ignore_errors=True)
            shutil.rmtree(report_dir, ignore_errors=True)

    def before_start(self, cmd: list[str], name: str, spec: SandboxSpec, private: Path, report_dir: Path,
                     staged: dict[Path, Path], notes: list[str]) -> list[str]:
        """The command that runs the phase's container (``cmd``, a ``run``), given the chance to
        set it up first: podman creates it in a user namespace of its own and hands it what it
        writes (``podman.py``). Here: ``cmd`` as it is."""
        return cmd

    def image_ready(self, image: str) -> str | None:
        """Make sure ``image`` is on the daemon, standing one in where it is missing (once per
        process and image); its stand-in sentence, or None for a real image."""
        from polar_trial.sandbox.standin import StandInError, ensure_image

        with self._images_lock:
            if image not in self._images:
                try:
                    self._images[image] = ensure_image(image, runtime=self.runtime)["stand_in"]
                except StandInError as e:
                    raise SandboxError(str(e)) from None
            return self._images[image]

    def remove(self, name: str) -> None:
        """After the phase (or its timeout): the container, every process in it and its anonymous
        volumes (an image's ``VOLUME``, as ``--rm`` removed them) go."""
        subprocess.run([self.runtime, "rm", "-f", "-v", name], capture_output=True, timeout=60,
                       stdin=subprocess.DEVNULL, check=False)

    def oom_kills(self, name: str) -> int | None:
        """The OOM killer's kills so far in a running container's memory cgroup (v1
        ``memory.oom_control``, v2 ``memory.events``), None where they cannot be read. A phase
        ``docker exec``-ed into a live trial is counted by the difference: the daemon's OOMKilled
        stays false for it (measured: a grandchild of an exec killed at 64 MiB, ``oom_kill 1``)."""
        return oom_kills_of(self.runtime, name)

    def oom_killed(self, name: str) -> bool:
        """Whether the OOM killer ended any process of the container (its ``State.OOMKilled``)."""
        r = subprocess.run([self.runtime, "inspect", "--format", "{{.State.OOMKilled}}", name], capture_output=True,
                           text=True, timeout=60, stdin=subprocess.DEVNULL, check=False)
        return r.returncode == 0 and r.stdout.strip() == "true"


#: the init's report is a few dozen bytes; anything past this is not ours
REPORT_LIMIT = 64 * 1024


def read_report(report_dir: Path) -> tuple[dict, str | None]:
    """The init's report from the report dir the phase could write: (its checked fields, a note
    when it was refused). The phase runs as the same uid as the init here, so ``report.json`` may be
    anything the sample made it: a link to a host 0600 file (its text landed in the notes), to
    ``/dev/ptmx`` (a blocking open hung the worker for good) or ``/dev/zero`` (read until the host's
    memory ran out). So: no link followed, a regular file only, opened non-blocking, at most
    :data:`REPORT_LIMIT` bytes, and only the fields the host uses, each of its type."""
    from polar_trial.sandbox.hostfs import UnsafePath, read_bytes

    try:
        raw = read_bytes(report_dir, report_dir / "report.json", limit=REPORT_LIMIT + 1)
    except FileNotFoundError:
        return {}, None
    except UnsafePath as exc:
        return {}, f"the sandbox's report refused (the phase tampered with it): {exc}"
    except OSError as exc:
        return {}, f"the sandbox's report could not be read: {exc}"
    if len(raw) > REPORT_LIMIT:
        return {}, f"the sandbox's report refused: over {REPORT_LIMIT} bytes"
    try:
        data = json.loads(raw)
    except ValueError:
        return {}, "the sandbox's report refused: not JSON"
    if not isinstance(data, dict):
        return {}, "the sandbox's report refused: not a JSON object"
    out: dict = {}
    for key, kinds in (("leftovers", int), ("returncode", int), ("swept", bool), ("relay", (bool, str)),
                       ("home", str)):
        v = data.get(key)
        if isinstance(v, kinds) and (key in ("swept", "relay", "home") or not isinstance(v, bool)):
            out[key] = v[:300] if isinstance(v, str) else v
    if isinstance(out.get("leftovers"), int) and not 0 <= out["leftovers"] < 2**31:
        del out["leftovers"]
    return out, None


def _remapped_owner(runtime: str, spec: SandboxSpec, private: Path, report_dir: Path) -> int | None:
    """On a daemon that remaps user ids (``remap.py``), the host uid of the container's root: the
    phase's writable binds and the report dir are chowned to it, the private dir made readable."""
    from polar_trial.sandbox.remap import chown_tree, remapped_root

    owner = remapped_root(runtime)
    if owner is not None:
        os.chmod(private, 0o755)
        os.chown(report_dir, owner, owner)
        for host, _, writable in spec.mounts():
            if writable and host.exists():
                chown_tree(host, owner)
    return owner


def oom_kills_of(runtime: str, name: str) -> int | None:
    """:meth:`DockerSandbox.oom_kills` for any runtime's container ``name``."""
    r = subprocess.run([runtime, "inspect", "--format", "{{.State.Pid}}", name], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL, check=False)
    try:
        pid = int(r.stdout.strip())
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines() if pid > 0 else []
    except (ValueError, OSError):
        return None
    for line in lines:
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in ctrls.split(","):
            f = Path("/sys/fs/cgroup/memory" + path) / "memory.oom_control"
        elif hid == "0" and ctrls == "":
            f = Path("/sys/fs/cgroup" + path) / "memory.events"
        else:
            continue
        try:
            for row in f.read_text().splitlines():
                key, _, value = row.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            return None
    return None


def limit_flags(pids: int | None, memory_mb: int | None, cpus: float | None) -> list[str]:
    """``docker run``'s flags for the process, memory (swap included: none beyond it) and CPU
    limits, each only when set; the same for a phase, a live trial and its services."""
    a: list[str] = []
    if pids:
        a += ["--pids-limit", str(pids)]
    if memory_mb:
        a += ["--memory", f"{memory_mb}m", "--memory-swap", f"{memory_mb}m"]
    if cpus:
        a += ["--cpus", f"{cpus:g}"]
    return a


def _with_env(spec: SandboxSpec, env: dict[str, str]) -> SandboxSpec:
    import dataclasses

    return dataclasses.replace(spec, env=env)
