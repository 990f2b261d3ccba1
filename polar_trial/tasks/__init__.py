"""Tasks: what ``--tasks`` names, loaded into one :class:`Task` object whatever the format.

``--tasks`` takes a Harbor task directory, a Harbor dataset (a directory of task directories), a
JSONL file of the shorthand, or the name of a built-in dataset under this package (``coding``,
``followups``: Harbor datasets themselves). One module per format: ``harbor.py``, ``jsonl.py``;
``dockerfile.py`` is what the local mode honours of an environment's Dockerfile, and
``environment.py`` builds it.
"""

from __future__ import annotations

from pathlib import Path

from polar_trial.tasks.harbor import is_task_dir, load_dataset, load_task_dir
from polar_trial.tasks.jsonl import load_jsonl, task_from_dict, write_harbor_dir
from polar_trial.tasks.model import Environment, Step, Task

TASKS_DIR = Path(__file__).resolve().parent

__all__ = ["Environment", "Step", "Task", "TASKS_DIR", "builtin_sets", "load_tasks", "resolve_tasks_path",
           "task_from_dict", "write_harbor_dir", "load_task_dir", "is_task_dir"]


def builtin_sets() -> list[Path]:
    """The built-in datasets (directories under this package)."""
    return sorted(p for p in TASKS_DIR.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def resolve_tasks_path(spec: str | Path) -> Path:
    """A path (task dir, dataset dir, JSONL file), or the name of a built-in dataset."""
    p = Path(spec)
    if p.exists():
        return p
    builtin = TASKS_DIR / str(spec)
    if builtin.is_dir() and not str(spec).startswith(("_", ".")) and "/" not in str(spec):
        return builtin
    raise FileNotFoundError(f"no tasks {spec!r}: give a Harbor task directory, a dataset directory or a JSONL "
                            f"file (built-in: {', '.join(b.name for b in builtin_sets())})")


def load_tasks(spec: str | Path, container: bool | str = False) -> list[Task]:
    """``container``: Dockerfiles planned for a container backend's image build (any FROM, COPY
    anywhere), not the local mode's subset (``tasks/dockerfile.py``)."""
    path = resolve_tasks_path(spec)
    if path.is_dir():
        tasks = [load_task_dir(path, container)] if is_task_dir(path) else load_dataset(path, container)
    else:
        tasks = load_jsonl(path)
    ids = [t.id for t in tasks]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise ValueError(f"{path}: duplicate task ids {sorted(dup)}")
    return tasks
