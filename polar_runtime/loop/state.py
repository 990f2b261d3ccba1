"""The loop's progress on disk: one JSON file, replaced atomically once per finished phase.

What resume reads (``<out>/loop-state.json``):

- ``next_step``: the first rollout step not finished; its samples that did finish are kept by the
  rollout runner's result store (``captures/rollouts/``), so a kill loses only samples in flight;
- ``policy_version`` and ``checkpoint``: the weights vLLM serves and the trainer resumes from (a
  full checkpoint: weights, AdamW moments, the trainer's RNG); ``None`` is the base model, v0;
- ``pending``: a step whose training finished (its checkpoint written) but whose push may not have:
  resume serves that checkpoint under its version (the push is done by starting there) and marks
  the step finished, instead of training it again;
- ``steps``: the finished steps' records (rewards, training metrics, push, staleness), for the report;
- ``schedule``: asynchronous mode only: the groups admitted and not yet trained (id, task, the
  batch they belong to, the version served when they started), the dropped ones, closed batches;
  resume runs the admitted groups again (their finished samples are reused), in the same batches;
- ``timing``: busy seconds of the trainer and of vLLM, and the wall time, over every run of it.

The file is written to a temporary sibling and renamed over the old one (``os.replace``), with an
``fsync`` of both: a ``kill -9`` at any instant leaves the previous state or the new one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

STATE_FILE = "loop-state.json"
FORMAT = 1


@dataclass
class LoopState:
    next_step: int = 0
    policy_version: int = 0
    checkpoint: Optional[str] = None
    pending: Optional[dict[str, Any]] = None  # {"step", "checkpoint", "policy_version", "record"}
    steps: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the configuration it runs under
    resumes: int = 0
    schedule: dict[str, Any] = field(default_factory=dict)  # asynchronous mode: staleness.Admission.to_dict + tasks
    timing: dict[str, float] = field(default_factory=dict)  # measures.IdleMeter.snapshot
    format: int = FORMAT

    @classmethod
    def load(cls, out: Path) -> "LoopState | None":
        path = Path(out) / STATE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: state format {data.get('format')}, this Polar writes {FORMAT}")
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def save(self, out: Path) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / STATE_FILE
        tmp = out / f".{STATE_FILE}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(asdict(self), fh, indent=2, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
