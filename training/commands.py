"""`polar train` (also ``python -m polar_training``): GRPO on a trajectory Parquet, checkpoint, curves,
optional push to a running vLLM.

Heavy imports (torch, transformers) happen inside the command so `polar --help` stays fast.
Multi-GPU: ``torchrun --nproc-per-node N -m polar_training ...`` (FSDP2).

Every default comes from the config dataclasses (``polar_training.config``); the parameter names
are their field names, so the command builds them without repeating a name or a value.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .config import AdvantageConfig, LossConfig, TrainConfig

_TRAIN, _ADV, _LOSS = TrainConfig(), AdvantageConfig(), LossConfig()


def _fields(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The options that are fields of ``cls`` (dataclass), by name."""
    return {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}


def train_command(
    model: Annotated[Path, typer.Option("--model", resolve_path=True, help="Base model directory (Hugging Face format).")],
    trajectories: Annotated[list[Path], typer.Option(
        "--trajectories", "-t", resolve_path=True, help="Trajectory Parquet file(s) from `polar trajectories` (repeatable).")],
    out: Annotated[Path, typer.Option("--out", "-o", resolve_path=True, help="Run directory: checkpoints, metrics.jsonl, metrics.png.")],
    resume: Annotated[Optional[str], typer.Option(
        help="Checkpoint or run directory to continue from; 'auto' = latest in --out.")] = None,
    ref_model: Annotated[Optional[Path], typer.Option(resolve_path=True, help="KL reference (default: the base model).")] = None,
    lr: Annotated[float, typer.Option()] = _TRAIN.lr,
    warmup_steps: Annotated[int, typer.Option()] = _TRAIN.warmup_steps,
    lr_schedule: Annotated[str, typer.Option(help="constant | linear | cosine")] = _TRAIN.lr_schedule,
    total_steps: Annotated[Optional[int], typer.Option(help="Decay length for linear/cosine.")] = _TRAIN.total_steps,
    weight_decay: Annotated[float, typer.Option()] = _TRAIN.weight_decay,
    max_grad_norm: Annotated[float, typer.Option()] = _TRAIN.max_grad_norm,
    clip_low: Annotated[float, typer.Option()] = _LOSS.clip_low,
    clip_high: Annotated[float, typer.Option()] = _LOSS.clip_high,
    tis_cap: Annotated[float, typer.Option(help="Truncated IS cap C; 0 disables TIS.")] = _LOSS.tis_cap or 0.0,
    kl_coef: Annotated[float, typer.Option(help="0 disables the KL term (and the reference model).")] = _LOSS.kl_coef,
    kl_estimator: Annotated[str, typer.Option(help="low_var_kl | k3")] = _LOSS.kl_estimator,
    aggregation: Annotated[str, typer.Option(
        help="token-mean | seq-mean-token-mean | seq-mean-token-sum")] = _LOSS.aggregation,
    baseline: Annotated[str, typer.Option(help="mean | loo (leave-one-out)")] = _ADV.baseline,
    scale_std: Annotated[bool, typer.Option(
        "--std-scale/--no-std-scale", help="Divide advantages by group std.")] = _ADV.scale_std,
    failure: Annotated[str, typer.Option(
        help="zero_advantage | zero_reward for failed/timed-out samples")] = _ADV.failure,
    drop_zero_variance: Annotated[bool, typer.Option(
        "--drop-zero-variance/--keep-zero-variance",
        help="Leave out groups whose rewards are all equal (no policy-gradient signal; counted in the metrics).")
    ] = _ADV.drop_zero_variance,
    max_staleness: Annotated[Optional[int], typer.Option(
        help="Leave out samples served by weights more than this many versions older than the trainer's "
             "(policy_version); counted in the metrics. Default: no limit.")] = _TRAIN.max_staleness,
    token_budget: Annotated[int, typer.Option(help="Tokens per packed micro-batch.")] = _TRAIN.token_budget,
    num_minibatches: Annotated[int, typer.Option(
        "--minibatches", help="Optimizer steps per rollout batch.")] = _TRAIN.num_minibatches,
    ppo_epochs: Annotated[int, typer.Option()] = _TRAIN.ppo_epochs,
    attention: Annotated[str, typer.Option(help="position_ids | block_mask | shared_prefix (a common prefix runs once)")] = _TRAIN.attention,
    gradient_checkpointing: Annotated[bool, typer.Option(
        "--gradient-checkpointing")] = _TRAIN.gradient_checkpointing,
    grad_sync: Annotated[str, typer.Option(
        help="FSDP: reduce gradients after the last micro-batch of a step (less traffic, full-size gradients per "
             "device) or after every one (less memory).")] = _TRAIN.grad_sync,
    attn_implementation: Annotated[str, typer.Option(
        help="sdpa | eager | flash_attention_2 | flex_attention (checked at start-up)")] = _TRAIN.attn_implementation,
    dtype: Annotated[str, typer.Option(
        help="float32 (fast on CPUs without bf16) | bfloat16 (mixed precision: float32 master weights and optimizer "
             "state, bf16 compute). float16 is refused.")] = _TRAIN.compute_dtype,
    seed: Annotated[int, typer.Option()] = _TRAIN.seed,
    lora_rank: Annotated[int, typer.Option(
        help="Train LoRA adapters of this rank on every projection (peft; alpha = 2 x rank, as in `polar demo`) "
             "instead of all weights; 0: full fine-tuning. LoRA wants a larger --lr (e.g. 1e-5). A resumed LoRA run "
             "stays one. Single process: refused under torchrun (FSDP).")] = 0,
    lora_save: Annotated[Optional[str], typer.Option(
        help="LoRA checkpoints: merged (default: the adapters merged into full weights, servable and --push-to "
             "reloadable like any model) | adapter (a PEFT adapter directory, no full weights: vLLM serves it on "
             "the base model with --enable-lora --lora-modules NAME=DIR).")] = None,
    push_to: Annotated[Optional[str], typer.Option(
        help="Base URL of the running vLLM to reload the new weights into (replicas: comma-separated).")] = None,
    proxy_control: Annotated[Optional[str], typer.Option(
        help="Base URL of the proxy's /_polar control API (pause/resume/version; several proxies: comma-separated).")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Train the policy with GRPO on captured trajectories and write a servable checkpoint."""
    options = {**locals(), "tis_cap": tis_cap or None, "compute_dtype": dtype}
    from polar_core.console import make_console

    from .run import TrainJob, run_training

    console = make_console(stderr=True)
    try:
        cfg = TrainConfig(**_fields(TrainConfig, options), adv=AdvantageConfig(**_fields(AdvantageConfig, options)),
                          loss=LossConfig(**_fields(LossConfig, options)))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    lora = None
    if lora_rank < 0:
        raise typer.BadParameter("--lora-rank must be >= 0 (0: full fine-tuning)")
    if lora_rank:
        from .lora import LoraSettings

        lora = LoraSettings(rank=lora_rank, alpha=2.0 * lora_rank)
    if lora_save not in (None, "merged", "adapter"):
        raise typer.BadParameter(f"--lora-save must be merged or adapter, not {lora_save!r}")
    if lora_save == "adapter" and push_to:
        raise typer.BadParameter("--push-to reloads full weights into vLLM; serve a --lora-save adapter checkpoint "
                                 "with --enable-lora instead (or keep the default, --lora-save merged)")
    job = TrainJob(
        model=str(model),
        trajectories=[str(p) for p in trajectories],
        out=str(out),
        config=cfg,
        resume=resume,
        ref_model=str(ref_model) if ref_model else None,
        push_to=push_to,
        proxy_control=proxy_control,
        show_progress=progress,
        lora=lora,
        lora_save=lora_save,
    )
    from .identity import TokenizerMismatch

    try:
        result = run_training(job, console=console)
    except TokenizerMismatch as exc:
        console.print(f"[red]polar train: {exc}[/red]")
        raise typer.Exit(2) from None
    from . import distributed as pdist

    if pdist.is_main():
        last = result.history[-1] if result.history else {}
        console.print(
            f"[green]step {result.step}[/] checkpoint {result.checkpoint}  "
            f"loss {last.get('loss', float('nan')):+.5f}  reward {last.get('reward_mean', float('nan')):.3f}  "
            f"padding waste {100 * last.get('padding_waste', 0.0):.1f}%  "
            f"{last.get('tokens_per_s', 0.0):.0f} tok/s"
        )
        if result.push is not None:
            console.print(
                f"pushed as policy version {result.push.policy_version} via {result.push.method} "
                f"(held calls {result.push.paused_s:.1f}s)"
            )
        print(result.checkpoint)


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
