"""Harbor task directories and datasets (directories of them): the format of Terminal-Bench 2 and
the SWE-bench adapters.

A task directory holds ``task.toml``, ``instruction.md``, ``environment/Dockerfile`` with its build
context, ``tests/test.sh`` (writes /logs/verifier/reward.txt or reward.json) and optionally
``solution/solve.sh``. The task id is the directory name. From task.toml Polar reads
``[agent] timeout_sec`` and ``user`` (root only), ``[verifier] timeout_sec``, ``env`` and ``user``
(root only), ``[solution] env``, ``[environment] build_timeout_sec``, ``cpus``, ``memory_mb`` (or
``memory = "2G"``), ``storage_mb`` (or ``storage``: the sandbox's cap on what the agent writes),
``allow_internet`` or ``network_mode`` (``public`` / ``no-network``), ``workdir`` (the dir the
agent starts in, over the Dockerfile's WORKDIR), ``env`` (``[environment.env]``: the environment
of every phase) and top-level ``artifacts`` (paths in the work dir, which the shared verifier
sees), ``[[steps]]`` (multi-step tasks: ``tasks/steps.py``), and its own ``[polar] followups``
(later user turns, which Harbor ignores). What the backend
that will run the task cannot honour is refused by name, for that task only, and the message
names that backend (the local mode, or the docker/podman backend: a rule of one never reads as
another's): a separate verifier environment (``[verifier] environment_mode = "separate"``,
``[verifier.environment]``), a user other than root,
``network_mode = "allowlist"`` and per-phase network modes, GPUs, ``os = "windows"``,
artifacts outside the work dir, and, in the local mode only, ``environment/docker-compose.yaml``
(a container backend runs the subset ``tasks/compose.py`` reads), and
``[environment] docker_image`` without a Dockerfile (a container backend pulls it where a registry
answers, else builds the Dockerfile or stands in for the image, and says which in the notes).
``cpus`` and memory above the host's are clamped to it with a note (``Task.fit_to_host``). Other
keys are ignored with a note, as Harbor ignores keys it does not know.

No file is read through a link that leaves the task directory: such a task.toml, instruction.md,
Dockerfile, ``tests/``, ``solution/`` or COPY source is refused with an error naming it.

A dataset lists its tasks in sorted directory order, or in the order of an optional
``dataset.toml`` (``tasks = ["a", "b"]``: the built-in sets use it so that ``--n-tasks 2`` picks the
two tasks the demo needs). :func:`load_dataset_report` loads every task of a dataset and returns
the refusals beside the tasks, so that one broken task never hides the others.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from polar_trial.tasks.dockerfile import DockerfileError, escaping_link, leaves, parse
from polar_trial.tasks.model import DEFAULT_PATH, DEFAULT_WORKDIR, Environment, Step, Task, mode_name
from polar_trial.tasks.compose import compose_file, read_compose
from polar_trial.tasks.steps import read_steps

#: task.toml keys Polar reads (or refuses by value); ``None`` = the whole table is metadata
KNOWN: dict[str, set[str] | None] = {
    "agent": {"timeout_sec", "user", "network_mode"},
    "verifier": {"timeout_sec", "env", "user", "environment_mode", "environment", "network_mode"},
    "solution": {"env"},
    "environment": {"build_timeout_sec", "cpus", "memory_mb", "memory", "storage_mb", "storage", "allow_internet",
                    "network_mode", "gpus", "gpu_types", "docker_image", "workdir", "env", "os"},
    "metadata": None, "task": None, "polar": {"followups"},
}
TOP_LEVEL = {"version", "schema_version", "artifacts", "steps", "source", "multi_step_reward_strategy"} | set(KNOWN)
ROOT_USERS = ("root", "0")


class TaskRefused(ValueError):
    """A task the loader (or the local mode) cannot run; ``reason`` says why, naming the file."""

    def __init__(self, task: str, reason: str):
        super().__init__(reason)
        self.task = task
        self.reason = reason


@dataclass
class Refusal:
    """One task of a dataset that did not load: its id, its directory and why."""

    task: str
    root: Path
    reason: str


def is_task_dir(path: Path) -> bool:
    """task.toml and instruction.md, or (a multi-step task, whose instructions are its steps') steps/."""
    return (path / "task.toml").is_file() and ((path / "instruction.md").is_file() or (path / "steps").is_dir())


def _size_mb(value: Any, key: str) -> int:
    """``2048`` (MB) or ``"2G"``/``"512M"`` (Harbor's older spelling) -> MB."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(value), re.I)
    if not m:
        raise ValueError(f"{key} must be megabytes or a size like '2G', not {value!r}")
    scale = {"": 1 / 2**20, "K": 1 / 1024, "M": 1, "G": 1024, "T": 2**20}[m[2].upper()]
    return int(float(m[1]) * scale) if m[2] else int(float(m[1]))


def _env_table(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a table of strings")
    return {str(k): str(v) for k, v in value.items()}


def _read(path: Path, root: Path, what: str) -> str:
    """A file of the task, never read through a link leaving the task directory."""
    if leaves(path, root):
        raise ValueError(f"{path}: {what} is a link to {os.path.realpath(path)}, outside the task directory: "
                         "refused, not followed")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read {what}: {exc}") from None


def _network(cfg: dict[str, Any], envc: dict[str, Any], backend: str = "the local mode") -> bool:
    """allow_internet / network_mode -> whether the task's sandboxes get a network. ``backend``: the
    backend the refusals name (:func:`~polar_trial.tasks.model.mode_name`)."""
    allow = envc.get("allow_internet")
    if allow is not None and not isinstance(allow, bool):
        raise ValueError("[environment] allow_internet must be true or false")
    mode = envc.get("network_mode")
    if mode is None:
        net = bool(allow) if allow is not None else False
    elif mode == "public":
        net = True
    elif mode == "no-network":
        net = False
    elif mode == "allowlist":
        raise ValueError(f'[environment] network_mode = "allowlist" is not supported by {backend} (its sandboxes '
                         "have the network or none, no host allowlist)")
    else:
        raise ValueError(f"[environment] network_mode must be public, no-network or allowlist, not {mode!r}")
    if mode is not None and allow is not None and allow != net:
        raise ValueError(f"[environment] network_mode = {mode!r} contradicts allow_internet = {str(allow).lower()}")
    for phase in ("agent", "verifier"):
        pm = (cfg.get(phase) or {}).get("network_mode")
        if pm is not None and pm != ("public" if net else "no-network"):
            raise ValueError(f"[{phase}] network_mode = {pm!r}: a per-phase network mode is not supported by "
                             f"{backend} (one network setting per task; the task's is "
                             f"{'public' if net else 'no-network'})")
    return net


def _refuse_unsupported(root: Path, cfg: dict[str, Any], envc: dict[str, Any], container: bool | str = False) -> None:
    """Harbor features the backend (``container``: its name, or False for the local mode) cannot
    honour, each refused by name, naming that backend."""
    mode = mode_name(container)
    where = "in the container" if container else "in its own user namespace"
    agent, verifier = cfg.get("agent") or {}, cfg.get("verifier") or {}
    for section, table in (("agent", agent), ("verifier", verifier)):
        user = table.get("user")
        if user is not None and str(user) not in ROOT_USERS and not container:  # a live trial runs it as that user
            raise ValueError(f"[{section}] user = {user!r}: running a phase as another user is not supported by "
                             f"{mode} (every phase runs as root {where})")
    if "environment" in verifier or verifier.get("environment_mode", "shared") not in (
            "shared", "separate") or (verifier.get("environment_mode") == "separate" and not container):
        raise ValueError("a separate verifier environment ([verifier] environment_mode = \"separate\" or "
                         f"[verifier.environment]) is not supported by {mode}: "
                         + ("a verifier image of its own ([verifier.environment]) is not built; "
                            "environment_mode = \"separate\" alone runs one from the task's image" if container else
                            "the verifier runs in the agent's environment, on its work dir (a container "
                            "backend runs a separate one)"))
    if "steps" in cfg and cfg.get("polar", {}).get("followups"):
        raise ValueError("[polar] followups and [[steps]] together: a multi-step task's turns are its steps")
    gpus = envc.get("gpus")
    if gpus not in (None, 0, False):
        raise ValueError(f"[environment] gpus = {gpus!r}: {mode} gives a sandbox no GPU")
    if envc.get("os", "linux") != "linux":
        raise ValueError(f"[environment] os = {envc['os']!r}: only linux tasks run")


def load_task_dir(root: Path, container: bool | str = False) -> Task:
    """One Harbor task directory -> :class:`Task`; a :class:`TaskRefused` (a ValueError) names the
    file and what is wrong. Never raises anything else, whatever the directory holds.
    ``container``: the container backend that will run it (``"docker"``, ``"podman"``, or True for
    either): its Dockerfile is planned for an image build, and only what that backend cannot do is
    refused, by its name."""
    root = Path(os.path.abspath(root))
    try:
        return _load(Path(os.path.realpath(root)), root.name, container)
    except (TaskRefused, DockerfileError):
        raise
    except (ValueError, OSError, RecursionError) as exc:
        raise TaskRefused(root.name, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a task directory never crashes the loader
        raise TaskRefused(root.name, f"{root}: cannot load: {type(exc).__name__}: {exc}") from None


def _load(root: Path, task_id: str, container: bool | str = False) -> Task:
    toml_path = root / "task.toml"
    try:
        cfg = tomllib.loads(_read(toml_path, root, "task.toml"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{toml_path}: {exc}") from exc
    steps, strategy = [], "mean"
    if "steps" in cfg:  # Harbor's multi-step task (tasks/steps.py): its instructions are the steps'
        if (root / "steps").exists() or (root / "steps").is_symlink():
            bad = escaping_link(root / "steps", root)
            if bad is not None:
                raise ValueError(f"{bad}: a link in steps/ to {os.path.realpath(bad)}, outside the task directory: "
                                 "refused, not followed")
        try:
            steps, strategy = read_steps(root, cfg, lambda p, what: _read(p, root, what), ROOT_USERS)
        except ValueError as exc:
            raise ValueError(f"{toml_path}: {exc}") from None
        instruction = steps[0].instruction
    else:
        instruction = _read(root / "instruction.md", root, "instruction.md").strip()
    if not instruction:
        raise ValueError(f"{root / 'instruction.md'} is empty")
    for sub, what in (("tests", "tests/"), ("solution", "solution/")):
        if (root / sub).exists() or (root / sub).is_symlink():
            bad = escaping_link(root / sub, root)
            if bad is not None:
                raise ValueError(f"{bad}: a link in {what} to {os.path.realpath(bad)}, outside the task directory: "
                                 "refused, not followed")
    if not (root / "tests" / "test.sh").is_file() and not steps:  # each step has one (read_steps)
        raise ValueError(f"{root}: no tests/test.sh (the verifier)")
    notes: list[str] = []
    for key in sorted(set(cfg) - TOP_LEVEL):
        notes.append(f"task.toml {key} ignored")
    for section, keys in KNOWN.items():
        table = cfg.get(section) or {}
        if not isinstance(table, dict):
            raise ValueError(f"{toml_path}: [{section}] must be a table")
        if keys is not None:
            for k in sorted(set(table) - keys):
                notes.append(f"task.toml [{section}] {k} ignored")
    agent, verifier, solution = cfg.get("agent") or {}, cfg.get("verifier") or {}, cfg.get("solution") or {}
    envc = cfg.get("environment") or {}
    try:
        _refuse_unsupported(root, cfg, envc, container)
        memory = envc.get("memory_mb", envc.get("memory"))
        storage = envc.get("storage_mb", envc.get("storage"))
        polar = cfg.get("polar") or {}
        followups = polar.get("followups") or []
        if not isinstance(followups, list) or not all(isinstance(f, str) and f for f in followups):
            raise ValueError("[polar] followups must be a list of non-empty instructions")
        for key, table in (("agent", agent), ("verifier", verifier), ("environment", envc)):
            for tk in ("timeout_sec", "build_timeout_sec"):
                if tk in table and (isinstance(table[tk], bool) or not isinstance(table[tk], (int, float))
                                    or table[tk] <= 0):
                    raise ValueError(f"[{key}] {tk} must be a positive number of seconds")
        cpus = envc.get("cpus")
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus <= 0):
            raise ValueError("[environment] cpus must be a positive number")
        network = _network(cfg, envc, mode_name(container))
        workdir = envc.get("workdir")
        if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/") or workdir.strip("/") == ""):
            raise ValueError(f"[environment] workdir must be an absolute path below /, not {workdir!r}")
        env_vars = _env_table(envc.get("env"), "[environment] env")
        artifacts = cfg.get("artifacts") or []
        if not isinstance(artifacts, list):
            raise ValueError("artifacts must be a list of paths")
        task = Task(
            id=task_id,
            instruction=instruction,
            timeout=float(agent["timeout_sec"]) if "timeout_sec" in agent else None,
            followups=list(followups),
            root=root,
            verifier_timeout=float(verifier["timeout_sec"]) if "timeout_sec" in verifier else None,
            build_timeout=float(envc["build_timeout_sec"]) if "build_timeout_sec" in envc else None,
            cpus=float(cpus) if cpus is not None else None,
            memory_mb=_size_mb(memory, "[environment] memory_mb") if memory is not None else None,
            storage_mb=_size_mb(storage, "[environment] storage_mb") if storage is not None else None,
            allow_internet=network,
            verifier_env=_env_table(verifier.get("env"), "[verifier] env"),
            solution_env=_env_table(solution.get("env"), "[solution] env"),
            agent_user=str(agent["user"]) if agent.get("user") is not None else None,
            verifier_user=str(verifier["user"]) if verifier.get("user") is not None else None,
            verifier_separate=verifier.get("environment_mode") == "separate",
            artifacts=[a if isinstance(a, str) else (a or {}).get("source") for a in artifacts],
            notes=notes,
            steps=steps,
            reward_strategy=strategy,
        )
        task.fit_to_host()
    except ValueError as exc:
        raise ValueError(f"{toml_path}: {exc}") from exc
    compose = compose_file(root / "environment")
    if compose is not None and not container:
        raise ValueError(f"{compose}: a multi-container task (docker compose services) needs a container runtime "
                         "(--sandbox docker or podman); the local mode runs one sandbox")
    if compose is not None and leaves(compose, root):
        raise ValueError(f"{compose}: a link to {os.path.realpath(compose)}, outside the task directory: refused, "
                         "not followed")
    dockerfile = root / "environment" / "Dockerfile"
    for p in (root / "environment", dockerfile):
        if (p.exists() or p.is_symlink()) and leaves(p, root):
            raise ValueError(f"{p}: a link to {os.path.realpath(p)}, outside the task directory: refused, not followed")
    image = envc.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise ValueError(f"{toml_path}: [environment] docker_image must be an image name, not {image!r}")
    if dockerfile.is_file():
        if image and not container:
            notes.append(f"[environment] docker_image {image!r} ignored: the local mode builds "
                         "environment/Dockerfile")
        task.environment = parse(dockerfile, {"PATH": DEFAULT_PATH}, workdir=workdir, task_root=root,
                                 container=container)
        if image and container:  # pulled where a registry answers, else this Dockerfile is built
            task.environment.pull = image
    elif image and container:
        # no Dockerfile: the image itself, pulled, or stood in for where no registry answers
        task.environment = Environment(workdir=workdir or DEFAULT_WORKDIR, base_image=image, pull=image)
    elif image:
        raise ValueError(f"{toml_path}: [environment] docker_image {image!r} without environment/Dockerfile needs "
                         "a container backend (docker or podman); the local mode builds from environment/Dockerfile")
    else:
        raise ValueError(f"{root}: no environment/Dockerfile")
    # the build context: COPY sources were checked line by line; no other link may leave the task either
    bad = escaping_link(root / "environment", root)
    if bad is not None:
        raise ValueError(f"{bad}: a link in environment/ to {os.path.realpath(bad)}, outside the task directory: "
                         "refused, not followed")
    # [environment.env]: the environment of every phase, as Harbor sets it on the container
    task.environment.steps += [Step("env", dest=k, text=v, source=f"task.toml [environment.env] {k}")
                               for k, v in env_vars.items()]
    if compose is not None:  # its services run beside the main container (tasks/compose.py)
        task.compose = read_compose(compose, env_vars)
        task.environment.steps += [Step("env", dest=k, text=v, source=f"{compose.name} services.main.environment {k}")
                                   for k, v in task.compose.main_env.items()]
        notes += task.compose.notes
        notes.append(f"services {', '.join(task.compose.names) or '(none)'}: started by Polar in the main container's "
                     f"network namespace under {mode_name(container)} (each name is 127.0.0.1 there)")
    wd = PurePosixPath(task.workdir)
    for a in artifacts:
        p = PurePosixPath(str(a)) if str(a).startswith("/") else wd / str(a)
        if not (p == wd or wd in p.parents):
            raise ValueError(f"{toml_path}: artifacts: {a!r} is outside the work dir {wd}: the verifier of "
                             f"{mode_name(container)} shares the agent's work dir only, so nothing else reaches it")
        notes.append(f"artifact {a}: in the work dir, which the verifier shares")
    return task


def dataset_task_dirs(root: Path) -> list[Path]:
    """The task directories of a dataset, in ``dataset.toml`` order when it has one."""
    manifest = root / "dataset.toml"
    found = sorted(p for p in root.iterdir() if p.is_dir() and is_task_dir(p))
    if not manifest.is_file():
        return found
    try:
        names = tomllib.loads(manifest.read_text()).get("tasks") or []
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{manifest}: {exc}") from exc
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return found  # Harbor's own dataset.toml ([[tasks]] tables of a registry) is not an order
    by_name = {p.name: p for p in found}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"{manifest}: no task directory for {missing}")
    return [by_name[n] for n in names] + [p for p in found if p.name not in names]


def candidate_dirs(root: Path) -> list[Path]:
    """The task directories of a dataset, plus every other sub-directory that looks meant as one (it
    has a task.toml or an instruction.md but not both): those are refused by name, not skipped."""
    dirs = dataset_task_dirs(root)
    seen = set(dirs)
    for p in sorted(root.iterdir()):
        if p.is_dir() and p not in seen and ((p / "task.toml").exists() or (p / "instruction.md").exists()):
            dirs.append(p)
    return dirs


def load_dataset_report(root: Path, container: bool | str = False) -> tuple[list[Task], list[Refusal]]:
    """Every task of a dataset (or the one task directory ``root``), and the refusals of the others."""
    tasks: list[Task] = []
    refused: list[Refusal] = []
    if is_task_dir(root) or (root / "task.toml").exists():
        dirs = [root]
    else:
        try:
            dirs = candidate_dirs(root)
        except (ValueError, OSError, UnicodeDecodeError) as exc:  # a broken dataset.toml: its own row
            refused.append(Refusal("dataset.toml", root / "dataset.toml", str(exc)))
            dirs = sorted(p for p in root.iterdir() if p.is_dir() and ((p / "task.toml").exists()
                                                                      or (p / "instruction.md").exists()))
    for d in dirs:
        try:
            if not is_task_dir(d):
                raise TaskRefused(d.name, f"{d}: not a Harbor task directory: it needs task.toml and instruction.md")
            tasks.append(load_task_dir(d, container))
        except ValueError as exc:  # TaskRefused or DockerfileError: nothing else leaves load_task_dir
            refused.append(Refusal(getattr(exc, "task", d.name), d, str(exc)))
    return tasks, refused


def load_dataset(root: Path, container: bool | str = False) -> list[Task]:
    dirs = dataset_task_dirs(root)
    if not dirs:
        raise ValueError(f"{root}: neither a Harbor task directory (task.toml + instruction.md) nor a dataset of them")
    return [load_task_dir(d, container) for d in dirs]
