"""A multi-container task's services, started by Polar beside a live trial (``trial.py``).

The services of ``environment/docker-compose.yaml`` (the subset ``tasks/compose.py`` reads) run
each in a container of its own, joined to the main container's network namespace
(``--network container:<main>``): the main container was created with ``--network none`` and
``--add-host <service>:127.0.0.1`` for each service, so a service's name resolves to 127.0.0.1 in
the main container (and the services, which share its /etc/hosts), and a service listening on a
port is reached there. No bridge, no veth, no host address is made: the trial's network is still
its loopback and the relays.

Each service runs through the same hardened path as the main container: every capability dropped
but the package manager's set (Docker's default, as Harbor's containers have: a database's
entrypoint chowns its data dir and drops to its own user), no new privileges, the daemon's user
namespace remap (podman: the main container's user namespace, ``--userns=container:<main>``:
one of its own failed to mount /sys in main's network namespace, "mount sysfs:/sys ...: operation
not permitted"), no container log kept, the trial's pids/memory/cpu limits (per service: each is
a container of its own), the trial's storage cap on its writable layer where the daemon caps one
(``quotaroot.py``; podman: a quota limit set from the host, ``podman.cap_writes``), a tmpfs /tmp.
Its image is resolved by the caller (``image_of``: present, pulled where a registry answers, a
stand-in, or the task is unreachable here, naming it).

Compose's start order: a service starts once what it ``depends_on`` has started, is healthy
(``service_healthy``: its healthcheck passed) or has exited 0 (``service_completed_successfully``);
the agent starts once main's ``depends_on`` holds. A healthcheck runs as Docker runs one: every
``interval``, each try limited to ``timeout``, failures during ``start_period`` not counted,
``retries`` failures in a row make the service unhealthy and the trial fail, naming it.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any, Callable

#: how long a dependency may take to be up, healthy or done before the trial fails, naming it
WAIT_LIMIT_S = 300.0


class ServiceError(RuntimeError):
    """A service could not be started or did not become ready (the message names it)."""


class Services:
    """``start(main)`` the plan's services in the main container's network namespace; ``stop()``."""

    def __init__(self, runtime: str, plan: Any, image_of: Callable[[Any], tuple[str, str | None]], *,
                 caps: list[str], pids: int | None = None, memory_mb: int | None = None,
                 cpus: float | None = None, tmp_mb: int = 256, disk_mb: int | None = None):
        self.runtime, self.plan, self.image_of = runtime, plan, image_of
        self.caps, self.pids, self.memory_mb, self.cpus, self.tmp_mb = caps, pids, memory_mb, cpus, tmp_mb
        self.disk_mb = disk_mb
        self.containers: dict[str, str] = {}  # service -> container name
        self.healthy: set[str] = set()
        self.notes: list[str] = []

    def _docker(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([self.runtime, *args], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise ServiceError(f"`{self.runtime} {args[0]}` failed: {(r.stderr or r.stdout).strip()[-600:]}")
        return r

    def run_args(self, svc: Any, main: str, image: str) -> list[str]:
        """The ``docker run`` of one service (its hardened path, in ``main``'s network namespace)."""
        if not image or image.startswith("-"):  # an argument read as an option (``--privileged``)
            raise ServiceError(f"service {svc.name}: {image!r} is not an image reference")
        a = ["run", "-d", "--name", f"{main}-{svc.name}", "--network", f"container:{main}", "--cap-drop", "ALL",
             "--security-opt", "no-new-privileges", "--log-driver", "none",
             "--tmpfs", f"/tmp:size={self.tmp_mb}m,nosuid,nodev",
             "--label", f"org.polar.trial={main}", "--label", f"org.polar.service={svc.name}"]
        for cap in self.caps:
            a += ["--cap-add", cap]
        from polar_trial.sandbox.docker import limit_flags

        a += limit_flags(self.pids, self.memory_mb, self.cpus)
        if self.disk_mb:  # what it writes outside its binds, as the main container (quotaroot.py)
            from polar_trial.sandbox.quotaroot import size_for, storage_opt_supported

            if storage_opt_supported(self.runtime):
                a += ["--storage-opt", size_for(image, self.disk_mb, self.runtime)]
        for k, v in svc.environment.items():
            a += ["-e", f"{k}={v}"]
        args: list[str] = []
        if svc.entrypoint is not None:  # Compose: an entrypoint replaces the image's, and its CMD
            a += ["--entrypoint", svc.entrypoint[0] if svc.entrypoint else ""]
            args = svc.entrypoint[1:] + (svc.command or [])
        elif svc.command is not None:
            args = svc.command
        return [*a, image, *args]

    def start(self, main: str) -> None:
        for svc in self.plan.services:
            self.wait(svc.depends_on, f"service {svc.name}")
            image, said = self.image_of(svc)
            if said:
                self.notes.append(f"service {svc.name}: {said}")
            args, name = self.run_args(svc, main, image), f"{main}-{svc.name}"
            if self.runtime == "podman":  # main's user namespace (below) and its writes capped, as main's
                from polar_trial.sandbox.podman import create_owned

                create_owned(args, name, self.disk_mb, self.notes, own=lambda _owner: None,
                             what=f"service {svc.name}", userns=f"container:{main}")
            else:
                self._docker(*args)
            self.containers[svc.name] = name
            self.notes.append(f"service {svc.name} ({image}) started in the main container's network namespace "
                              f"({svc.name} -> 127.0.0.1)")

    def _state(self, name: str) -> tuple[str, int]:
        r = self._docker("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", self.containers[name],
                         check=False)
        parts = r.stdout.split()
        return (parts[0], int(parts[1])) if len(parts) == 2 else ("missing", -1)

    def wait(self, depends: dict[str, str], who: str) -> None:
        """Until every dependency in ``depends`` (name -> Compose condition) holds."""
        for name, cond in depends.items():
            svc = next(s for s in self.plan.services if s.name == name)
            if cond == "service_started":
                status, _ = self._state(name)
                if status not in ("running", "exited"):  # started is all Compose's condition asks
                    raise ServiceError(f"{who} depends on service {name}, which is {status}")
            elif cond == "service_completed_successfully":
                self._wait_exit(name, who)
            elif name not in self.healthy:
                if svc.healthcheck is None:
                    raise ServiceError(f"{who} waits for service {name} to be healthy, and it has no healthcheck")
                self._health(svc, who)

    def _wait_exit(self, name: str, who: str) -> None:
        deadline = time.monotonic() + WAIT_LIMIT_S
        while time.monotonic() < deadline:
            status, code = self._state(name)
            if status == "exited":
                if code != 0:
                    raise ServiceError(f"{who} needs service {name} to complete successfully; it exited {code}")
                return
            if status not in ("running", "created", "restarting"):
                raise ServiceError(f"{who} needs service {name} to complete; it is {status}")
            time.sleep(0.2)
        raise ServiceError(f"{who}: service {name} did not complete within {WAIT_LIMIT_S:g} s")

    def _health(self, svc: Any, who: str) -> None:
        hc = svc.healthcheck
        t0 = time.monotonic()
        grace = t0 + hc.start_period_s
        failures = 0
        while time.monotonic() - t0 < WAIT_LIMIT_S:
            status, code = self._state(svc.name)
            if status != "running":
                raise ServiceError(f"{who} waits for service {svc.name} to be healthy; it is {status} (exit {code})")
            left = max(0.1, WAIT_LIMIT_S - (time.monotonic() - t0))
            try:
                r = subprocess.run([self.runtime, "exec", self.containers[svc.name], *hc.argv], capture_output=True,
                                   timeout=min(hc.timeout_s, left), stdin=subprocess.DEVNULL)
                ok = r.returncode == 0
            except subprocess.TimeoutExpired:
                ok = False
            if ok:
                self.healthy.add(svc.name)
                self.notes.append(f"service {svc.name} healthy after {time.monotonic() - t0:.1f} s")
                return
            if time.monotonic() >= grace:
                failures += 1
                if failures >= hc.retries:
                    raise ServiceError(f"{who} waits for service {svc.name}, whose healthcheck failed {failures} "
                                       f"time(s) (`{' '.join(hc.argv)[:120]}`)")
            pause = min(hc.interval_s, 1.0) if time.monotonic() < grace else hc.interval_s
            time.sleep(max(0.0, min(pause, WAIT_LIMIT_S - (time.monotonic() - t0))))  # a task's interval: bounded
        raise ServiceError(f"{who}: service {svc.name} was not healthy within {WAIT_LIMIT_S:g} s")

    def stop(self) -> None:
        for name in reversed(list(self.containers)):
            subprocess.run([self.runtime, "rm", "-f", "-v", self.containers[name]], capture_output=True, timeout=120,
                           stdin=subprocess.DEVNULL, check=False)
        self.containers.clear()
