"""``podman``: the docker backend's run on Podman, whose CLI takes the same ``run`` flags.

Two differences matter here: ``podman info`` has no ``.ServerVersion`` (it is daemonless; the
check asks for ``.Version.Version``), and rootless Podman maps the caller to root inside the user
namespace, so ``--userns keep-id`` keeps the caller's uid and the bound work dir and HOME stay
writable by it. Limits are enforced by the cgroups Podman creates (rootless: only where cgroup v2
delegates the controllers; Podman refuses the run otherwise). Not tested on this machine (podman is
not installed); its tests skip and say why.
"""

from __future__ import annotations

import os
from pathlib import Path

from polar_trial.sandbox.base import SandboxSpec
from polar_trial.sandbox.docker import DockerSandbox


class PodmanSandbox(DockerSandbox):
    name = "podman"
    runtime = "podman"
    limits_by = "podman's cgroups"

    probe = ("info", "--format", "{{.Version.Version}}")  # daemonless: no .ServerVersion
    probe_failure = "podman cannot run containers here"

    def argv(self, spec: SandboxSpec, private: Path, name: str, inner: list[str],
             report_dir: Path | None = None, host_binds: list[tuple[str, str]] = ()) -> list[str]:
        a = super().argv(spec, private, name, inner, report_dir, host_binds)
        if os.getuid() != 0:  # rootless: the caller's uid inside too, so its binds stay writable
            a[2:2] = ["--userns", "keep-id"]
        return a
