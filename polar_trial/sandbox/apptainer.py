"""``apptainer``: the same ``SandboxSpec`` with Apptainer (formerly Singularity), the container
runtime of HPC clusters, where Docker daemons are not allowed.

``apptainer exec --containall --cleanenv --no-home --net --network none`` on the task's image:
``docker://<base image>`` (Apptainer converts it and caches the SIF), or a local ``.sif`` file or
sandbox directory given as the image. ``--containall`` gives the phase its own PID and IPC
namespaces and a private /tmp and /dev, and keeps the host's HOME and environment out; the work
dir and HOME are bound read-write, the spec's other binds as asked; ``--network none`` leaves only
loopback, where the init script relays 127.0.0.1:<proxy port> to the job-private Unix socket bound
in, as with bubblewrap and docker. The task's pids/memory/cpu limits are passed as
``--pids-limit``/``--memory``/``--cpus`` (Apptainer 1.1+, cgroup v2; without a delegated cgroup
Apptainer refuses the run rather than ignore them). A timeout kills the process group; the PID
namespace ends with it, taking every process of the phase along.

What differs from docker: the container's root file system is read-only (SIF) and processes run
as the caller (no uid mapping needed for the binds). Not tested on this machine (apptainer is not
installed, and Debian 12 does not package it); its tests skip and say why.
"""

from __future__ import annotations

import os
from pathlib import Path

from polar_trial.sandbox.base import SandboxError, SandboxSpec
from polar_trial.sandbox.docker import PRIVATE, DockerSandbox


class ApptainerSandbox(DockerSandbox):
    name = "apptainer"
    runtime = "apptainer"
    limits_by = "apptainer's cgroup (--pids-limit/--memory/--cpus)"

    probe = ("version",)
    probe_failure = "apptainer does not run here"
    host_init = False  # the image's own python3 runs the init (not tested here: no apptainer)
    builds_images = False  # no daemon to commit into: RUN steps keep the work dir only
    copies_home = False  # exec leaves no container to read a HOME back from: the host HOME is bound

    @staticmethod
    def image_uri(image: str) -> str:
        """A local SIF file or sandbox directory as it is; a registry reference as docker://."""
        if "://" in image or image.endswith(".sif") or os.path.isdir(image):
            return image
        return f"docker://{image}"

    def argv(self, spec: SandboxSpec, private: Path, name: str, inner: list[str],
             report_dir: Path | None = None, host_binds: list[tuple[str, str]] = ()) -> list[str]:
        if not spec.image:
            raise SandboxError("the apptainer sandbox needs an image (the task's environment)")
        a = [self.runtime, "exec", "--containall", "--cleanenv", "--no-home", "--no-init"]
        if not spec.userns_caps:
            a.append("--no-privs")  # root keeps no capability in the container (Apptainer: root only)
        if not spec.network:
            a += ["--net", "--network", "none"]
        if spec.pids:
            a += ["--pids-limit", str(spec.pids)]
        if spec.memory_mb:
            a += ["--memory", f"{spec.memory_mb}M", "--memory-swap", f"{spec.memory_mb}M"]
        if spec.cpus:
            a += ["--cpus", f"{spec.cpus:g}"]
        a += ["--bind", f"{private}:{PRIVATE}:ro"]
        if report_dir is not None:
            a += ["--bind", f"{report_dir}:/run/polar-report"]
        for host, dest, writable in spec.mounts():
            if not host.exists():
                raise SandboxError(f"sandbox bind source {host} does not exist")
            a += ["--bind", f"{host}:{dest}:{'rw' if writable else 'ro'}"]
        for k, v in spec.env.items():
            a += ["--env", f"{k}={v}"]
        return a + ["--pwd", spec.workdir, self.image_uri(spec.image), *inner]

    def image_ready(self, image: str) -> str | None:
        """Apptainer pulls or opens the image itself (no stand-ins: it has no daemon to import into)."""
        return None

    def remove(self, name: str) -> None:
        """Nothing to remove: ``exec`` leaves no container behind, and the timeout's kill of the
        process group ends the PID namespace with every process in it."""
