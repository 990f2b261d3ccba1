"""The JSONL shorthand: one task per line, converted into the same :class:`Task` as a Harbor
directory (one code path: files become COPYs into the work dir, ``setup`` a RUN, ``evaluator`` a
generated ``tests/test.sh`` writing /logs/verifier/reward.txt, ``reference`` the oracle's
``solution/solve.sh``; :func:`write_harbor_dir` writes the equivalent Harbor task directory).

Keys: ``id`` (or ``task_id``), ``instruction`` (or ``prompt``), optional ``files`` ({relative path:
content}), ``setup``, ``evaluator`` (run in the work dir after the agent: exit 0 is reward 1, or the
number on its last output line; exit != 0 is 0), ``reference`` (or ``solution``), ``timeout``
(seconds, the whole sample) and ``followups`` (later user turns).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from polar_trial.tasks.model import Task


def task_from_dict(d: dict[str, Any]) -> Task:
    tid = d.get("id", d.get("task_id"))
    text = d.get("instruction", d.get("prompt"))
    if not tid or not isinstance(tid, str):
        raise ValueError(f"task without an id: {d!r:.200}")
    if not text or not isinstance(text, str):
        raise ValueError(f"task {tid!r} has no instruction")
    files = d.get("files") or {}
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"task {tid!r}: files must map relative paths to text")
    for rel in files:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"task {tid!r}: task file {rel!r} escapes the work dir")
    followups = d.get("followups") or []
    if not isinstance(followups, list) or not all(isinstance(f, str) and f for f in followups):
        raise ValueError(f"task {tid!r}: followups must be a list of non-empty instructions")
    timeout = d.get("timeout")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"task {tid!r}: timeout must be a positive number of seconds")
    return Task(tid, text, dict(files), d.get("setup"), d.get("evaluator"), timeout, list(followups),
                reference=d.get("reference", d.get("solution")))


def load_jsonl(path: Path) -> list[Task]:
    tasks: list[Task] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            tasks.append(task_from_dict(json.loads(line)))
        except (ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from exc
    return tasks


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def write_harbor_dir(task: Task, dest: Path, base_image: str = "python:3.11-slim") -> Path:
    """Write a shorthand task as a Harbor task directory (``polar tasks convert``)."""
    if task.root is not None:
        raise ValueError(f"{task.id} already is a Harbor task ({task.root})")
    d = dest / task.id
    (d / "environment").mkdir(parents=True, exist_ok=True)
    lines = ["version = \"1.0\"", "", "[agent]", f"timeout_sec = {float(task.timeout or 600.0)}", "",
             "[verifier]", "timeout_sec = 120.0", "", "[environment]", "cpus = 1", "memory_mb = 2048",
             "allow_internet = false"]
    if task.followups:
        lines += ["", "[polar]", "followups = [" + ", ".join(_toml_str(f) for f in task.followups) + "]"]
    (d / "task.toml").write_text("\n".join(lines) + "\n")
    (d / "instruction.md").write_text(task.instruction.rstrip("\n") + "\n")
    docker = [f"FROM {base_image}", f"WORKDIR {task.workdir}"]
    for rel, content in task.files.items():
        target = d / "environment" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        docker.append(f"COPY {rel} {shlex.quote(rel)}")
    if task.setup:
        docker.append(f"RUN {task.setup}")
    (d / "environment" / "Dockerfile").write_text("\n".join(docker) + "\n")
    if task.evaluator:
        task.write_tests(d / "tests")
    if task.reference:
        task.write_solution(d / "solution")
    return d
