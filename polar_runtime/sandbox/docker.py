"""``docker``: the same ``SandboxSpec`` on a Docker daemon, where one answers (``docker info``).

``docker run --rm --network none`` (or the default bridge with ``network=True``) on ``spec.image``
(the task's built environment: Harbor tasks ship a Dockerfile), with the work dir and HOME bound
read-write, the spec's binds, ``--pids-limit``/``--memory``/``--cpus`` (the daemon's cgroups
enforce them), a size-capped tmpfs /tmp, all capabilities dropped and no new privileges. The
model proxy reaches the container the same way as bubblewrap's: a job-private Unix socket bound
in, relayed to 127.0.0.1:<port> inside by the same init script (the image needs a ``python3``).
A timeout, or the end of the run, removes the container and every process in it (``docker rm -f``).

Podman (``podman.py``) and Apptainer (``apptainer.py``) reuse this class: the same run, relay
and report, their own command line. Not tested on this machine (no daemon, no podman or apptainer
installed); their tests skip and say why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from polar_runtime.sandbox.base import Sandbox, SandboxError, SandboxResult, SandboxSpec, Stream, supervise
from polar_runtime.sandbox.relay import UnixToTcpRelay

PRIVATE = "/run/polar-sandbox"
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
             report_dir: Path | None = None) -> list[str]:
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
        if spec.pids:
            a += ["--pids-limit", str(spec.pids)]
        if spec.memory_mb:
            a += ["--memory", f"{spec.memory_mb}m", "--memory-swap", f"{spec.memory_mb}m"]
        if spec.cpus:
            a += ["--cpus", f"{spec.cpus:g}"]
        tmp = (f"size={spec.disk_mb}m" if spec.disk_mb else "size=1g") + ",nosuid,nodev"
        a += ["--tmpfs", f"/tmp:{tmp}", "-v", f"{private}:{PRIVATE}:ro"]
        if report_dir is not None:
            a += ["-v", f"{report_dir}:/run/polar-report"]
        for host, dest, writable in spec.mounts():
            if not host.exists():
                raise SandboxError(f"sandbox bind source {host} does not exist")
            a += ["-v", f"{host}:{dest}" + ("" if writable else ":ro")]
        for k, v in spec.env.items():
            a += ["-e", f"{k}={v}"]
        return a + ["--entrypoint", inner[0], spec.image, *inner[1:]]

    def run(self, spec: SandboxSpec, argv: list[str], *, stdout: Stream = None,
            stderr: Stream = None) -> SandboxResult:
        spec.workdir_host.mkdir(parents=True, exist_ok=True)
        if spec.home_host is not None:
            spec.home_host.mkdir(parents=True, exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix="polar-sandbox-"))
        report_dir = Path(tempfile.mkdtemp(prefix="polar-sandbox-report-"))
        name = f"polar-{uuid.uuid4().hex[:12]}"
        relay = None
        notes: list[str] = []
        try:
            shutil.copy(Path(__file__).with_name("_init.py"), private / "init.py")
            cfg: dict = {"report_path": "/run/polar-report/report.json"}
            if spec.proxy_port and not spec.network:
                relay = UnixToTcpRelay(private / "proxy.sock", spec.proxy_port)
                os.chmod(private / "proxy.sock", 0o666)  # the container's user connects to it
                cfg.update(proxy_port=spec.proxy_port, socket=f"{PRIVATE}/proxy.sock")
            if spec.disk_mb:
                cfg["fsize"] = spec.disk_mb * 1024 * 1024
            cmd = self.argv(spec, private, name, ["python3", f"{PRIVATE}/init.py", json.dumps(cfg), "--", *argv],
                            report_dir)
            rc, timed_out, _, wall = supervise(cmd, env=None, cwd=None, stdout=stdout, stderr=stderr,
                                               timeout_s=spec.timeout_s)
            report = {}
            try:
                report = json.loads((report_dir / "report.json").read_text())
            except (OSError, ValueError):
                pass
            notes += [f"{k} limit enforced by {self.limits_by}" for k, v in
                      (("pids", spec.pids), ("memory", spec.memory_mb), ("cpu", spec.cpus)) if v]
            if timed_out:
                notes.append(f"timed out after {spec.timeout_s:g} s: the container and every process in it removed")
            if report.get("leftovers"):
                notes.append(f"killed {report['leftovers']} leftover process(es) when the command exited")
            notes.append("no network" if not spec.network else "network open (allow_internet)")
            return SandboxResult(rc if not timed_out else -9, timed_out, notes, wall)
        finally:
            self.remove(name)
            if relay is not None:
                relay.close()
            shutil.rmtree(private, ignore_errors=True)
            shutil.rmtree(report_dir, ignore_errors=True)

    def remove(self, name: str) -> None:
        """After the phase (or its timeout): the container and every process in it go."""
        subprocess.run([self.runtime, "rm", "-f", name], capture_output=True, timeout=60,
                       stdin=subprocess.DEVNULL, check=False)
