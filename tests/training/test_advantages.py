"""Group-relative advantages: normalization, leave-one-out, failures, zero-variance groups, broadcast."""

from __future__ import annotations

import statistics

import polars as pl
import pytest

from polar_training.advantages import AdvantageConfig, compute_advantages, compute_sample_advantages


def frame(rows):
    """rows: (group, session, reward, status[, n_sequences])"""
    out = []
    for r in rows:
        g, s, rew, st = r[:4]
        for seg in range(r[4] if len(r) > 4 else 1):
            out.append(
                {
                    "trajectory_id": f"{s}/{seg}",
                    "group_id": g,
                    "session_id": s,
                    "reward": rew,
                    "status": st,
                    "input_ids": [1, 2, 3],
                    "loss_mask": [0, 1, 1],
                    "logprobs": [0.0, -1.0, -1.0],
                }
            )
    return pl.DataFrame(out)


def adv_of(df: pl.DataFrame) -> dict[str, float]:
    return dict(zip(df["session_id"].to_list(), df["advantage"].to_list()))


def test_group_normalized_advantages():
    rewards = [1.0, 0.0, 0.5, 1.0]
    df = frame([("g", f"s{i}", r, "ok") for i, r in enumerate(rewards)] + [("h", "t0", 3.0, "ok"), ("h", "t1", 1.0, "ok")])
    got = adv_of(compute_sample_advantages(df, AdvantageConfig(eps=0.0)))
    mu, sd = statistics.mean(rewards), statistics.stdev(rewards)
    for i, r in enumerate(rewards):
        assert got[f"s{i}"] == pytest.approx((r - mu) / sd)
    assert got["t0"] == pytest.approx(1 / statistics.stdev([3.0, 1.0]))
    assert sum(got[f"s{i}"] for i in range(4)) == pytest.approx(0.0, abs=1e-12)


def test_leave_one_out_baseline():
    rewards = [1.0, 0.0, 0.5, 1.0]
    df = frame([("g", f"s{i}", r, "ok") for i, r in enumerate(rewards)])
    got = adv_of(compute_sample_advantages(df, AdvantageConfig(baseline="loo", scale_std=False)))
    for i, r in enumerate(rewards):
        others = rewards[:i] + rewards[i + 1 :]
        assert got[f"s{i}"] == pytest.approx(r - sum(others) / len(others))
    # LOO advantages are the mean-baseline ones scaled by n/(n-1)
    mean_adv = adv_of(compute_sample_advantages(df, AdvantageConfig(scale_std=False)))
    assert got["s0"] == pytest.approx(mean_adv["s0"] * 4 / 3)


def test_no_std_scaling():
    df = frame([("g", "a", 2.0, "ok"), ("g", "b", 0.0, "ok"), ("g", "c", 1.0, "ok")])
    got = adv_of(compute_sample_advantages(df, AdvantageConfig(scale_std=False)))
    assert got == pytest.approx({"a": 1.0, "b": -1.0, "c": 0.0})


def test_failed_and_timed_out_samples_get_zero_advantage_and_stay_out_of_the_stats():
    df = frame([("g", "a", 1.0, "ok"), ("g", "b", 0.0, "ok"), ("g", "c", 0.9, "failed"), ("g", "d", None, "timeout")])
    per = compute_sample_advantages(df, AdvantageConfig(scale_std=False))
    got = adv_of(per)
    assert got["c"] == 0.0 and got["d"] == 0.0
    assert got["a"] == pytest.approx(0.5) and got["b"] == pytest.approx(-0.5)  # mean over a, b only
    assert per.filter(pl.col("session_id") == "a")["group_size"].item() == 2


def test_failure_as_zero_reward_option():
    df = frame([("g", "a", 1.0, "ok"), ("g", "b", 1.0, "ok"), ("g", "c", 0.9, "failed")])
    got = adv_of(compute_sample_advantages(df, AdvantageConfig(failure="zero_reward", scale_std=False)))
    assert got["c"] == pytest.approx(-2 / 3) and got["a"] == pytest.approx(1 / 3)


def test_zero_variance_groups_are_zero_and_can_be_dropped():
    df = frame(
        [("flat", "a", 1.0, "ok"), ("flat", "b", 1.0, "ok"), ("flat", "c", 0.3, "failed")]
        + [("solo", "z", 1.0, "ok")]
        + [("var", "x", 1.0, "ok"), ("var", "y", 0.0, "ok")]
    )
    kept = compute_advantages(df, AdvantageConfig(drop_zero_variance=False))  # --keep-zero-variance
    assert adv_of(kept)["a"] == 0.0 and adv_of(kept)["z"] == 0.0
    assert set(kept["group_id"]) == {"flat", "solo", "var"}
    dropped = compute_advantages(df, AdvantageConfig())  # the default
    assert set(dropped["group_id"]) == {"var"} and dropped.height == 2


def test_advantage_broadcasts_to_every_sequence_of_a_sample():
    df = frame([("g", "a", 1.0, "ok", 3), ("g", "b", 0.0, "ok", 1), ("g", "c", 0.5, "ok", 2)])
    out = compute_advantages(df, AdvantageConfig(scale_std=False))
    assert out.height == 6
    by = out.group_by("session_id").agg(pl.col("advantage").unique())
    for sid, advs in zip(by["session_id"], by["advantage"]):
        assert len(advs) == 1
    # statistics are per sample: a's three sequences do not weigh three times
    assert adv_of(out)["a"] == pytest.approx(0.5)
    assert out["trajectory_id"].to_list() == df["trajectory_id"].to_list()


def test_inconsistent_or_missing_rewards_are_errors():
    bad = frame([("g", "a", 1.0, "ok", 2)]).with_columns(
        pl.when(pl.col("trajectory_id") == "a/1").then(0.0).otherwise(pl.col("reward")).alias("reward")
    )
    with pytest.raises(ValueError, match="different rewards"):
        compute_sample_advantages(bad, AdvantageConfig())
    with pytest.raises(ValueError, match="without a reward"):
        compute_sample_advantages(frame([("g", "a", None, "ok"), ("g", "b", 1.0, "ok")]), AdvantageConfig())
