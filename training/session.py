"""A trainer that stays up: one process across GRPO steps, policy and AdamW state kept in memory.

``polar train`` (``run.py``) is one step per process: it loads the model, reads the optimizer
state back, trains, writes a full checkpoint (weights *and* AdamW moments) and exits; vLLM then
re-reads the weights from that checkpoint. On the 0.5B in float32 that round trip is most of a
step's fixed cost (``benchmarks/history/train-overhead.md``, "Per-step overhead"). A :class:`TrainSession` pays the
loads once, and after each step writes only what vLLM needs to serve the new policy: a
*weights-only* servable directory (``handoff``: config, safetensors, tokenizer files and the probe
that :mod:`polar_training.weights_push` verifies), which vLLM reloads in place. Full checkpoints
(with ``trainer_state.pt``) are written every ``checkpoint_every`` steps and when the session
closes, so a run can still be resumed with ``polar train --resume``.

Where the handoff goes, on CPU (vLLM 0.32's weight-transfer API, ``--weight-transfer-config``,
has only CUDA backends: ``nccl`` between processes on different GPUs and ``ipc`` for CUDA IPC
handles on the same GPU, see ``weight_transfer.py``): a safetensors file that vLLM's
``reload_weights`` reads. ``handoff_root`` picks the file system. Measured on the 0.5B
(``benchmarks/bench_train_overhead.py``): per-step overhead ~100 s with a process per step, ~10 s
with the session; tmpfs (``/dev/shm``) was no faster than the run directory (5.4-7.1 s to write,
3.6-4.2 s for vLLM to reload, either way: the file sits in the page cache), and a tmpfs copy would
pin 2.4 GiB of RAM, so the default is ``<out>/handoff``.

Memory: between steps the session holds the float32 weights and the two AdamW moments
(12 B/param: 7.5 GiB resident measured for the 0.5B); gradients are dropped after each step and
the frozen KL reference is loaded for each step's reference logprobs and freed before the first
backward (``keep_reference=False``, the default on CPU; on a GPU it stays). The step's peak is the
one-step process's (9.8 GiB measured on the 0.5B, 512 tokens, ``kl_coef 0``).

Out of process: ``python -m polar_training.session`` serves one session over a pipe (one JSON
object per line on stdin, one answer per line on the original stdout; everything the trainer
prints goes to stderr). :class:`TrainerProcess` is the client the demo keeps across iterations:
the trainer's memory stays out of the demo's own process and goes back to the system when the
session closes, and Ctrl-C reaches it (same process group).

LoRA (``lora=LoraSettings(...)``, :mod:`polar_training.lora`): the adapters are trained, the base
frozen; the handoff and the checkpoints carry the merged weights (plus the adapters alone in a
checkpoint, from which a LoRA session resumes).

One process only: under ``torchrun`` (FSDP2) use ``polar train``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from . import checkpoint as ckpt
from .config import TrainConfig

GiB = 2**30
HANDOFF_PREFIX = "handoff-"


def default_handoff_root(out: str | os.PathLike) -> Path:
    """The run directory's ``handoff/`` (disk, page cache): as fast as tmpfs here, and reclaimable."""
    return Path(out) / "handoff"


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux ``clear_refs`` 5) so the next reading is this step's peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_gib() -> float:
    """This process's peak resident memory since the last reset (VmHWM), else since its start."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rss_gib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return 0.0


@dataclass
class StepOutcome:
    """What one :meth:`TrainSession.step` did."""

    step: int  # the optimizer step count after it (= the policy version of the weights)
    updated: bool  # False: nothing to learn from (no sampled token), weights unchanged
    handoff: str | None = None  # weights-only servable directory of the new weights
    checkpoint: str | None = None  # full checkpoint written by this step (schedule), if any
    metrics: dict[str, Any] = field(default_factory=dict)  # the last optimizer step's
    timings: dict[str, float] = field(default_factory=dict)  # seconds: load_ref, fit, handoff, checkpoint
    peak_rss_gib: float = 0.0
    rss_gib: float = 0.0  # resident after the step (weights + AdamW moments)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class TrainSession:
    """Policy, reference and AdamW loaded once; :meth:`step` per rollout batch."""

    def __init__(
        self,
        model: str | os.PathLike,
        out: str | os.PathLike,
        config: TrainConfig,
        *,
        resume: str | os.PathLike | None = None,
        ref_model: str | os.PathLike | None = None,
        checkpoint_every: int = 0,
        handoff_root: str | os.PathLike | None = None,
        keep_reference: bool | None = None,
        lora: Any = None,
        log: Any = None,
    ) -> None:
        import torch

        from . import distributed as pdist
        from .heap import map_large_allocations
        from .trainer import GRPOTrainer, load_models

        if pdist.is_distributed():
            raise RuntimeError("TrainSession is single-process; under torchrun use `polar train`")
        map_large_allocations()
        t0 = time.perf_counter()
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.cfg = config
        self.checkpoint_every = max(0, int(checkpoint_every))
        self.handoff_root = Path(handoff_root) if handoff_root else default_handoff_root(self.out)
        self.resume_dir: Path | None = None
        if resume:
            self.resume_dir = ckpt.resolve_resume(self.out if str(resume) == "auto" else resume)
        self.model_dir = str(self.resume_dir) if self.resume_dir else str(model)
        self.base_model = ckpt.base_model_of(self.model_dir)
        self.ref_dir = str(ref_model) if ref_model else self.base_model
        torch.manual_seed(config.seed)
        meta = ckpt.read_meta(self.resume_dir) if self.resume_dir else {}
        if meta.get("lora") and lora is None:
            lora = meta["lora"]  # a LoRA run goes on as one
        self.lora = None
        if lora is not None:
            from . import lora as lo

            self.lora = lora if isinstance(lora, lo.LoraSettings) else lo.LoraSettings(**lora)
            # the frozen base the adapters sit on: the original model, also when resuming (the
            # checkpoint's weights file has the adapters merged in; its adapter file has them alone)
            weights_dir = meta.get("lora_base") or (self.base_model if self.resume_dir else self.model_dir)
            policy, ref = load_models(weights_dir, config, ref_dir=self.ref_dir)
            policy = lo.apply_lora(policy, self.lora)
            if self.resume_dir:
                from safetensors.torch import load_file

                loaded = policy.load_state_dict(load_file(str(self.resume_dir / ckpt.ADAPTER_FILE)), strict=False)
                if loaded.unexpected_keys:
                    raise ValueError(f"adapter keys of {self.resume_dir} not in the model: {loaded.unexpected_keys[:3]}")
            self.lora_base = weights_dir
        else:
            policy, ref = load_models(self.model_dir, config, ref_dir=self.ref_dir)
        self.trainer = GRPOTrainer(policy, config, ref_model=ref)
        from .token_record import TokenRecorder

        self.trainer.recorder = TokenRecorder(self.out)  # <out>/tokens/: the trained tokens, for polar view
        del ref
        if self.resume_dir:
            self.trainer.load_state_dict(ckpt.load_trainer_state(self.resume_dir))
        self.keep_reference = (pdist.device().type != "cpu") if keep_reference is None else keep_reference
        self.last_checkpoint_step = self.trainer.step if self.resume_dir else None
        self.last_checkpoint: Path | None = self.resume_dir
        self._probe: tuple[list[int], list[float] | None] | None = None  # ids, logprobs before the last step
        self._handoff: Path | None = None
        self.metrics_path = self.out / "metrics.jsonl"
        self._fingerprint: str | None = None  # of the model's tokenizer ("" when it has none)
        # the one metrics writer `polar train` uses too (run.py): metrics.jsonl, TensorBoard event
        # files under <out>/tensorboard and W&B when installed; the demo trains through this class
        from .metrics_log import MetricsLog

        self.metrics_log: MetricsLog | None = MetricsLog(self.out, config=config.to_dict())
        self.load_s = time.perf_counter() - t0

    @property
    def step_count(self) -> int:
        return self.trainer.step

    # ---- one rollout batch ---------------------------------------------------------------------
    def _attach_reference(self) -> float:
        """Load the frozen reference again if an earlier step freed it; returns the seconds spent."""
        if not self.cfg.loss.use_kl or self.trainer.ref_policy is not None:
            return 0.0
        from .trainer import load_model

        t0 = time.perf_counter()
        self.trainer.attach_reference(load_model(self.ref_dir, self.cfg.compute_dtype, self.cfg.attn_implementation))
        return time.perf_counter() - t0

    def step(self, trajectories: list[str] | Any, checkpoint: bool | None = None, handoff: bool = True) -> StepOutcome:
        """Train on one rollout batch (Parquet paths or a frame); write the handoff directory and,
        on the schedule (``checkpoint_every``) or when ``checkpoint`` is True, a full checkpoint."""
        from . import checkpoint as ck
        from .heap import release_freed_memory
        from .run import PROBE_TOKENS, load_trajectories

        _reset_peak_rss()
        timings: dict[str, float] = {}
        frame = load_trajectories(list(trajectories)) if isinstance(trajectories, (list, tuple)) else trajectories
        from .identity import check_trajectories

        if self._fingerprint is None:
            from polar_core.tokenizer_identity import fingerprint_of_dir

            self._fingerprint = fingerprint_of_dir(self.model_dir) or ""
        warning = check_trajectories(frame, self.model_dir, self._fingerprint or None)  # raises on a mismatch
        if warning:
            self.log(f"warning: {warning}")
        timings["load_reference_s"] = self._attach_reference()
        t0 = time.perf_counter()
        prep = self.trainer.prepare(frame)
        probe_ids = list(frame["input_ids"][0][:PROBE_TOKENS]) if frame.height else None
        probe_before = ck.probe_logprobs(self.trainer.policy, probe_ids) if probe_ids else None
        history = self.trainer.fit(prep, on_step=self._on_step, last_batch=not self.keep_reference)
        self.trainer.optimizer.zero_grad(set_to_none=True)
        release_freed_memory()
        timings["fit_s"] = time.perf_counter() - t0
        out = StepOutcome(step=self.trainer.step, updated=bool(history), timings=timings)
        if history:
            out.metrics = history[-1]
            self._probe = (probe_ids, probe_before) if probe_ids else None
            self._last_meta = {"trajectories": [str(p) for p in trajectories] if isinstance(trajectories, (list, tuple)) else [],
                               "last_metrics": history[-1],
                               "pack_summary": "; ".join(st.describe() for st in prep.stats)}
            if handoff:
                t0 = time.perf_counter()
                out.handoff = str(self.write_handoff())
                timings["handoff_s"] = time.perf_counter() - t0
            due = self.checkpoint_every and self.trainer.step % self.checkpoint_every == 0
            if checkpoint or (checkpoint is None and due):
                t0 = time.perf_counter()
                out.checkpoint = str(self.checkpoint())
                timings["checkpoint_s"] = time.perf_counter() - t0
        out.peak_rss_gib = peak_rss_gib()
        out.rss_gib = rss_gib()
        return out

    def _on_step(self, m: dict[str, float]) -> None:
        if self.metrics_log is None:  # closed, then stepped again: the JSONL is never given up
            from .metrics_log import MetricsLog

            self.metrics_log = MetricsLog(self.out, config=self.cfg.to_dict())
        self.metrics_log.write(m)
        self.log(f"train step {m['step']}: loss {m['loss']:+.5f}  reward {m.get('reward_mean', float('nan')):.3f}  "
                 f"kl {m['kl']:.2e}  {m['tokens_per_s']:.0f} tok/s")

    def _meta(self) -> dict[str, Any]:
        meta = {
            "step": self.trainer.step,
            "policy_version": self.trainer.step,
            "base_model": self.base_model,
            "parent": self.model_dir,
            "compute_dtype": self.cfg.compute_dtype,
            "config": self.cfg.to_dict(),
        }
        if self.lora is not None:
            meta.update(lora=self.lora.to_dict(), lora_base=self.lora_base)
        meta.update(getattr(self, "_last_meta", {}))
        return meta

    def _save(self, target: Path, trainer_state: dict[str, Any] | None, update_latest: bool) -> Path:
        ids, before = self._probe if self._probe else (None, None)
        return ckpt.save_checkpoint(target, self.trainer.model, self.model_dir, trainer_state=trainer_state,
                                    meta=self._meta(), probe_ids=ids, update_latest=update_latest,
                                    policy=self.trainer.policy, probe_before=before)

    def write_handoff(self) -> Path:
        """The current weights as a servable directory (no optimizer state), for vLLM to reload.

        The previous handoff directory is removed once the new one is complete: a server restarted
        on it has its weights in memory already, and the push of the new one names the new path."""
        target = self.handoff_root / f"{HANDOFF_PREFIX}{ckpt.checkpoint_name(self.trainer.step)}"
        path = self._save(target, None, update_latest=False)
        old, self._handoff = self._handoff, path
        if old is not None and old != path:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def checkpoint(self) -> Path:
        """A full, resumable checkpoint of the current step (``<out>/step-N``, ``latest`` updated)."""
        if self.last_checkpoint_step == self.trainer.step and self.last_checkpoint is not None:
            return self.last_checkpoint
        from .plots import plot_metrics

        path = self._save(self.out / ckpt.checkpoint_name(self.trainer.step), self.trainer.state_dict(), True)
        self.last_checkpoint, self.last_checkpoint_step = path, self.trainer.step
        if self.metrics_path.is_file():
            plot_metrics(self.metrics_path, self.out / "metrics.png")
        return path

    def close(self, checkpoint: bool = True) -> Path | None:
        """The checkpoint at the end (when any step was taken since the last one); handoffs removed."""
        path = None
        if checkpoint and self.trainer.step > 0 and self.last_checkpoint_step != self.trainer.step:
            path = self.checkpoint()
        elif self.last_checkpoint_step == self.trainer.step:
            path = self.last_checkpoint
        self.remove_handoff()
        if self.metrics_log is not None:
            self.metrics_log.close()
            self.metrics_log = None
        return path

    def remove_handoff(self) -> None:
        if self._handoff is not None:
            shutil.rmtree(self._handoff, ignore_errors=True)
            self._handoff = None
        try:
            self.handoff_root.rmdir()
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# the session in a process of its own, over a pipe


class SessionError(RuntimeError):
    """The trainer process refused a command or died; the message carries its error."""


def _config_from(d: dict[str, Any]) -> TrainConfig:
    return TrainConfig.from_dict(d) if d else TrainConfig()


def serve(stdin: IO[str], reply: IO[str]) -> int:
    """Answer one JSON command per line: ``init`` (once, first), ``step``, ``checkpoint``, ``close``."""
    session: TrainSession | None = None

    def answer(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj, default=str) + "\n")
        reply.flush()

    for line in stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            cmd = msg.get("cmd")
            if cmd == "init":
                if session is not None:
                    raise SessionError("init sent twice")
                session = TrainSession(msg["model"], msg["out"], _config_from(msg.get("config") or {}),
                                       resume=msg.get("resume"), ref_model=msg.get("ref_model"),
                                       checkpoint_every=int(msg.get("checkpoint_every") or 0),
                                       handoff_root=msg.get("handoff_root"), keep_reference=msg.get("keep_reference"),
                                       lora=msg.get("lora"))
                answer({"ok": True, "step": session.step_count, "load_s": session.load_s, "model_dir": session.model_dir,
                        "peak_rss_gib": peak_rss_gib(), "rss_gib": rss_gib()})
                continue
            if session is None:
                raise SessionError(f"{cmd!r} before init")
            if cmd == "step":
                outcome = session.step(msg["trajectories"], checkpoint=msg.get("checkpoint"), handoff=msg.get("handoff", True))
                answer({"ok": True, **outcome.as_dict()})
            elif cmd == "checkpoint":
                answer({"ok": True, "checkpoint": str(session.checkpoint()), "step": session.step_count})
            elif cmd == "close":
                path = session.close(checkpoint=msg.get("checkpoint", True))
                answer({"ok": True, "checkpoint": str(path) if path else None, "step": session.step_count})
                return 0
            else:
                raise SessionError(f"unknown command {cmd!r}")
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the client, which raises
            answer({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
            if session is None:
                return 1
    if session is not None:  # the client went away without close: nothing more to train
        session.remove_handoff()
    return 0


def main() -> int:
    """``python -m polar_training.session``: the replies keep the original stdout; fd 1 becomes
    stderr so that nothing the libraries print can corrupt the protocol."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return serve(sys.stdin, reply)


class TrainerProcess:
    """Client of ``python -m polar_training.session``: the demo's trainer across iterations."""

    def __init__(
        self,
        model: str | os.PathLike,
        out: str | os.PathLike,
        config: TrainConfig,
        *,
        resume: str | None = None,
        ref_model: str | None = None,
        checkpoint_every: int = 0,
        handoff_root: str | os.PathLike | None = None,
        keep_reference: bool | None = None,
        lora: Any = None,
        python: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.init = {"cmd": "init", "model": str(model), "out": str(out), "config": config.to_dict(), "resume": resume,
                     "ref_model": ref_model, "checkpoint_every": checkpoint_every,
                     "handoff_root": str(handoff_root) if handoff_root else None, "keep_reference": keep_reference,
                     "lora": lora.to_dict() if hasattr(lora, "to_dict") else lora}
        self.python = python or sys.executable
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}
        self.rss_gib = 0.0  # resident memory of the trainer after its last command (weights + AdamW state)
        self._lock = threading.Lock()

    def start(self) -> "TrainerProcess":
        self.proc = subprocess.Popen([self.python, "-m", "polar_training.session"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=self.env)
        self.info = self.call(self.init)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        if not self.running:
            raise SessionError("the trainer process is not running")
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        with self._lock:
            try:
                self.proc.stdin.write(json.dumps(msg) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise SessionError(f"the trainer process exited with {code} during {msg.get('cmd')!r} (its stderr has why)")
        data = json.loads(line)
        if "rss_gib" in data:
            self.rss_gib = float(data["rss_gib"])
        if not data.get("ok"):
            raise SessionError(f"trainer {msg.get('cmd')} failed: {data.get('error')}\n{data.get('traceback', '')}")
        return data

    def step(self, trajectories: list[str], checkpoint: bool | None = None) -> dict[str, Any]:
        return self.call({"cmd": "step", "trajectories": [str(p) for p in trajectories], "checkpoint": checkpoint})

    def checkpoint(self) -> str:
        return self.call({"cmd": "checkpoint"})["checkpoint"]

    def close(self, checkpoint: bool = True, timeout: float = 600.0) -> str | None:
        """Final checkpoint, then the process exits (its memory goes back to the system)."""
        if not self.running:
            return None
        try:
            path = self.call({"cmd": "close", "checkpoint": checkpoint})["checkpoint"]
        finally:
            self.stop(timeout)
        return path

    def stop(self, timeout: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.stdin:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "TrainerProcess":
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.stop(5.0)


if __name__ == "__main__":
    sys.exit(main())
