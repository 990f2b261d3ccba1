"""One ``polar train`` invocation: trajectories Parquet -> GRPO updates -> checkpoint (-> served).

Writes into the run directory::

    metrics.jsonl      one JSON object per optimizer step (appended across invocations)
    metrics.png        the curves so far
    step-000012/       the checkpoint after this invocation (see checkpoint.py); ``latest`` names it
    tokens/            per batch, every trained token's behaviour and trainer logprob (token_record.py)

Works the same under ``torchrun`` (FSDP2; rank 0 writes files and draws the progress bar).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from polar_core.schema import TRAJECTORY_COLUMNS

from . import checkpoint as ckpt
from . import distributed as pdist
from .identity import check_trajectories

log = logging.getLogger("polar.train")

#: Columns the trainer reads (the rest of the trajectory schema is carried for provenance only).
NEEDED_COLUMNS = ("trajectory_id", "session_id", "group_id", "input_ids", "loss_mask", "logprobs", "reward", "status")
assert set(NEEDED_COLUMNS) <= set(TRAJECTORY_COLUMNS)

#: Length of the probe sequence stored with a checkpoint to verify what the server serves.
PROBE_TOKENS = 48


@dataclass
class TrainJob:
    model: str
    trajectories: list[str]
    out: str
    config: Any  # TrainConfig
    resume: str | None = None  # checkpoint dir, run dir, or "auto" (latest in ``out``)
    ref_model: str | None = None  # default: the base model the policy descends from
    dtype: str | None = None  # compute dtype, overrides config.compute_dtype when set
    lora: Any = None  # LoraSettings: train LoRA adapters instead of all weights (a resumed LoRA run stays one)
    lora_save: str | None = None  # merged (default: full weights, adapters merged) | adapter (a PEFT adapter dir)
    push_to: str | None = None  # base URL of a running vLLM to reload
    proxy_control: str | None = None  # base URL of the proxy's /_polar control API
    show_progress: bool = True
    extra_meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunResult:
    checkpoint: Path
    step: int
    history: list[dict[str, float]]
    pack_summary: str
    push: Any = None


def load_trajectories(paths: list[str]) -> pl.DataFrame:
    """Lazily scan one or more trajectory Parquet files (globs allowed) and keep what training needs."""
    lf = pl.scan_parquet(paths)
    names = lf.collect_schema().names()
    missing = [c for c in NEEDED_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"trajectory Parquet lacks columns {missing} (see polar_core.schema.TRAJECTORY_COLUMNS)")
    keep = [c for c in names if c in TRAJECTORY_COLUMNS]
    return lf.select(keep).collect()


def _append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def run_training(job: TrainJob, console=None) -> RunResult:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .heap import map_large_allocations
    from .metrics_log import MetricsLog
    from .plots import plot_metrics
    from .trainer import GRPOTrainer, load_models

    map_large_allocations()  # before the models load: the step's peak is then weights, gradients, moments
    pdist.init_from_env()
    main = pdist.is_main()
    out = Path(job.out)
    if main:
        out.mkdir(parents=True, exist_ok=True)
    resume_dir: Path | None = None
    if job.resume:
        resume_dir = ckpt.resolve_resume(out if job.resume == "auto" else job.resume)
    model_dir = str(resume_dir) if resume_dir else job.model
    base_model = ckpt.base_model_of(model_dir) if resume_dir else ckpt.base_model_of(job.model)
    cfg = job.config
    frame = load_trajectories(job.trajectories)
    # before any model loads: another tokenizer's ids are refused, naming both (identity.py)
    warning = check_trajectories(frame, model_dir)
    if warning and main:
        (console.print(f"[yellow]warning: {warning}") if console is not None else log.warning(warning))
    torch.manual_seed(cfg.seed)
    prev = ckpt.read_meta(resume_dir) if resume_dir else {}
    lora_settings = job.lora if job.lora is not None else prev.get("lora")  # a LoRA run goes on as one
    lora_save = job.lora_save or prev.get("lora_save") or "merged"
    lora_base = None
    if lora_settings is None:
        if job.lora_save == "adapter":
            raise ValueError("--lora-save adapter needs --lora-rank (a LoRA run)")
        model, ref = load_models(model_dir, cfg, ref_dir=job.ref_model or base_model, dtype=job.dtype)
    else:
        model, ref, lora_settings, lora_base = _load_lora(job, cfg, lora_settings, lora_save, resume_dir, prev,
                                                          model_dir, base_model)
    trainer = GRPOTrainer(model, cfg, ref_model=ref)
    from .token_record import TokenRecorder

    trainer.recorder = TokenRecorder(out, trainer.rank, trainer.world)  # <out>/tokens/: what polar view shows
    del ref  # the trainer's reference is its only one, so fit(last_batch=True) can free it
    if resume_dir:
        trainer.load_state_dict(ckpt.load_trainer_state(resume_dir))

    prep = trainer.prepare(frame)
    summary = "; ".join(st.describe() for st in prep.stats)
    if main and console is not None:
        console.print(f"[bold]polar train[/] {model_dir} <- {frame.height} sequences; {summary}")
        left_out = {k: int(v) for k, v in prep.data_stats.items() if k.startswith("n_") and v}
        if left_out:
            console.print("left out: " + ", ".join(f"{k.removeprefix('n_').replace('_', ' ')} {v}" for k, v in left_out.items()))
    metrics_path = out / "metrics.jsonl"
    # JSONL (what plots.py and the demo read), TensorBoard and, when installed, W&B: see metrics_log.py
    mlog = MetricsLog(out, config=cfg.to_dict()) if main else None
    total_micro = sum(len(m) for m in prep.minibatches) * cfg.ppo_epochs

    progress = Progress(
        TextColumn("[bold blue]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not (main and job.show_progress),
        transient=False,
    )

    with progress:
        task = progress.add_task("train", total=total_micro, info="")

        def on_micro(_n: int) -> None:
            progress.advance(task)

        def on_step(m: dict[str, float]) -> None:
            progress.update(
                task,
                info=f"step {m['step']} loss {m['loss']:+.4f} reward {m.get('reward_mean', float('nan')):.3f} "
                f"kl {m['kl']:.4f} {m['tokens_per_s']:.0f} tok/s",
            )
            if mlog is not None:
                mlog.write(m)

        probe_ids = list(frame["input_ids"][0][:PROBE_TOKENS]) if frame.height else None
        probe_before = ckpt.probe_logprobs(trainer.policy, probe_ids) if probe_ids else None  # collective
        try:
            history = trainer.fit(prep, on_micro=on_micro, on_step=on_step, last_batch=True)
        finally:
            if mlog is not None:
                mlog.close()

    if not history:  # nothing to learn from (no sampled tokens left): keep the current weights
        if main and console is not None:
            console.print("[yellow]no sampled tokens to train on (all groups dropped?); no update, no checkpoint")
        return RunResult(checkpoint=Path(model_dir), step=trainer.step, history=[], pack_summary=summary)
    ckpt_dir = out / ckpt.checkpoint_name(trainer.step)
    meta = {
        "step": trainer.step,
        "policy_version": trainer.step,
        "base_model": base_model,
        "parent": model_dir,
        "trajectories": [os.path.abspath(p) for p in job.trajectories],
        "last_metrics": history[-1] if history else {},
        "pack_summary": summary,
    }
    if lora_settings is not None:
        meta.update(lora=lora_settings.to_dict(), lora_base=lora_base, lora_save=lora_save)
    meta.update(job.extra_meta)
    state = trainer.state_dict()  # collective under FSDP
    meta["compute_dtype"] = cfg.compute_dtype
    meta["config"] = cfg.to_dict()  # what trained these weights (also in trainer_state.pt, which is GBs)
    ckpt.save_checkpoint(
        ckpt_dir,
        trainer.model,
        model_dir,
        trainer_state=state if main else None,
        meta=meta,
        probe_ids=probe_ids,
        policy=trainer.policy,
        probe_before=probe_before,
        adapter_only=lora_save == "adapter" and lora_settings is not None,
    )
    result = RunResult(checkpoint=ckpt_dir, step=trainer.step, history=history, pack_summary=summary)
    if main:
        plot_metrics(metrics_path, out / "metrics.png")
        if job.push_to:
            from .weights_push import push_weights

            result.push = push_weights(ckpt_dir, job.push_to, job.proxy_control, trainer.step)
    if pdist.is_distributed():
        import torch.distributed as dist

        dist.barrier()
    return result


def _load_lora(job: TrainJob, cfg: Any, settings: Any, save: str, resume_dir: Path | None, prev: dict[str, Any],
               model_dir: str, base_model: str) -> tuple[Any, Any, Any, str]:
    """Policy with LoRA adapters on its frozen base (resumed: the run's base model and the
    checkpoint's adapters), the reference, the settings and that base. Single process only:
    under torchrun (FSDP2) the merged and PEFT state dicts would be taken from sharded
    parameters, which ``lora.py`` does not gather, so LoRA is refused there rather than saved wrong."""
    from . import lora as lo
    from .trainer import load_models

    if pdist.is_distributed():
        raise ValueError("LoRA (--lora-rank) is single-process: under torchrun (FSDP) train all weights, "
                         "or run polar train without torchrun")
    if save not in lo.LORA_SAVE:
        raise ValueError(f"--lora-save must be one of {', '.join(lo.LORA_SAVE)}, not {save!r}")
    if save == "adapter" and job.push_to:
        raise ValueError("--push-to reloads full weights into vLLM; a --lora-save adapter checkpoint is served "
                         "with --enable-lora instead (or use the default, --lora-save merged)")
    settings = settings if isinstance(settings, lo.LoraSettings) else lo.LoraSettings(**settings)
    # the frozen base the adapters sit on: the original model, also when resuming (a merged
    # checkpoint's weights file has the adapters in it, an adapter checkpoint has no weights)
    weights_dir = prev.get("lora_base") or (base_model if resume_dir else model_dir)
    model, ref = load_models(weights_dir, cfg, ref_dir=job.ref_model or base_model, dtype=job.dtype)
    model = lo.apply_lora(model, settings)
    if resume_dir:
        from safetensors.torch import load_file

        loaded = model.load_state_dict(lo.from_peft_state_dict(load_file(str(resume_dir / ckpt.ADAPTER_FILE))),
                                       strict=False)
        if loaded.unexpected_keys:
            raise ValueError(f"adapter keys of {resume_dir} not in the model: {loaded.unexpected_keys[:3]}")
    return model, ref, settings, weights_dir
