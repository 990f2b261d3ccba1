"""Multi-container Harbor tasks: the subset of ``environment/docker-compose.yaml`` Polar runs itself.

Harbor merges a task's compose file over its own base (the ``main`` service built from
``environment/Dockerfile``, its command ``sleep infinity``) and runs it with Docker Compose. No
Compose v2 is on the registries our machines reach, v1 is end-of-life, and any compose tool would
start the services outside our hardened run path on host bridges with private addresses. So Polar
reads this subset and starts each service itself (``sandbox/services.py``), in the main
container's network namespace: every service name resolves to 127.0.0.1 there, and no bridge or
host address is made.

The subset (anything else is refused naming the key, ``ComposeError``):

* top level: ``services`` (``version``, ``name`` and ``x-`` extension fields, the anchors a file
  merges from with ``<<: *anchor``, are ignored, as Compose v2 ignores them);
* a sidecar service: ``image`` or ``build`` (a context dir under ``environment/`` with its
  ``Dockerfile``, or ``{context, dockerfile}``), ``environment`` (a table or ``K=V`` list),
  ``command`` and ``entrypoint`` (a list, or a string split as Compose splits it), ``depends_on``
  (a list, or a table of ``{condition: service_started | service_healthy |
  service_completed_successfully}``), ``healthcheck`` (``test`` as ``["CMD", ...]``,
  ``["CMD-SHELL", "..."]``, a string, or ``["NONE"]``/``disable``; ``interval``, ``timeout``,
  ``start_period``, ``retries``), and, noted and ignored because a shared network namespace makes
  them moot, ``ports``, ``expose``, ``restart``, ``container_name``, ``hostname``;
* ``main``: ``environment`` (every phase's, under ``[environment.env]``), ``depends_on`` (what
  must be up, or healthy, before the agent starts), and ``build``/``image``/``command`` only as
  Harbor's base sets them (the task's Dockerfile; Harbor's ``sleep infinity``).

``${VAR}``, ``${VAR:-default}`` and ``$$`` are interpolated from the task's ``[environment.env]``
(Harbor passes it to compose); an unset variable without a default is refused by name.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
MAIN = "main"
SERVICE_KEYS = {"image", "build", "environment", "command", "entrypoint", "depends_on", "healthcheck"}
IGNORED_KEYS = {"ports", "expose", "restart", "container_name", "hostname"}
MAIN_KEYS = {"environment", "depends_on", "build", "image", "command"}
CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
#: a compose file is read only this big, with this many values (YAML aliases expand: nine levels of
#: ten references each are 10^9 values to walk), and at most this many services (each a container)
FILE_LIMIT = 256 * 1024
NODE_LIMIT = 20_000
MAX_SERVICES = 16
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
#: an image reference (registry/repo:tag@digest): it is an argument of ``docker run``/``pull``, so
#: one starting with ``-`` (``--privileged``) would be read as an option
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}$")
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class ComposeError(ValueError):
    """The compose file is outside the subset Polar runs (the message names the key)."""


@dataclass
class Healthcheck:
    argv: list[str]  # what runs in the service (a CMD-SHELL test is ["sh", "-c", test])
    interval_s: float = 30.0
    timeout_s: float = 30.0
    start_period_s: float = 0.0
    retries: int = 3


@dataclass
class Service:
    name: str
    image: str | None = None
    build: Path | None = None  # the context dir
    dockerfile: str = "Dockerfile"
    environment: dict[str, str] = field(default_factory=dict)
    command: list[str] | None = None
    entrypoint: list[str] | None = None
    depends_on: dict[str, str] = field(default_factory=dict)  # name -> condition
    healthcheck: Healthcheck | None = None


@dataclass
class ComposePlan:
    services: list[Service]  # the sidecars, in an order that starts each after what it depends on
    main_env: dict[str, str] = field(default_factory=dict)
    main_depends_on: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.services]


def compose_file(env_dir: Path) -> Path | None:
    for name in COMPOSE_FILES:
        if (env_dir / name).is_file():
            return env_dir / name
    return None


def duration_s(v: Any, where: str) -> float:
    """Compose durations: ``30s``, ``1m30s``, ``500ms``, ``1h``, or a number of seconds."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    m = re.fullmatch(r"\s*((?:\d+(?:\.\d+)?(?:h|m|s|ms|us)\s*)+)", str(v))
    if not m:
        raise ComposeError(f"{where}: {v!r} is not a duration (like 5s, 1m30s)")
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", m[1]))


def interpolate(value: Any, env: dict[str, str], where: str, budget: list[int] | None = None) -> Any:
    budget = [NODE_LIMIT] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise ComposeError(f"{where}: more than {NODE_LIMIT} values (YAML aliases expanded?)")
    if isinstance(value, dict):
        return {k: interpolate(v, env, f"{where}.{k}", budget) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, where, budget) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m[0] == "$$":
            return "$"
        name = m[1] or m[4]
        if name in env and (env[name] != "" or m[2] != ":-"):
            return env[name]
        if m[2] is not None:
            return m[3]
        raise ComposeError(f"{where}: ${{{name}}} is not set (Polar interpolates from [environment.env])")
    return _VAR.sub(sub, value)


def _argv(v: Any, where: str) -> list[str]:
    if isinstance(v, str):
        return shlex.split(v)
    if isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v):
        return [str(x) for x in v]
    raise ComposeError(f"{where} must be a string or a list of strings")


def _env(v: Any, where: str) -> dict[str, str]:
    if v is None:
        return {}
    if isinstance(v, dict):
        return {str(k): "" if x is None else str(x) for k, x in v.items()}
    if isinstance(v, list):
        out = {}
        for item in v:
            k, sep, x = str(item).partition("=")
            if not sep:
                raise ComposeError(f"{where}: {item!r} takes its value from the host's environment, which "
                                   "no task reaches here; give it a value")
            out[k] = x
        return out
    raise ComposeError(f"{where} must be a table or a list of K=V")


def _depends(v: Any, where: str) -> dict[str, str]:
    if v is None:
        return {}
    if isinstance(v, list):
        return {str(x): "service_started" for x in v}
    if isinstance(v, dict):
        out = {}
        for name, spec in v.items():
            spec = spec or {}
            extra = sorted(set(spec) - {"condition", "required", "restart"})
            if extra:
                raise ComposeError(f"{where}.{name}.{extra[0]} is not supported")
            cond = spec.get("condition", "service_started")
            if cond not in CONDITIONS:
                raise ComposeError(f"{where}.{name}.condition = {cond!r}: one of {', '.join(CONDITIONS)}")
            out[str(name)] = cond
        return out
    raise ComposeError(f"{where} must be a list or a table")


def _healthcheck(v: Any, where: str) -> Healthcheck | None:
    if not isinstance(v, dict):
        raise ComposeError(f"{where} must be a table")
    extra = sorted(set(v) - {"test", "interval", "timeout", "start_period", "start_interval", "retries", "disable"})
    if extra:
        raise ComposeError(f"{where}.{extra[0]} is not supported")
    if v.get("disable"):
        return None
    test = v.get("test")
    if isinstance(test, str):
        argv = ["sh", "-c", test]
    elif isinstance(test, list) and test and test[0] == "NONE":
        return None
    elif isinstance(test, list) and len(test) >= 2 and test[0] == "CMD":
        argv = [str(x) for x in test[1:]]
    elif isinstance(test, list) and len(test) == 2 and test[0] == "CMD-SHELL":
        argv = ["sh", "-c", str(test[1])]
    else:
        raise ComposeError(f"{where}.test must be a string, [\"CMD\", ...], [\"CMD-SHELL\", \"...\"] or [\"NONE\"]")
    retries = v.get("retries", 3)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 1:
        raise ComposeError(f"{where}.retries must be a positive integer")
    return Healthcheck(argv, duration_s(v.get("interval", 30), f"{where}.interval"),
                       duration_s(v.get("timeout", 30), f"{where}.timeout"),
                       duration_s(v.get("start_period", 0), f"{where}.start_period"), retries)


def read_compose(path: Path, env: dict[str, str] | None = None) -> ComposePlan:
    """The plan of ``path`` (a task's compose file); ComposeError names what is outside the subset."""
    import yaml

    try:
        if path.stat().st_size > FILE_LIMIT:
            raise ComposeError(f"{path}: over {FILE_LIMIT // 1024} KiB")
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ComposeError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        raise ComposeError(f"{path}: no services table")
    if len(data["services"]) > MAX_SERVICES + 1:
        raise ComposeError(f"{path}: {len(data['services'])} services; Polar runs at most {MAX_SERVICES} beside main")
    for k in sorted(set(data) - {"services", "version", "name"}):
        if not str(k).startswith("x-"):  # extension fields (anchors to merge from) are Compose's to ignore
            raise ComposeError(f"{path}: top-level {k!r} is not supported (Polar runs services, version, name)")
    data = interpolate(data, dict(env or {}), path.name)
    plan = ComposePlan(services=[])
    env_dir = path.parent
    sidecars: dict[str, Service] = {}
    for name, spec in data["services"].items():
        where = f"{path.name}: services.{name}"
        if not isinstance(spec, dict):
            raise ComposeError(f"{where} must be a table")
        if name == MAIN:
            for k in sorted(set(spec) - MAIN_KEYS - IGNORED_KEYS):
                raise ComposeError(f"{where}.{k} is not supported (main is the task's environment: "
                                   f"Polar reads its {', '.join(sorted(MAIN_KEYS))})")
            _main_as_harbor(spec, where, env_dir)
            plan.main_env = _env(spec.get("environment"), f"{where}.environment")
            plan.main_depends_on = _depends(spec.get("depends_on"), f"{where}.depends_on")
            continue
        if not _NAME.match(str(name)):
            raise ComposeError(f"{where}: a service name is lowercase letters, digits, '.', '_' and '-'")
        for k in sorted(set(spec) - SERVICE_KEYS - IGNORED_KEYS):
            if not str(k).startswith("x-"):
                raise ComposeError(f"{where}.{k} is not supported (Polar runs {', '.join(sorted(SERVICE_KEYS))})")
        for k in sorted(set(spec) & IGNORED_KEYS):
            plan.notes.append(f"{where}.{k} ignored: the services share the main container's network "
                              "namespace (each name is 127.0.0.1 there), nothing is published on the host")
        svc = Service(name=str(name), environment=_env(spec.get("environment"), f"{where}.environment"),
                      depends_on=_depends(spec.get("depends_on"), f"{where}.depends_on"))
        if "image" in spec:
            if not isinstance(spec["image"], str) or not _IMAGE.match(spec["image"].strip()):
                raise ComposeError(f"{where}.image must be an image reference (registry/name:tag), "
                                   f"not {str(spec['image'])[:80]!r}")
            svc.image = spec["image"].strip()
        if "build" in spec:
            svc.build, svc.dockerfile = _build(spec["build"], f"{where}.build", env_dir)
        if svc.image is None and svc.build is None:
            raise ComposeError(f"{where}: neither image nor build")
        if "command" in spec:
            svc.command = _argv(spec["command"], f"{where}.command")
        if "entrypoint" in spec:
            svc.entrypoint = _argv(spec["entrypoint"], f"{where}.entrypoint")
        if "healthcheck" in spec:
            svc.healthcheck = _healthcheck(spec["healthcheck"], f"{where}.healthcheck")
        sidecars[svc.name] = svc
    plan.services = _order(sidecars, plan.main_depends_on, path.name)
    return plan


def _main_as_harbor(spec: dict, where: str, env_dir: Path) -> None:
    """``main``'s build, image and command: only as Harbor's own base sets them."""
    if "build" in spec:
        ctx, dockerfile = _build(spec["build"], f"{where}.build", env_dir)
        if ctx != env_dir.resolve() or dockerfile != "Dockerfile":
            raise ComposeError(f"{where}.build: main is built from environment/Dockerfile")
    if "image" in spec:
        raise ComposeError(f"{where}.image: main's image is [environment] docker_image or environment/Dockerfile")
    if "command" in spec and _argv(spec["command"], f"{where}.command") not in (["sh", "-c", "sleep infinity"],
                                                                                ["sleep", "infinity"]):
        raise ComposeError(f"{where}.command: main runs Harbor's `sleep infinity` (the phases exec into it)")


def _build(v: Any, where: str, env_dir: Path) -> tuple[Path, str]:
    if isinstance(v, str):
        ctx, dockerfile = v, "Dockerfile"
    elif isinstance(v, dict):
        extra = sorted(set(v) - {"context", "dockerfile"})
        if extra:
            raise ComposeError(f"{where}.{extra[0]} is not supported (Polar reads context and dockerfile)")
        ctx, dockerfile = str(v.get("context", ".")), str(v.get("dockerfile", "Dockerfile"))
    else:
        raise ComposeError(f"{where} must be a context dir or a table")
    root = env_dir.resolve()
    path = (env_dir / ctx).resolve()
    if path != root and root not in path.parents:
        raise ComposeError(f"{where}: {ctx!r} is outside environment/")
    df = (path / dockerfile).resolve()
    if root not in df.parents or not df.is_file():
        raise ComposeError(f"{where}: no {dockerfile} in {ctx!r} under environment/")
    return path, dockerfile


def _order(sidecars: dict[str, Service], main_deps: dict[str, str], where: str) -> list[Service]:
    for name in main_deps:
        if name not in sidecars:
            raise ComposeError(f"{where}: services.main.depends_on names {name!r}, which is not a service")
    out: list[Service] = []
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise ComposeError(f"{where}: depends_on cycle {' -> '.join(path + [name])}")
        state[name] = 1
        for dep in sidecars[name].depends_on:
            if dep == MAIN:
                raise ComposeError(f"{where}: services.{name}.depends_on main: main starts first, the services in it")
            if dep not in sidecars:
                raise ComposeError(f"{where}: services.{name}.depends_on names {dep!r}, which is not a service")
            visit(dep, path + [name])
        state[name] = 2
        out.append(sidecars[name])
    for name in sidecars:
        visit(name, [])
    return out


def service_image(task: Any, svc: Service, backend: Any, builds: Path) -> tuple[str, str | None]:
    """(the image ``svc`` runs, what was built or stood in): present on the daemon, pulled where a
    registry answers, a stand-in (``sandbox/servicestandin.py``: redis, postgres, nginx; else the
    base stand-ins of ``sandbox/standin.py``), or built from its ``build`` context as a task image
    is. Raises ComposeError naming the image when none of these can give it: the task is
    unreachable here."""
    from polar_trial.sandbox.servicestandin import ensure_service_image
    from polar_trial.sandbox.standin import StandInError, ensure_image, image_exists, standin_of
    from polar_trial.tasks.imagebuild import pull_image

    runtime = getattr(backend, "runtime", "docker")
    if svc.build is not None:
        where = (svc.build / svc.dockerfile).relative_to(Path(task.root).resolve())
        return _built(task, svc, backend, builds), f"built from {where}"
    image = svc.image
    assert image is not None
    if image_exists(image, runtime=runtime):
        return image, standin_of(image, runtime=runtime)
    pulled, why = pull_image(image, runtime)
    if pulled:
        return image, None
    try:
        said = ensure_service_image(image, runtime)
        if said is None:
            said = ensure_image(image, runtime=runtime)["stand_in"]
    except StandInError as exc:  # one line, the image first: what `polar tasks check` shows of it
        raise ComposeError(f"service {svc.name}: image {image} is unreachable here: it cannot be pulled "
                           f"({' '.join(why.split())[:200]}) and has no stand-in ({' '.join(str(exc).split())[:300]})") from None
    return image, said


def _built(task: Any, svc: Service, backend: Any, builds: Path) -> str:
    import tempfile

    from polar_trial.tasks.dockerfile import parse
    from polar_trial.tasks.environment import prepare_workdir
    from polar_trial.tasks.imagebuild import task_image
    from polar_trial.tasks.model import DEFAULT_PATH, Task

    env = parse(svc.build / svc.dockerfile, {"PATH": DEFAULT_PATH}, task_root=task.root,
                container=getattr(backend, "name", True))
    sub = Task(id=f"{task.id}-{svc.name}", instruction="-", root=task.root, environment=env)
    with tempfile.TemporaryDirectory(prefix="polar-svc-") as tmp:
        prepare_workdir(sub, Path(tmp) / "w", backend, builds)
    image = task_image(sub, backend)
    if not image:
        raise ComposeError(f"service {svc.name}: its build gave no image")
    return image
