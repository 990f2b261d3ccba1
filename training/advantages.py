"""Group-relative advantages (GRPO) computed with Polars expressions over the trajectory frame.

A *group* is every sample of one task in one rollout step (``group_id``); a *sample* is one harness
run (``session_id``), which may own several sequences (prefix breaks, sub-agent chains). Statistics
are taken over samples, never over sequences, so a sample split into three sequences does not
count three times; the sample's advantage is then broadcast to all of its sequences (and, in
packing, to every sampled token of them).

Choices (all in :class:`AdvantageConfig`):

* ``baseline="mean"``: ``A_i = r_i - mean(r)``; ``baseline="loo"`` (leave-one-out, RLOO):
  ``A_i = r_i - mean(r_j, j != i)``.
* ``scale_std``: divide by the group's sample standard deviation (``ddof=1``, as TRL/verl do)
  plus ``eps``. Off gives Dr.GRPO-style unscaled advantages.
* ``failure="zero_advantage"`` (default): failed or timed-out samples get advantage 0 and are left
  out of the group statistics (their reward says nothing about the policy's answer).
  ``failure="zero_reward"``: they count as reward 0 and take part like any other sample.
* Groups whose participating rewards are all equal (or that have fewer than two participants)
  have zero advantage everywhere; ``drop_zero_variance`` removes their rows from training.
"""

from __future__ import annotations

import polars as pl

from .config import AdvantageConfig

SAMPLE_KEYS = ("group_id", "session_id")


def sample_rewards(trajectories: pl.DataFrame | pl.LazyFrame) -> pl.LazyFrame:
    """One row per sample: its reward and status (a sample is not ok if any of its sequences is not).

    Raises (when collected) if the sequences of one sample disagree on the reward: that would mean
    the reward was attached per sequence by mistake, and training on it would be silently wrong.
    """
    lf = trajectories.lazy()
    return lf.group_by(SAMPLE_KEYS, maintain_order=True).agg(
        pl.col("reward").first().alias("reward"),
        pl.col("reward").n_unique().alias("_n_rewards"),
        pl.col("reward").null_count().alias("_n_null_rewards"),
        pl.col("status").filter(pl.col("status") != "ok").first().fill_null("ok").alias("status"),
        pl.len().alias("n_sequences"),
    )


def compute_sample_advantages(trajectories: pl.DataFrame | pl.LazyFrame, cfg: AdvantageConfig) -> pl.DataFrame:
    """Per-sample advantages and group statistics (see the module docstring for the rules)."""
    samples = sample_rewards(trajectories).collect()
    bad = samples.filter(pl.col("_n_rewards") > 1)
    if bad.height:
        raise ValueError(f"sequences of one sample carry different rewards: {bad['session_id'].to_list()[:5]}")
    ok = pl.col("status").is_in(list(cfg.ok_statuses))
    missing = samples.filter((pl.col("_n_null_rewards") > 0) & ok)
    if missing.height:
        raise ValueError(f"samples without a reward (attach rewards first): {missing['session_id'].to_list()[:5]}")

    if cfg.failure == "zero_reward":
        r = pl.when(ok).then(pl.col("reward")).otherwise(0.0)
        participates = pl.lit(True)
    else:
        r = pl.when(ok).then(pl.col("reward")).otherwise(None)
        participates = ok
    g = "group_id"
    stats = samples.with_columns(
        r.cast(pl.Float64).alias("_r"), participates.alias("_participates")
    ).with_columns(
        pl.col("_r").count().over(g).alias("group_size"),
        pl.col("_r").sum().over(g).alias("_sum"),
        pl.col("_r").mean().over(g).alias("group_reward_mean"),
        pl.col("_r").std(ddof=1).over(g).alias("group_reward_std"),
        (pl.col("_r").max().over(g) == pl.col("_r").min().over(g)).fill_null(True).alias("_flat"),
    )
    n = pl.col("group_size")
    if cfg.baseline == "mean":
        baseline = pl.col("group_reward_mean")
    else:
        baseline = (pl.col("_sum") - pl.col("_r")) / (n - 1)
    adv = pl.col("_r") - baseline
    if cfg.scale_std:
        adv = adv / (pl.col("group_reward_std") + cfg.eps)
    zero_variance = pl.col("_flat") | (n < 2)
    stats = stats.with_columns(
        zero_variance.alias("zero_variance"),
        pl.when(pl.col("_participates") & ~zero_variance).then(adv).otherwise(0.0).alias("advantage"),
    )
    return stats.select(
        *SAMPLE_KEYS,
        "reward",
        "status",
        "n_sequences",
        "group_size",
        "group_reward_mean",
        "group_reward_std",
        "zero_variance",
        "advantage",
    )


def compute_advantages(trajectories: pl.DataFrame | pl.LazyFrame, cfg: AdvantageConfig | None = None) -> pl.DataFrame:
    """The trajectory frame with an ``advantage`` column broadcast from its sample (rows of dropped
    zero-variance groups removed when ``cfg.drop_zero_variance``)."""
    cfg = cfg or AdvantageConfig()
    per_sample = compute_sample_advantages(trajectories, cfg)
    if cfg.drop_zero_variance:
        per_sample = per_sample.filter(~pl.col("zero_variance"))
    joined = (
        trajectories.lazy()
        .join(
            per_sample.lazy().select(
                *SAMPLE_KEYS, "advantage", "group_size", "group_reward_mean", "group_reward_std", "zero_variance"
            ),
            on=list(SAMPLE_KEYS),
            how="inner" if cfg.drop_zero_variance else "left",
            maintain_order="left",
        )
        .collect()
    )
    return joined


def advantage_stats(per_sample: pl.DataFrame) -> dict[str, float]:
    """Reward and advantage summaries for the metrics log."""
    row = per_sample.select(
        pl.col("reward").mean().alias("reward_mean"),
        pl.col("reward").std().alias("reward_std"),
        pl.col("advantage").mean().alias("advantage_mean"),
        pl.col("advantage").std().alias("advantage_std"),
        pl.col("advantage").abs().max().alias("advantage_abs_max"),
        (pl.col("status") != "ok").mean().alias("failed_fraction"),
        pl.col("group_id").n_unique().alias("n_groups"),
        pl.col("group_id").filter(pl.col("zero_variance")).n_unique().alias("n_zero_variance_groups"),
        pl.len().alias("n_samples"),
    ).row(0, named=True)
    return {k: (float(v) if v is not None else float("nan")) for k, v in row.items()}
