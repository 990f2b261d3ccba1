"""Data hygiene and logs (issue 25, item 6): stale samples (policy_version) and zero-variance groups
left out and counted; metrics written to JSONL, TensorBoard and (when installed) W&B."""

from __future__ import annotations

import json
import sys
import types

import polars as pl
import pytest

from polar_training.advantages import filter_stale
from polar_training.config import AdvantageConfig, LossConfig, TrainConfig
from polar_training.metrics_log import MetricsLog
from polar_training.trainer import GRPOTrainer

from .conftest import SMALL_VOCAB


def _versions(frame: pl.DataFrame, by_session: dict[str, list[int | None]]) -> pl.DataFrame:
    """Set each sample's sequences' policy_version (in row order within the sample)."""
    seen: dict[str, int] = {}
    out = []
    for sid in frame["session_id"].to_list():
        i = seen.get(sid, 0)
        seen[sid] = i + 1
        out.append(by_session[sid][i])
    return frame.with_columns(policy_version=pl.Series(out, dtype=pl.Int64))


def test_stale_samples_are_dropped_whole_and_counted(make_frame):
    frame = make_frame(groups=1, samples=4, sequences_per_sample=2)
    frame = _versions(frame, {"g0-s0": [5, 5], "g0-s1": [4, 3], "g0-s2": [4, 2], "g0-s3": [None, 5]})
    kept, stats = filter_stale(frame, current_version=5, max_staleness=2)
    assert sorted(set(kept["session_id"].to_list())) == ["g0-s0", "g0-s1"]  # s2 has a version-2 sequence
    assert kept.height == 4 and kept["trajectory_id"].to_list() == [t for t in frame["trajectory_id"] if t[:5] in ("g0-s0", "g0-s1")]
    assert stats == {"max_staleness_seen": 3.0, "n_stale_samples": 2.0, "n_stale_sequences": 4.0}
    same, stats = filter_stale(frame, current_version=5, max_staleness=None)
    assert same.height == frame.height and stats == {"max_staleness_seen": 3.0}
    with pytest.raises(ValueError, match="max_staleness"):
        TrainConfig(max_staleness=-1)


def test_the_trainer_leaves_stale_samples_out_and_reports_them(small_qwen, make_frame):
    frame = _versions(make_frame(groups=2, samples=2, vocab=SMALL_VOCAB),
                      {"g0-s0": [3], "g0-s1": [3], "g1-s0": [0], "g1-s1": [3]})
    trainer = GRPOTrainer(small_qwen, TrainConfig(lr=1e-5, max_staleness=1, loss=LossConfig(kl_coef=0.0),
                                                  adv=AdvantageConfig(drop_zero_variance=False)))  # g1 keeps one sample
    trainer.step = 3  # the weights of version 3 are about to be updated
    prep = trainer.prepare(frame)
    assert set(prep.frame["session_id"].to_list()) == {"g0-s0", "g0-s1", "g1-s1"}
    (row,) = trainer.fit(prep)
    assert row["n_stale_samples"] == 1 and row["n_stale_sequences"] == 1 and row["max_staleness_seen"] == 3


def test_zero_variance_groups_are_dropped_by_default_and_counted(small_qwen, make_frame):
    frame = make_frame(groups=2, samples=2, vocab=SMALL_VOCAB)
    frame = frame.with_columns(reward=pl.when(pl.col("group_id") == "grp0").then(0.5).otherwise(pl.col("reward")))
    assert AdvantageConfig().drop_zero_variance
    trainer = GRPOTrainer(small_qwen, TrainConfig(lr=1e-5, loss=LossConfig(kl_coef=0.0)))
    prep = trainer.prepare(frame)
    assert set(prep.frame["group_id"].to_list()) == {"grp1"}
    assert prep.data_stats["n_zero_variance_samples_dropped"] == 2
    assert prep.data_stats["n_zero_variance_sequences_dropped"] == 2
    (row,) = trainer.fit(prep)
    assert row["n_zero_variance_groups"] == 1 and row["n_zero_variance_sequences_dropped"] == 2
    keep = GRPOTrainer(small_qwen, TrainConfig(lr=1e-5, adv=AdvantageConfig(drop_zero_variance=False),
                                               loss=LossConfig(kl_coef=0.0)))
    kept = keep.prepare(frame)
    assert kept.frame.height == frame.height and "n_zero_variance_sequences_dropped" not in kept.data_stats


def test_metrics_go_to_jsonl_tensorboard_and_wandb(tmp_path, monkeypatch):
    logged = []

    class Run:
        id = "run123"

        def log(self, row, step):
            logged.append((step, row))

        def finish(self):
            logged.append("finished")

    inits = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: inits.append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    rows = [{"step": 1, "loss": 0.5, "kl": 0.01, "note": "x", "bad": float("nan")}, {"step": 2, "loss": 0.25, "kl": 0.02}]
    with MetricsLog(tmp_path / "run", config={"lr": 1e-6}) as mlog:
        assert mlog.sinks == ["jsonl", "tensorboard", "wandb (offline)"]
        for r in rows:
            mlog.write(r)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lines] == [0.5, 0.25] and lines[0]["note"] == "x"
    assert inits[0]["mode"] == "offline" and inits[0]["config"] == {"lr": 1e-6} and inits[0]["id"] is None
    assert logged == [(1, {"loss": 0.5, "kl": 0.01}), (2, {"loss": 0.25, "kl": 0.02}), "finished"]
    assert (tmp_path / "run" / "wandb-run-id").read_text().strip() == "run123"
    MetricsLog(tmp_path / "run").close()  # a later invocation resumes the same W&B run
    assert inits[1]["id"] == "run123"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert {"loss", "kl"} <= set(acc.Tags()["scalars"]) and "bad" not in acc.Tags()["scalars"]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.25)]


def test_wandb_disabled_or_missing_leaves_the_other_sinks(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: import fails
    with MetricsLog(tmp_path / "a") as mlog:
        assert mlog.sinks == ["jsonl", "tensorboard"]
        mlog.write({"step": 1, "loss": 1.0})
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with MetricsLog(tmp_path / "b") as mlog:
        assert mlog.sinks == ["jsonl", "tensorboard"]
