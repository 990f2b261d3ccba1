"""`polar train`: GRPO on a trajectory Parquet, checkpoint, curves, optional push to a running vLLM.

Heavy imports (torch, transformers) happen inside the command so `polar --help` stays fast.
Multi-GPU: ``torchrun --nproc-per-node N -m polar_analysis.cli train ...`` (FSDP2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train(
        model: Path = typer.Option(..., "--model", resolve_path=True, help="Base model directory (Hugging Face format)."),
        trajectories: list[Path] = typer.Option(
            ..., "--trajectories", "-t", resolve_path=True, help="Trajectory Parquet file(s) from `polar trajectories` (repeatable)."
        ),
        out: Path = typer.Option(..., "--out", "-o", resolve_path=True, help="Run directory: checkpoints, metrics.jsonl, metrics.png."),
        resume: Optional[str] = typer.Option(
            None, "--resume", help="Checkpoint or run directory to continue from; 'auto' = latest in --out."
        ),
        ref_model: Optional[Path] = typer.Option(None, "--ref-model", resolve_path=True, help="KL reference (default: the base model)."),
        lr: float = typer.Option(1e-6, "--lr"),
        warmup_steps: int = typer.Option(0, "--warmup-steps"),
        lr_schedule: str = typer.Option("constant", "--lr-schedule", help="constant | linear | cosine"),
        total_steps: Optional[int] = typer.Option(None, "--total-steps", help="Decay length for linear/cosine."),
        weight_decay: float = typer.Option(0.0, "--weight-decay"),
        max_grad_norm: float = typer.Option(1.0, "--max-grad-norm"),
        clip_low: float = typer.Option(0.2, "--clip-low"),
        clip_high: float = typer.Option(0.28, "--clip-high"),
        tis_cap: float = typer.Option(2.0, "--tis-cap", help="Truncated IS cap C; 0 disables TIS."),
        kl_coef: float = typer.Option(0.001, "--kl-coef", help="0 disables the KL term (and the reference model)."),
        kl_estimator: str = typer.Option("low_var_kl", "--kl-estimator", help="low_var_kl | k3"),
        aggregation: str = typer.Option(
            "token-mean", "--aggregation", help="token-mean | seq-mean-token-mean | seq-mean-token-sum"
        ),
        baseline: str = typer.Option("mean", "--baseline", help="mean | loo (leave-one-out)"),
        std_scale: bool = typer.Option(True, "--std-scale/--no-std-scale", help="Divide advantages by group std."),
        failure: str = typer.Option(
            "zero_advantage", "--failure", help="zero_advantage | zero_reward for failed/timed-out samples"
        ),
        drop_zero_variance: bool = typer.Option(False, "--drop-zero-variance", help="Skip groups with equal rewards."),
        token_budget: int = typer.Option(4096, "--token-budget", help="Tokens per packed micro-batch."),
        minibatches: int = typer.Option(1, "--minibatches", help="Optimizer steps per rollout batch."),
        ppo_epochs: int = typer.Option(1, "--ppo-epochs"),
        attention: str = typer.Option("position_ids", "--attention", help="position_ids | block_mask"),
        gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing"),
        grad_sync: str = typer.Option(
            "last", "--grad-sync",
            help="FSDP: reduce gradients after the last micro-batch of a step (less traffic, full-size gradients "
            "per device) or after every one (less memory).",
        ),
        dtype: str = typer.Option(
            "float32", "--dtype",
            help="float32 (fast on CPUs without bf16) | bfloat16 (mixed precision: float32 master weights and "
            "optimizer state, bf16 compute). float16 is refused.",
        ),
        attn_implementation: str = typer.Option(
            "sdpa", "--attn-implementation", help="sdpa | eager | flash_attention_2 | flex_attention (checked at start-up)"
        ),
        seed: int = typer.Option(0, "--seed"),
        push_to: Optional[str] = typer.Option(
            None, "--push-to", help="Base URL of the running vLLM to reload the new weights into."
        ),
        proxy_control: Optional[str] = typer.Option(
            None, "--proxy-control", help="Base URL of the proxy's /_polar control API (pause/resume/version)."
        ),
        progress: bool = typer.Option(True, "--progress/--no-progress"),
    ) -> None:
        """Train the policy with GRPO on captured trajectories and write a servable checkpoint."""
        from rich.console import Console

        from .advantages import AdvantageConfig
        from .loss import LossConfig
        from .run import TrainJob, run_training
        from .trainer import TrainConfig

        console = Console(stderr=True)
        try:
            cfg = TrainConfig(
                lr=lr,
                weight_decay=weight_decay,
                warmup_steps=warmup_steps,
                lr_schedule=lr_schedule,
                total_steps=total_steps,
                max_grad_norm=max_grad_norm,
                token_budget=token_budget,
                num_minibatches=minibatches,
                ppo_epochs=ppo_epochs,
                attention=attention,
                gradient_checkpointing=gradient_checkpointing,
                grad_sync=grad_sync,
                compute_dtype=dtype,
                attn_implementation=attn_implementation,
                seed=seed,
                adv=AdvantageConfig(
                    baseline=baseline, scale_std=std_scale, failure=failure, drop_zero_variance=drop_zero_variance
                ),
                loss=LossConfig(
                    clip_low=clip_low,
                    clip_high=clip_high,
                    tis_cap=tis_cap or None,
                    kl_coef=kl_coef,
                    kl_estimator=kl_estimator,
                    aggregation=aggregation,
                ),
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
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
        )
        result = run_training(job, console=console)
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
