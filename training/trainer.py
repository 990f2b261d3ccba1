"""The GRPO training loop: trajectory frame -> advantages -> packed micro-batches -> AdamW updates.

One call of :meth:`GRPOTrainer.fit` consumes one rollout batch. It splits the samples into
``num_minibatches`` optimizer steps (per ``ppo_epochs``); each optimizer step accumulates gradients
over its packed micro-batches, clips the global grad norm and steps AdamW and the warm-up
schedule. The global optimizer step count doubles as the policy version of the weights it makes
(the base model is version 0).

The same loop runs under ``torchrun`` with FSDP2 (see :mod:`polar_training.distributed`): every rank
packs the same mini-batch deterministically, takes its share of the bins (padded with zero-weight
micro-batches so that all ranks run the same number of forward/backward passes), and scales its
loss by the world size because FSDP averages gradients across ranks.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import polars as pl
import torch

from . import distributed as pdist
from .advantages import advantage_stats, compute_advantages, compute_sample_advantages, filter_stale
from .config import TrainConfig
from .heap import release_freed_memory
from .loss import grpo_token_loss
from .packing import MicroBatch, PackStats, PackedSequence, build_microbatches, sequences_from_frame
from .policy import TokenLogprobs, policy_logprobs


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the base lr at scheduler step ``s``: linear warm-up, then constant/linear/cosine."""

    def f(s: int) -> float:
        if cfg.warmup_steps > 0 and s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant" or not cfg.total_steps:
            return 1.0
        span = max(cfg.total_steps - cfg.warmup_steps, 1)
        progress = min(max(s - cfg.warmup_steps, 0) / span, 1.0)
        if cfg.lr_schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return f


@dataclass
class Prepared:
    """A rollout batch made ready for training."""

    frame: pl.DataFrame  # trajectory rows with advantages (dropped groups removed)
    per_sample: pl.DataFrame
    minibatches: list[list[MicroBatch]]  # this rank's micro-batches per optimizer step
    stats: list[PackStats]
    data_stats: dict[str, float] = field(default_factory=dict)  # rows left out (stale, zero variance)
    left_out: dict[str, str] = field(default_factory=dict)  # trajectory_id -> why (stale | zero_variance)


@dataclass
class Accumulated:
    """Loss statistics of one optimizer step, summed over micro-batches (and ranks after reduce)."""

    sums: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)
    loss: float = 0.0
    entropy_sum: float = 0.0
    n_input_tokens: float = 0.0

    def add(self, out: Any, entropy: torch.Tensor | None, n_input_tokens: int) -> None:
        self.loss += float(out.loss.detach())
        self.entropy_sum += float(entropy.sum()) if entropy is not None else 0.0
        self.n_input_tokens += n_input_tokens
        for k, v in out.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in out.maxes.items():
            self.maxes[k] = max(self.maxes.get(k, -math.inf), v)

    def reduce(self) -> None:
        merged = dict(self.sums, _loss=self.loss, _entropy=self.entropy_sum, _tokens=self.n_input_tokens)
        merged = pdist.all_reduce_dict(merged, "sum")
        self.loss = merged.pop("_loss")
        self.entropy_sum = merged.pop("_entropy")
        self.n_input_tokens = merged.pop("_tokens")
        self.sums = merged
        self.maxes = pdist.all_reduce_dict(self.maxes, "max")

    def metrics(self) -> dict[str, float]:
        s = self.sums
        n = max(s.get("n_tokens", 0.0), 1.0)
        return {
            "loss": self.loss,
            "pg_loss": s.get("pg_loss", 0.0),
            "kl": s.get("kl_sum", 0.0) / n,
            "entropy": self.entropy_sum / n,
            "clip_frac_low": s.get("clip_low_count", 0.0) / n,
            "clip_frac_high": s.get("clip_high_count", 0.0) / n,
            "ratio_mean": s.get("ratio_sum", 0.0) / n,
            "ratio_max": self.maxes.get("ratio_max", 0.0),
            "tis_weight_mean": s.get("tis_weight_sum", 0.0) / n,
            "tis_truncated_frac": s.get("tis_truncated_count", 0.0) / n,
            "mismatch_kl": s.get("mismatch_kl_sum", 0.0) / n,
            "n_sampled_tokens": s.get("n_tokens", 0.0),
            "n_input_tokens": self.n_input_tokens,
        }


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_attention_support(cfg: "TrainConfig") -> None:
    """Refuse at start-up a packing/attention combination that would silently let packed sequences
    attend to each other (the packed == unpacked test is the guard of what is accepted here).

    ``attention="position_ids"`` relies on transformers detecting the position-id restarts: for
    sdpa/eager/flex that is ``masking_utils.find_packed_sequence_indices`` (transformers >= 4.56),
    which transformers only uses with torch >= 2.6; flash_attention_2 turns the restarts into varlen
    boundaries itself. ``attention="block_mask"`` and ``"shared_prefix"`` pass an explicit 4-D
    mask, which flash_attention_2 cannot take.
    """
    import transformers
    from packaging.version import Version

    impl = cfg.attn_implementation
    if impl not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, not {impl!r}")
    if cfg.attention in ("block_mask", "shared_prefix"):
        if impl == "flash_attention_2":
            raise ValueError(f"attention={cfg.attention} needs a kernel that takes a 4-D mask (sdpa or eager), not flash_attention_2")
        return
    if impl == "flash_attention_2":
        return
    torch_version = Version(torch.__version__.split("+")[0])
    has_detection = False
    try:
        from transformers import masking_utils

        has_detection = hasattr(masking_utils, "find_packed_sequence_indices")
    except ImportError:
        pass
    if torch_version < Version("2.6") or not has_detection:
        raise ValueError(
            f"attention=position_ids with {impl} needs transformers' packed-sequence detection (transformers "
            f">= 4.56 with torch >= 2.6; found transformers {transformers.__version__}, torch {torch.__version__}): "
            "packed sequences would attend to each other. Use attention=block_mask"
        )


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flex_attention")


def load_model(model_dir: str, dtype: str = "float32", attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A causal LM from a Hugging Face directory (offline), on this process's device."""
    from transformers import AutoModelForCausalLM

    from .checkpoint import retie_if_trained_tied

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=DTYPES[dtype], attn_implementation=attn_implementation, local_files_only=True
    )
    return retie_if_trained_tied(model, model_dir).to(pdist.device())


def load_models(
    model_dir: str, cfg: "TrainConfig", ref_dir: str | None = None, dtype: str | None = None
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """Policy and (when the KL term is on) the frozen reference (the trainer shards them under torchrun).

    The policy's weights are always float32 (the master copy the optimizer updates); with
    ``compute_dtype=bfloat16`` the reference, which is never updated, is kept in bf16. No reference
    model is loaded when ``kl_coef == 0``.
    """
    if dtype is not None and dtype != cfg.compute_dtype:  # the old way of asking for bf16
        cfg.compute_dtype = dtype
        cfg.__post_init__()
    check_attention_support(cfg)
    model = load_model(model_dir, "float32", cfg.attn_implementation)
    ref = load_model(ref_dir or model_dir, cfg.compute_dtype, cfg.attn_implementation) if cfg.loss.use_kl else None
    return model, ref


class GRPOTrainer:
    """Owns the policy, the frozen reference, AdamW and the lr schedule.

    ``model`` stays the Hugging Face model (for saving and sampling); ``policy`` wraps it as the
    sampled-token logprob module that training calls, and is what FSDP2 shards under torchrun.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, ref_model: torch.nn.Module | None = None):
        self.cfg = cfg
        if cfg.loss.use_kl and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model (or set kl_coef=0)")
        low = {p.dtype for p in model.parameters() if p.dtype not in (torch.float32, torch.float64)}
        if torch.float16 in low:
            raise ValueError("float16 weights are refused (no loss scaling): train in float32 or bfloat16 mixed precision")
        if low:
            # bf16 weights: AdamW's lr 1e-6 updates would round to zero. Keep float32 master weights
            # (and therefore float32 optimizer state) and compute in bf16.
            model = model.float()
            cfg.compute_dtype = "bfloat16"
        self.model = model
        self.ref_model = ref_model
        if cfg.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.policy = TokenLogprobs(model)
        self.ref_policy = None
        if ref_model is not None:
            self.attach_reference(ref_model, shard=False)
        self.compute_dtype = DTYPES[cfg.compute_dtype]
        if pdist.is_distributed():
            mp = self.compute_dtype if self.compute_dtype != torch.float32 else None
            pdist.shard_model(self.policy, param_dtype=mp)
            if self.ref_policy is not None:
                pdist.shard_model(self.ref_policy, param_dtype=mp)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        # Fused AdamW: one kernel per step and no full-size temporaries (the foreach path allocates
        # copies of all optimizer state; on a 0.5B model that took the peak from ~8.5 to ~11 GB).
        fused = not pdist.is_distributed() and all(p.device.type in ("cpu", "cuda") for p in params)
        self.optimizer = torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=tuple(cfg.adam_betas),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            fused=True if fused else None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.step = 0
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.rank, self.world = pdist.rank_and_world()
        #: writes the trained tokens of each batch when set (token_record.py; the session and `polar train` set it)
        self.recorder: Any = None

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything besides the weights that a resumed run needs to continue identically."""
        return {
            "step": self.step,
            "optimizer": pdist.optimizer_state_dict(self.policy, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "config": self.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        pdist.load_optimizer_state_dict(self.policy, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

    # ---- data --------------------------------------------------------------------------------
    def prepare(self, trajectories: pl.DataFrame | pl.LazyFrame) -> Prepared:
        """Advantages, the mini-batch split (seeded) and packing for this rank."""
        frame = trajectories.collect() if isinstance(trajectories, pl.LazyFrame) else trajectories
        all_ids = frame["trajectory_id"].to_list() if "trajectory_id" in frame.columns else []
        frame, data_stats = filter_stale(frame, self.step, self.cfg.max_staleness)
        per_sample = compute_sample_advantages(frame, self.cfg.adv)
        with_adv = compute_advantages(frame, self.cfg.adv)
        left_out: dict[str, str] = {}
        if all_ids:
            fresh, kept = set(frame["trajectory_id"].to_list()), set(with_adv["trajectory_id"].to_list())
            left_out = {t: "stale" if t not in fresh else "zero_variance" for t in all_ids if t not in kept}
        if self.cfg.adv.drop_zero_variance:
            data_stats["n_zero_variance_samples_dropped"] = float(per_sample["zero_variance"].sum())
            data_stats["n_zero_variance_sequences_dropped"] = float(frame.height - with_adv.height)
        sequences = sequences_from_frame(with_adv)
        sample_keys = list(zip(with_adv["group_id"].to_list(), with_adv["session_id"].to_list()))
        uniq = list(dict.fromkeys(sample_keys))
        k = max(1, min(self.cfg.num_minibatches, len(uniq)))
        order = torch.randperm(len(uniq), generator=self.generator).tolist() if k > 1 else list(range(len(uniq)))
        part_of = {uniq[j]: n % k for n, j in enumerate(order)}
        minibatches, stats = [], []
        for part in range(k):
            seqs = [s for s, key in zip(sequences, sample_keys) if part_of[key] == part]
            mbs, st = build_microbatches(seqs, self.cfg.token_budget, self.cfg.loss.aggregation, self.cfg.attention)
            minibatches.append(pdist.shard_microbatches(mbs, self.rank, self.world))
            stats.append(st)
        return Prepared(frame=with_adv, per_sample=per_sample, minibatches=minibatches, stats=stats, data_stats=data_stats,
                        left_out=left_out)

    # ---- one optimizer step ------------------------------------------------------------------
    def autocast(self):
        """bf16 compute over float32 master weights (single process; FSDP2 casts the gathered
        parameters itself through its MixedPrecisionPolicy)."""
        import contextlib

        if self.compute_dtype == torch.float32 or pdist.is_distributed():
            return contextlib.nullcontext()
        return torch.autocast(device_type=pdist.device().type, dtype=self.compute_dtype)

    @torch.no_grad()
    def fill_old_logprobs(self, microbatches: list[MicroBatch]) -> None:
        """The trainer's logprobs before any update on this rollout batch (TIS numerator)."""
        was_training = self.policy.training
        self.policy.eval()
        with self.autocast():
            for mb in microbatches:
                mb.old_logp = policy_logprobs(self.policy, mb)[0].float().cpu()
        self.policy.train(was_training)

    @torch.no_grad()
    def fill_ref_logprobs(self, microbatches: list[MicroBatch]) -> None:
        """The frozen reference's logprobs, once per rollout batch (they never change across
        epochs and mini-batches); nothing without a KL term."""
        if self.ref_policy is None or not self.cfg.loss.use_kl:
            return
        with self.autocast():
            for mb in microbatches:
                if mb.ref_logp is None:
                    mb.ref_logp = self._ref_logprobs(mb).float().cpu()

    def attach_reference(self, ref_model: torch.nn.Module, shard: bool = True) -> None:
        """Use ``ref_model`` as the frozen KL reference (again, after :meth:`release_reference`: a
        trainer that stays up across rollout batches reloads it per batch, see session.py)."""
        self.ref_model = ref_model
        self.ref_policy = TokenLogprobs(ref_model)
        self.ref_policy.eval()
        for p in self.ref_policy.parameters():
            p.requires_grad_(False)
        if shard and pdist.is_distributed():
            mp = self.compute_dtype if self.compute_dtype != torch.float32 else None
            pdist.shard_model(self.ref_policy, param_dtype=mp)

    def release_reference(self) -> None:
        """Free the frozen reference once every micro-batch has its ``ref_logp``.

        The KL term needs the reference's logprobs, not the reference: they are computed once per
        rollout batch before the first update. Holding the model through the backward passes and
        the optimizer step cost its whole size at the step's peak: a resumed float32 step of the
        0.5B (AdamW moments read back, 4.7 GB) peaked at 18.2 GiB anonymous memory with it.
        """
        if self.ref_policy is None:
            return
        self.ref_policy = None
        self.ref_model = None
        release_freed_memory()

    @torch.no_grad()
    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        return policy_logprobs(self.ref_policy, mb)[0]

    def accumulate(
        self, microbatches: list[MicroBatch], on_micro: Callable[[int], None] | None = None
    ) -> "Accumulated":
        """Forward and backward over ``microbatches`` (gradients add up; no optimizer step)."""
        cfg = self.cfg
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        acc = Accumulated()
        last = len(microbatches) - 1
        for i, mb in enumerate(microbatches):
            # FSDP: reduce-scatter gradients only after the last micro-batch of the step
            pdist.set_gradient_sync(self.policy, i == last or cfg.grad_sync == "every")
            with self.autocast():
                logp, ent = policy_logprobs(self.policy, mb, with_entropy=True)
            dev = logp.device
            if self.recorder is not None and self.recorder.active:  # before this step's update: step + 1 makes it
                self.recorder.add(mb, mb.old_logp if mb.old_logp is not None else logp.detach(), self.step + 1)
            old = None
            if cfg.loss.use_tis:
                old = mb.old_logp.to(dev) if mb.old_logp is not None else logp.detach()
            ref = None
            if cfg.loss.use_kl:
                if mb.ref_logp is None:
                    with self.autocast():
                        mb.ref_logp = self._ref_logprobs(mb).float().cpu()
                ref = mb.ref_logp.to(dev)
            out = grpo_token_loss(
                logp,
                mb.behaviour_logp.to(dev),
                mb.advantages.to(dev),
                mb.weights.to(dev),
                cfg.loss,
                old_logp=old,
                ref_logp=ref,
            )
            # FSDP averages gradients over ranks; the weights already normalize over the whole batch.
            (out.loss * self.world).backward()
            if not mb.is_padding:
                acc.add(out, ent, mb.n_tokens)
            if on_micro:
                on_micro(0 if mb.is_padding else mb.n_tokens)
        acc.reduce()
        return acc

    def train_step(
        self, microbatches: list[MicroBatch], on_micro: Callable[[int], None] | None = None
    ) -> dict[str, float]:
        """Accumulate gradients over ``microbatches``, clip, and step optimizer and schedule."""
        t0 = time.perf_counter()
        acc = self.accumulate(microbatches, on_micro)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm and self.cfg.max_grad_norm > 0 else math.inf
        grad_norm = pdist.clip_grad_norm(self.policy, max_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        elapsed = pdist.all_reduce_dict({"t": time.perf_counter() - t0}, "max")["t"]
        metrics = {"step": self.step, "policy_version": self.step, "lr": lr}
        metrics.update(acc.metrics())
        metrics.update(
            grad_norm=grad_norm,
            step_time_s=elapsed,
            tokens_per_s=acc.n_input_tokens / elapsed if elapsed > 0 else 0.0,
        )
        return metrics

    # ---- a whole rollout batch ---------------------------------------------------------------
    def fit(
        self,
        trajectories: pl.DataFrame | pl.LazyFrame | Prepared,
        on_micro: Callable[[int], None] | None = None,
        on_step: Callable[[dict[str, float]], None] | None = None,
        last_batch: bool = False,
    ) -> list[dict[str, float]]:
        """Train on one rollout batch: ``ppo_epochs`` x ``num_minibatches`` optimizer steps.

        ``last_batch``: no other batch follows in this process (``python -m polar_training`` trains one
        rollout batch per invocation), so the frozen reference is released as soon as its logprobs
        for this batch are filled, before any gradient exists (see :meth:`release_reference`), and
        the gradients once the last step is taken.
        """
        prep = trajectories if isinstance(trajectories, Prepared) else self.prepare(trajectories)
        updates = len(prep.minibatches) * self.cfg.ppo_epochs
        if self.cfg.loss.use_tis and updates > 1:
            for mbs in prep.minibatches:
                self.fill_old_logprobs(mbs)
        for mbs in prep.minibatches:
            self.fill_ref_logprobs(mbs)
        if last_batch:
            self.release_reference()
        batch_stats = advantage_stats(prep.per_sample)
        batch_stats.update(prep.data_stats)
        if "policy_version" in prep.frame.columns and prep.frame.height:
            batch_stats["data_policy_version"] = float(prep.frame["policy_version"].min() or 0)
        history = []
        if self.recorder is not None:
            self.recorder.begin(prep, self.step + 1)
        for _epoch in range(self.cfg.ppo_epochs):
            if self.recorder is not None and _epoch == 1:  # the first epoch's logprobs are the ones sampled against
                self.recorder.active = False
            for mbs, st in zip(prep.minibatches, prep.stats):
                if st.n_sampled_tokens == 0:  # e.g. every group dropped as zero-variance: no update
                    continue
                metrics = self.train_step(mbs, on_micro=on_micro)
                metrics.update(batch_stats)
                metrics.update(
                    n_sequences=st.n_sequences, n_bins=st.n_bins, padding_waste=st.padding_waste, n_oversize=st.n_oversize
                )
                history.append(metrics)
                if on_step:
                    on_step(metrics)
        if self.recorder is not None:
            self.recorder.active = bool(history)  # a batch that made no step writes no file
            self.recorder.finish()
        if last_batch:
            # The gradients are spent: dropping them keeps them out of the checkpoint save that
            # follows (2.4 GB on the 0.5B in float32).
            self.optimizer.zero_grad(set_to_none=True)
            release_freed_memory()
        return history


__all__ = [
    "Accumulated",
    "GRPOTrainer",
    "PackStats",
    "PackedSequence",
    "Prepared",
    "TrainConfig",
    "load_model",
    "load_models",
    "lr_lambda",
    "policy_logprobs",
]
