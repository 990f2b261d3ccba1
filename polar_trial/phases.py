"""The pieces of a sample's trial that need only the task and the sandbox, not the harness or the
proxy: the sandbox spec of an agent phase, the live environment of a container backend, and the
sample's dir sealed after its last phase. The rollout (``polar_runtime/rollout.py``) decides what
the harness needs (the model's port, its install, whether it may reach the internet) and calls these.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterable

from polar_trial.sandbox import SandboxSpec
from polar_trial.tasks import Task


def phase_spec(task: Task, workdir_host: Path, home: Path, timeout: float, *, pids: int | None,
               image: str | None = None, ro_binds: Iterable[tuple[Path, str]] = (), network: bool = False,
               proxy_port: int | None = None, internet: bool = False) -> SandboxSpec:
    """The sandbox of an agent phase (also the oracle's and nop's: exactly the same): the task's
    work dir and limits, its image on a container backend, public hosts only through the egress
    proxy and only when ``internet``."""
    from polar_trial.sandbox.publicnet import PUBLIC

    return SandboxSpec(workdir_host=workdir_host, workdir=task.workdir, home_host=home, ro_binds=list(ro_binds),
                       network=network, proxy_port=proxy_port, **task.limits(pids), timeout_s=timeout,
                       image=image or task.image, egress=(PUBLIC,) if internet else ())


def open_live_trial(task: Task, sandbox: Any, image: str | None, workdir: Path, stack: contextlib.ExitStack | None,
                    *, pids: int | None, builds: Path, agent_privileged: bool = False,
                    allow_internet: bool = False) -> Any:
    """The sample's live environment on a container backend (``sandbox/trial.py``: created at the
    first agent phase, removed when ``stack`` closes); None where phases run in sandboxes of their own.
    ``builds``: where a service's image is built (the run's ``.builds``); ``allow_internet``: the
    run's, the task's own ``allow_internet`` must say so too."""
    from polar_trial.sandbox.egress import registries
    from polar_trial.sandbox.trial import LiveTrial, TrialConfig, task_healthcheck, uses_live_trial
    from polar_trial.tasks.compose import service_image

    if stack is None or not image or not uses_live_trial(sandbox):
        if task.compose is not None and task.compose.services:
            raise RuntimeError(f"a multi-container task needs a live trial (docker or podman), not {sandbox.name}")
        return None
    lim = task.limits(pids)
    # the agent keeps the task's pids and memory limits as a phase of its own; the container gets
    # the verifier's on top, so what the agent leaves cannot starve the tests (sandbox/phasecgroup.py;
    # cgroup v1)
    from polar_trial.sandbox import phasecgroup
    from polar_trial.tasks.model import host_memory_mb

    own = phasecgroup.available()
    mem = lim["memory_mb"]
    room = phasecgroup.verifier_memory_mb(mem, host_memory_mb()) if phasecgroup.available("memory") else 0
    trial = LiveTrial(sandbox, TrialConfig(
        image=image, workdir_host=workdir, workdir=task.workdir,
        pids=lim["pids"] + (phasecgroup.VERIFIER_PIDS if own else 0),
        phase_pids={"agent": lim["pids"]} if own else {}, memory_mb=mem + room,
        phase_memory_mb={"agent": mem} if room else {},
        cpus=lim["cpus"], disk_mb=lim["disk_mb"], registries=registries(), agent_privileged=agent_privileged,
        agent_user=task.agent_user, verifier_user=task.verifier_user,
        agent_internet=bool(task.allow_internet and allow_internet),
        services=task.compose, service_image=(lambda svc: service_image(task, svc, sandbox, builds)),
        healthcheck=task_healthcheck(task)))
    shared = phasecgroup.shared_note(own, room)
    if shared:
        trial.notes.append(shared)
    stack.callback(trial.stop)
    return trial


def seal_sample_dir(sample_dir: Path) -> str | None:
    """After the sample's last phase: links its phases (or the task) left that resolve outside the
    sample's dir are removed (``hostfs.drop_outside_links``), and said. Nothing of Polar follows
    them, but a user's ``cp -L``, ``tar -h`` or upload of the run dir would read the host's files.
    Links that stay inside (a task's relative ones) are kept. A venv's absolute ``bin/python`` link
    goes too: the sample is done, and the phases needed it only while they ran."""
    from polar_trial.sandbox.hostfs import drop_outside_links

    if not sample_dir.is_dir() or sample_dir.is_symlink():
        return None
    try:
        n, names = drop_outside_links(sample_dir)
    except OSError as exc:
        return f"links out of the sample's dir could not all be checked: {exc}"
    if not n:
        return None
    return f"{n} link(s) pointing outside the sample's dir removed from the run dir: {', '.join(names)}"
