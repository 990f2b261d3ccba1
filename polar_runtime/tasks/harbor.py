"""Harbor task directories and datasets (directories of them): the format of Terminal-Bench 2 and
the SWE-bench adapters.

A task directory holds ``task.toml``, ``instruction.md``, ``environment/Dockerfile`` with its build
context, ``tests/test.sh`` (writes /logs/verifier/reward.txt or reward.json) and optionally
``solution/solve.sh``. The task id is the directory name. From task.toml Polar reads
``[agent] timeout_sec``, ``[verifier] timeout_sec`` and ``env``, ``[solution] env``,
``[environment] build_timeout_sec``, ``cpus``, ``memory_mb`` (or ``memory = "2G"``), ``storage_mb``
(or ``storage``: the sandbox's cap on what the agent writes) and ``allow_internet``, and its own ``[polar] followups``
(later user turns, which Harbor ignores). Other keys are ignored, as Harbor ignores keys it does
not know; ``[environment] docker_image`` (a prebuilt image) needs a container runtime.

A dataset lists its tasks in sorted directory order, or in the order of an optional
``dataset.toml`` (``tasks = ["a", "b"]``: the built-in sets use it so that ``--n-tasks 2`` picks the
two tasks the demo needs).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from polar_runtime.tasks.dockerfile import DockerfileError, parse
from polar_runtime.tasks.model import DEFAULT_PATH, Task

KNOWN = {
    "agent": {"timeout_sec", "user"},
    "verifier": {"timeout_sec", "env", "user"},
    "solution": {"env"},
    "environment": {"build_timeout_sec", "cpus", "memory_mb", "memory", "storage_mb", "storage", "allow_internet",
                    "gpus", "docker_image"},
}


def is_task_dir(path: Path) -> bool:
    return (path / "task.toml").is_file() and (path / "instruction.md").is_file()


def _size_mb(value: Any, key: str) -> int:
    """``2048`` (MB) or ``"2G"``/``"512M"`` (Harbor's older spelling) -> MB."""
    if isinstance(value, (int, float)) and value > 0:
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


def load_task_dir(root: Path) -> Task:
    """One Harbor task directory -> :class:`Task`; a ValueError names the file and what is wrong."""
    root = root.resolve()
    toml_path = root / "task.toml"
    try:
        cfg = tomllib.loads(toml_path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{toml_path}: {exc}") from exc
    instruction = (root / "instruction.md").read_text().strip()
    if not instruction:
        raise ValueError(f"{root / 'instruction.md'} is empty")
    if not (root / "tests" / "test.sh").is_file():
        raise ValueError(f"{root}: no tests/test.sh (the verifier)")
    notes: list[str] = []
    for section, keys in KNOWN.items():
        table = cfg.get(section) or {}
        if not isinstance(table, dict):
            raise ValueError(f"{toml_path}: [{section}] must be a table")
        for k in sorted(set(table) - keys):
            notes.append(f"task.toml [{section}] {k} ignored")
    agent, verifier, solution = cfg.get("agent") or {}, cfg.get("verifier") or {}, cfg.get("solution") or {}
    envc = cfg.get("environment") or {}
    try:
        memory = envc.get("memory_mb", envc.get("memory"))
        storage = envc.get("storage_mb", envc.get("storage"))
        polar = cfg.get("polar") or {}
        followups = polar.get("followups") or []
        if not isinstance(followups, list) or not all(isinstance(f, str) and f for f in followups):
            raise ValueError("[polar] followups must be a list of non-empty instructions")
        for key, table in (("agent", agent), ("verifier", verifier), ("environment", envc)):
            for tk in ("timeout_sec", "build_timeout_sec"):
                if tk in table and (not isinstance(table[tk], (int, float)) or table[tk] <= 0):
                    raise ValueError(f"[{key}] {tk} must be a positive number of seconds")
        cpus = envc.get("cpus")
        if cpus is not None and (not isinstance(cpus, (int, float)) or cpus <= 0):
            raise ValueError("[environment] cpus must be a positive number")
        if not isinstance(envc.get("allow_internet", False), bool):
            raise ValueError("[environment] allow_internet must be true or false")
        task = Task(
            id=root.name,
            instruction=instruction,
            timeout=float(agent["timeout_sec"]) if "timeout_sec" in agent else None,
            followups=list(followups),
            root=root,
            verifier_timeout=float(verifier["timeout_sec"]) if "timeout_sec" in verifier else None,
            build_timeout=float(envc["build_timeout_sec"]) if "build_timeout_sec" in envc else None,
            cpus=float(cpus) if cpus is not None else None,
            memory_mb=_size_mb(memory, "[environment] memory_mb") if memory is not None else None,
            storage_mb=_size_mb(storage, "[environment] storage_mb") if storage is not None else None,
            allow_internet=bool(envc.get("allow_internet", False)),
            verifier_env=_env_table(verifier.get("env"), "[verifier] env"),
            solution_env=_env_table(solution.get("env"), "[solution] env"),
            notes=notes,
        )
    except ValueError as exc:
        raise ValueError(f"{toml_path}: {exc}") from exc
    dockerfile = root / "environment" / "Dockerfile"
    if dockerfile.is_file():
        try:
            task.environment = parse(dockerfile, {"PATH": DEFAULT_PATH})
        except DockerfileError:
            raise
    elif envc.get("docker_image"):
        raise ValueError(f"{toml_path}: [environment] docker_image {envc['docker_image']!r} needs a container "
                         "runtime; the local mode builds from environment/Dockerfile")
    else:
        raise ValueError(f"{root}: no environment/Dockerfile")
    return task


def dataset_task_dirs(root: Path) -> list[Path]:
    """The task directories of a dataset, in ``dataset.toml`` order when it has one."""
    manifest = root / "dataset.toml"
    found = sorted(p for p in root.iterdir() if p.is_dir() and is_task_dir(p))
    if not manifest.is_file():
        return found
    try:
        names = tomllib.loads(manifest.read_text()).get("tasks") or []
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{manifest}: {exc}") from exc
    by_name = {p.name: p for p in found}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"{manifest}: no task directory for {missing}")
    return [by_name[n] for n in names] + [p for p in found if p.name not in names]


def load_dataset(root: Path) -> list[Task]:
    dirs = dataset_task_dirs(root)
    if not dirs:
        raise ValueError(f"{root}: neither a Harbor task directory (task.toml + instruction.md) nor a dataset of them")
    return [load_task_dir(d) for d in dirs]
