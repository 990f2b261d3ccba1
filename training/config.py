"""The trainer's settings: one dataclass per part, the one source of every default.

``polar train`` (and ``polar demo``) take their option defaults from these classes, so a default is
written once. No torch, no Polars here: the CLI imports this module to build its ``--help``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("low_var_kl", "k3")


@dataclass
class AdvantageConfig:
    baseline: Literal["mean", "loo"] = "mean"
    scale_std: bool = True
    failure: Literal["zero_advantage", "zero_reward"] = "zero_advantage"
    #: leave out groups whose rewards are all equal (zero advantage everywhere): counted, not trained
    drop_zero_variance: bool = True
    eps: float = 1e-6
    ok_statuses: tuple[str, ...] = ("ok",)

    def __post_init__(self) -> None:
        if self.baseline not in ("mean", "loo"):
            raise ValueError(f"baseline must be 'mean' or 'loo', not {self.baseline!r}")
        if self.failure not in ("zero_advantage", "zero_reward"):
            raise ValueError(f"failure must be 'zero_advantage' or 'zero_reward', not {self.failure!r}")
        self.ok_statuses = tuple(self.ok_statuses)


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = 2.0
    kl_coef: float = 0.001
    kl_estimator: Literal["low_var_kl", "k3"] = "low_var_kl"
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {self.aggregation!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, not {self.kl_estimator!r}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip ranges must be >= 0")

    @property
    def use_tis(self) -> bool:
        return bool(self.tis_cap) and self.tis_cap > 0

    @property
    def use_kl(self) -> bool:
        return self.kl_coef > 0


@dataclass
class TrainConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: int | None = None  # length of the decay for linear/cosine
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    token_budget: int = 4096
    num_minibatches: int = 1
    ppo_epochs: int = 1
    #: how packed sequences are kept apart: position_ids | block_mask | shared_prefix (a common prefix,
    #: such as a group's prompt, runs once under a prefix-tree mask; packing.py)
    attention: Literal["position_ids", "block_mask", "shared_prefix"] = "position_ids"
    #: transformers attention kernel: sdpa | eager | flash_attention_2 | flex_attention (checked at start-up)
    attn_implementation: str = "sdpa"
    #: compute dtype. float32, or bfloat16 = mixed precision: float32 master weights and AdamW state,
    #: bf16 matmuls (autocast; FSDP2 MixedPrecisionPolicy under torchrun). float16 is refused (no loss scaling).
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    gradient_checkpointing: bool = False
    #: FSDP: reduce-scatter gradients after the "last" micro-batch of a step only (unsharded gradients
    #: accumulate locally: less communication, full-size gradients per device) or after "every" one
    grad_sync: Literal["last", "every"] = "last"
    seed: int = 0
    #: leave out samples served by weights more than this many versions (optimizer steps) older
    #: than the trainer's (``policy_version``); None: no limit. Counted in the metrics.
    max_staleness: int | None = None
    adv: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"lr_schedule must be constant, linear or cosine, not {self.lr_schedule!r}")
        if self.attention not in ("position_ids", "block_mask", "shared_prefix"):
            raise ValueError(f"attention must be position_ids, block_mask or shared_prefix, not {self.attention!r}")
        if self.compute_dtype == "float16":
            raise ValueError(
                "compute_dtype float16 is refused: without loss scaling its gradients underflow; use bfloat16 "
                "(mixed precision with float32 master weights) or float32"
            )
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, not {self.compute_dtype!r}")
        if self.grad_sync not in ("last", "every"):
            raise ValueError(f"grad_sync must be last or every, not {self.grad_sync!r}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (or None), not {self.max_staleness}")
        if self.token_budget <= 0 or self.num_minibatches <= 0 or self.ppo_epochs <= 0:
            raise ValueError("token_budget, num_minibatches and ppo_epochs must be positive")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        d = dict(d)
        adv = AdvantageConfig(**d.pop("adv", {}))
        loss = LossConfig(**d.pop("loss", {}))
        if "adam_betas" in d:
            d["adam_betas"] = tuple(d["adam_betas"])
        return cls(adv=adv, loss=loss, **d)
