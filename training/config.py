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
    drop_zero_variance: bool = False
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
    attention: Literal["position_ids", "block_mask"] = "position_ids"
    gradient_checkpointing: bool = False
    seed: int = 0
    adv: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"lr_schedule must be constant, linear or cosine, not {self.lr_schedule!r}")
        if self.attention not in ("position_ids", "block_mask"):
            raise ValueError(f"attention must be position_ids or block_mask, not {self.attention!r}")
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
