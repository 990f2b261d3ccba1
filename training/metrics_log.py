"""The trainer's metrics, one row per optimizer step, to every sink that is there.

* ``metrics.jsonl`` in the run directory, always (appended across invocations; ``plots.py`` draws
  ``metrics.png`` from it, the demo's report reads it);
* TensorBoard event files under ``<run>/tensorboard/`` (``torch.utils.tensorboard``; ``tensorboard
  --logdir <run>/tensorboard``), every numeric metric as a scalar at its ``step``. One writer per
  process: a run of one-step processes leaves one event file each in the same directory, which
  TensorBoard reads as one run;
* Weights & Biases when the ``wandb`` package is installed and not disabled (``WANDB_MODE=disabled``):
  online with ``WANDB_API_KEY`` set, else offline files under ``<run>/wandb`` (``wandb sync``). The
  run id is kept in ``<run>/wandb-run-id`` so that later invocations resume the same W&B run.

A sink that fails to start is reported once and left out; the JSONL is never given up for it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("polar.train.metrics")

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb-run-id"


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or k == "step":
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


class MetricsLog:
    """``write(row)`` appends ``row`` to the JSONL and, when present, TensorBoard and W&B."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, wandb: bool | None = None,
                 config: dict[str, Any] | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.dir / "metrics.jsonl"
        self.tb = None
        self.wandb = None
        self.sinks = ["jsonl"]
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=str(self.dir / TENSORBOARD_DIR))
                self.sinks.append("tensorboard")
            except Exception as exc:  # noqa: BLE001 - the package may be missing: JSONL still written
                log.warning("no TensorBoard logs: %s", exc)
        if wandb is None:
            wandb = os.environ.get("WANDB_MODE") != "disabled"
        if wandb:
            self._start_wandb(config or {})

    def _start_wandb(self, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            return
        id_file = self.dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        try:
            run = wandb.init(project=os.environ.get("WANDB_PROJECT", "polar"), dir=str(self.dir), id=run_id,
                             resume="allow", mode=mode, config=config, name=self.dir.name)
        except Exception as exc:  # noqa: BLE001 - never lose the step for a logging service
            log.warning("no W&B logs: %s", exc)
            return
        self.wandb = run
        if run_id is None and getattr(run, "id", None):
            id_file.write_text(str(run.id) + "\n")
        self.sinks.append(f"wandb ({mode})")

    def write(self, row: dict[str, Any]) -> None:
        with open(self.jsonl, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        step = int(row.get("step", 0))
        scalars = _scalars(row)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
