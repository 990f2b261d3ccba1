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
* A sample whose ``group_id`` is null is a group of its own: it has no peers to compare with, so
  its advantage is 0 (ungrouped samples are never pooled into one group).
* Groups whose participating rewards are all equal (or that have fewer than two participants)
  have zero advantage everywhere; ``drop_zero_variance`` (the default) removes their rows from
  training: they carry no policy-gradient signal, only the KL term, and cost a forward/backward
  each (minutes per group of long agent sequences on a CPU). They are counted in the metrics.

:func:`filter_stale` drops the samples sampled by weights older than ``max_staleness`` optimizer
steps (``policy_version``), counted too.
"""

from __future__ import annotations

import polars as pl

from .config import AdvantageConfig

SAMPLE_KEYS = ("group_id", "session_id")
#: Prefix of the private group key of a sample whose group_id is null (it forms a group of one).
UNGROUPED = "\x00ungrouped:"


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
    # A sample without a group_id is a group of its own (one participant: zero advantage), never
    # pooled with the other ungrouped samples of the batch.
    g = pl.coalesce(pl.col("group_id"), pl.lit(UNGROUPED) + pl.col("session_id"))
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
            nulls_equal=True,  # a null group_id still identifies its sample with the session id
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


def filter_stale(
    frame: pl.DataFrame, current_version: int, max_staleness: int | None
) -> tuple[pl.DataFrame, dict[str, float]]:
    """Drop every sequence of a sample whose oldest call was served by weights more than
    ``max_staleness`` versions before ``current_version`` (the trainer's step: the version of the
    weights it is about to update). A sample is kept or dropped whole, so its sequences never
    split; a sequence with an unknown ``policy_version`` counts as stale. ``None``: no filter.
    Returns the kept rows and ``{"max_staleness_seen", "n_stale_samples", "n_stale_sequences"}``."""
    if "policy_version" not in frame.columns or not frame.height:
        return frame, {}
    age = pl.lit(current_version) - pl.col("policy_version")
    per_sample = frame.lazy().group_by(SAMPLE_KEYS).agg(
        age.max().alias("_age"), pl.col("policy_version").null_count().alias("_unknown")
    )
    seen = per_sample.select(pl.col("_age").max()).collect().item()
    stats: dict[str, float] = {"max_staleness_seen": float(seen) if seen is not None else float("nan")}
    if max_staleness is None:
        return frame, stats
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, not {max_staleness}")
    stale = per_sample.filter((pl.col("_age") > max_staleness) | (pl.col("_unknown") > 0)).select(SAMPLE_KEYS).collect()
    kept = frame.join(stale, on=list(SAMPLE_KEYS), how="anti", nulls_equal=True, maintain_order="left")
    stats.update(n_stale_samples=float(stale.height), n_stale_sequences=float(frame.height - kept.height))
    return kept, stats
