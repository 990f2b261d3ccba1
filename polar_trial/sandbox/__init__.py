"""Every agent, oracle and verifier phase runs in a sandbox: ``get_sandbox(name).run(spec, argv)``.

Backends, one module each behind ``base.Sandbox``:

* ``bubblewrap`` (Linux; Debian's ``bubblewrap`` package, installed by scripts/setup.sh): the
  default. Host system read-only, only the spec's binds visible, own PID namespace, no network
  but the model proxy (relayed through a job-private Unix socket), cgroup limits where writable.
* ``docker``: the same spec on a Docker daemon (``docker run --network none``), where one answers.
* ``podman``: the docker backend on Podman: as root on a store of Polar's own, each live trial in a
  user namespace of its own (``--userns=auto``); rootless keeps the caller's uid.
* ``apptainer``: ``apptainer exec --containall --net --network none`` (HPC clusters without Docker).
* ``host``: NO isolation at all, the command runs on the host as the caller. It exists only to
  show what the sandbox prevents (the adversarial tests run against it and fail) and for
  debugging; never the default.

``auto`` picks the first available of bubblewrap, docker, podman, apptainer; it refuses rather than fall back to
``host``. See docs/sandbox.md for exactly what each enforces.
"""

from __future__ import annotations

from polar_trial.sandbox.base import (
    Sandbox,
    SandboxError,
    SandboxResult,
    SandboxSpec,
    SandboxUnavailable,
)

#: backend name -> "module:Class" (imported lazily: a backend's module may need its runtime)
BACKENDS: dict[str, str] = {
    "bubblewrap": "polar_trial.sandbox.bubblewrap:BubblewrapSandbox",
    "docker": "polar_trial.sandbox.docker:DockerSandbox",
    "podman": "polar_trial.sandbox.podman:PodmanSandbox",
    "apptainer": "polar_trial.sandbox.apptainer:ApptainerSandbox",
    "host": "polar_trial.sandbox.host:HostSandbox",
}
#: the order ``auto`` tries (``host`` is never picked automatically)
AUTO_ORDER = ("bubblewrap", "docker", "podman", "apptainer")
ALIASES = {"bwrap": "bubblewrap", "singularity": "apptainer", "none": "host", "unsafe-host": "host"}


def backend_class(name: str) -> type[Sandbox]:
    import importlib

    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        raise SandboxError(f"unknown sandbox {name!r}: choose one of auto, {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def available() -> dict[str, str | None]:
    """Each backend and why it is unavailable here (None = usable)."""
    return {name: backend_class(name).unavailable_reason() for name in BACKENDS}


def get_sandbox(name: str = "auto") -> Sandbox:
    """The named backend, ready to run; ``SandboxUnavailable`` says why when it cannot run here."""
    if name == "auto":
        reasons = []
        for cand in AUTO_ORDER:
            why = backend_class(cand).unavailable_reason()
            if why is None:
                return backend_class(cand).open()
            reasons.append(f"{cand}: {why}")
        raise SandboxUnavailable("no sandbox backend is usable here (" + "; ".join(reasons)
                                 + "); install bubblewrap (scripts/setup.sh does)")
    cls = backend_class(name)
    why = cls.unavailable_reason()
    if why is not None:
        raise SandboxUnavailable(f"sandbox {cls.name!r} is unavailable: {why}")
    return cls.open()


__all__ = ["Sandbox", "SandboxError", "SandboxResult", "SandboxSpec", "SandboxUnavailable",
           "available", "backend_class", "get_sandbox", "BACKENDS"]
