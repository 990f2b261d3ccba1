"""Token-level GRPO loss: asymmetric PPO-clip, truncated importance sampling, optional k3 KL.

Every tensor here is 1-D over the *sampled* tokens of a micro-batch (the ones with loss mask 1).

Importance ratios. The captured behaviour logprobs come from vLLM, whose numerics differ from the
trainer's (kernels, dtype, batch shape), so ``pi_trainer(old) != pi_vllm`` even before any update.

* With TIS (``tis_cap`` > 0, default 2.0) the estimator is decoupled PPO:
  ``ratio = exp(logp - old_logp)`` where ``old_logp`` is the trainer's own logprob before this
  rollout batch's first update (computed without grad), and every token is weighted by the
  truncated importance weight ``w = min(exp(old_logp - behaviour_logp), C)`` (detached), which
  corrects for the engine/trainer mismatch without letting rare tokens blow up the gradient.
* With TIS off (``tis_cap`` None or 0) the PPO ratio is taken directly against vLLM's behaviour
  logprobs: ``ratio = exp(logp - behaviour_logp)``, ``w = 1``.

Either way, when the policy equals the behaviour logprobs the ratio is exactly 1.

Per token: ``pg = w * max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))`` plus, when
``kl_coef`` > 0, ``kl_coef * k3`` with ``k3 = exp(ref - logp) - (ref - logp) - 1`` (the "low_var_kl"
estimator of Schulman's approximations, which verl clamps to [-10, 10]).

Aggregation (``aggregation``) turns per-token losses into the batch loss. It is expressed as a
per-token weight computed over the *whole* optimizer mini-batch (see :func:`aggregation_weights`),
so packing, gradient accumulation and data-parallel sharding never change the result:

* ``token-mean`` (default): sum over all sampled tokens / number of sampled tokens.
* ``seq-mean-token-mean``: mean over sequences of each sequence's token mean.
* ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import LossConfig

#: Bound on log-ratios before exponentiating (a -inf behaviour logprob must not produce inf/nan).
LOG_RATIO_CLAMP = 20.0


def aggregation_weights(seq_index: torch.Tensor, n_sequences: int, mode: str) -> torch.Tensor:
    """Per-token weights whose dot product with per-token losses is the aggregated batch loss.

    ``seq_index`` holds, for every sampled token of the whole mini-batch, the index (0..n-1) of its
    sequence. Micro-batches take slices of the result, so the sum over micro-batches is exact.
    """
    n_tokens = seq_index.numel()
    if n_tokens == 0:
        return torch.zeros(0, dtype=torch.float64)
    if mode == "token-mean":
        return torch.full((n_tokens,), 1.0 / n_tokens, dtype=torch.float64)
    counts = torch.bincount(seq_index, minlength=n_sequences).to(torch.float64)
    n_seq_with_tokens = int((counts > 0).sum())
    if mode == "seq-mean-token-mean":
        return 1.0 / (counts[seq_index] * n_seq_with_tokens)
    if mode == "seq-mean-token-sum":
        return torch.full((n_tokens,), 1.0 / n_seq_with_tokens, dtype=torch.float64)
    raise ValueError(f"unknown aggregation {mode!r}")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "low_var_kl") -> torch.Tensor:
    """k3 estimator of KL(pi || ref) per token (unbiased, always >= 0); low_var_kl also clamps it."""
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.exp(log_ratio) - log_ratio - 1.0
    if estimator == "low_var_kl":
        k3 = k3.clamp(-10.0, 10.0)
    return k3


@dataclass
class LossOutput:
    """The weighted loss of one micro-batch (to ``backward``) and additive statistics for metrics."""

    loss: torch.Tensor
    sums: dict[str, float] = field(default_factory=dict)  # additive over micro-batches and ranks
    maxes: dict[str, float] = field(default_factory=dict)  # max over micro-batches and ranks


def grpo_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> LossOutput:
    """The loss of one micro-batch: ``sum(weights * per_token_loss)`` (see the module docstring).

    ``old_logp`` is required when TIS is on; pass ``logp.detach()`` when this is the first update
    on the rollout batch (the trainer's old policy is then the current one, bit for bit).
    """
    behaviour_logp = behaviour_logp.to(logp.dtype)
    advantages = advantages.to(logp.dtype)
    weights = weights.to(logp.dtype)
    if cfg.use_tis:
        if old_logp is None:
            raise ValueError("TIS needs the trainer's old logprobs (old_logp)")
        old_logp = old_logp.detach().to(logp.dtype)
        log_ratio = logp - old_logp
        is_log = (old_logp - behaviour_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        is_weight = torch.exp(is_log).clamp(max=cfg.tis_cap).detach()
        tis_truncated = (is_log > torch.log(torch.tensor(cfg.tis_cap, dtype=logp.dtype))).sum()
    else:
        log_ratio = logp - behaviour_logp
        is_weight = torch.ones_like(logp)
        tis_truncated = torch.zeros((), dtype=torch.long)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = is_weight * torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    per_token = pg
    kl = None
    if cfg.use_kl:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference logprobs (ref_logp)")
        kl = kl_penalty(logp, ref_logp.detach().to(logp.dtype), cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
    loss = (weights * per_token).sum()

    with torch.no_grad():
        n = logp.numel()
        r = ratio.detach()
        clip_low = ((advantages < 0) & (r < 1.0 - cfg.clip_low)).sum()
        clip_high = ((advantages > 0) & (r > 1.0 + cfg.clip_high)).sum()
        sums = {
            "n_tokens": float(n),
            "clip_low_count": float(clip_low),
            "clip_high_count": float(clip_high),
            "ratio_sum": float(r.sum()),
            "tis_weight_sum": float(is_weight.sum()),
            "tis_truncated_count": float(tis_truncated),
            "pg_loss": float((weights * pg.detach()).sum()),
            "kl_sum": float(kl.detach().sum()) if kl is not None else 0.0,
            "mismatch_kl_sum": float(
                (behaviour_logp - (old_logp if old_logp is not None else logp.detach())).sum()
            ),
        }
        maxes = {"ratio_max": float(r.max()) if n else 0.0}
    return LossOutput(loss=loss, sums=sums, maxes=maxes)
