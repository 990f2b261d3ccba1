"""``host``: NO sandbox. The command runs on the host as the caller, cwd = the host work dir, with
only ``spec.env`` (an isolated HOME is just an environment variable). Nothing in the spec's
limits, binds or network settings is applied.

It is what Polar did before sandboxing, kept under an explicit, unsafe-sounding name so the
adversarial tests can show what the real backends prevent (they fail against it), and for
debugging a harness outside any sandbox. ``get_sandbox("auto")`` never returns it.
"""

from __future__ import annotations

import os

from polar_trial.sandbox.base import Sandbox, SandboxResult, SandboxSpec, Stream, supervise


class HostSandbox(Sandbox):
    name = "host"
    isolates = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def inside(self, spec: SandboxSpec, host_path: str | os.PathLike[str]) -> str:
        return os.path.abspath(host_path)

    def run(self, spec: SandboxSpec, argv: list[str], *, stdout: Stream = None,
            stderr: Stream = None) -> SandboxResult:
        spec.workdir_host.mkdir(parents=True, exist_ok=True)
        rc, timed_out, _, wall = supervise(argv, env=dict(spec.env), cwd=spec.workdir_host,
                                           stdout=stdout, stderr=stderr, timeout_s=spec.timeout_s)
        notes = ["UNSAFE: no sandbox (host backend): no isolation, no limits enforced"]
        if timed_out:
            notes.append(f"timed out after {spec.timeout_s:g} s: process group killed")
        return SandboxResult(rc, timed_out, notes, wall)
