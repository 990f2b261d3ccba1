"""The trainer's per-token record (training/token_record.py): what ``polar view`` and certify read."""

from __future__ import annotations

import copy
import json

import polars as pl
import torch

from polar_training.token_record import TokenRecorder, gap_of, read_tokens
from polar_training.trainer import GRPOTrainer, TrainConfig

from .conftest import SMALL_VOCAB


def _cfg(lr: float) -> TrainConfig:
    cfg = TrainConfig(lr=lr, token_budget=256)
    cfg.loss.kl_coef = 0.0
    return cfg


def _frame(make_frame):
    frame = make_frame(groups=2, samples=4, vocab=SMALL_VOCAB - 1)
    # group 1: every sample scores alike, so the trainer leaves it out (zero variance)
    return frame.with_columns(pl.when(pl.col("group_id") == "grp1").then(0.5).otherwise(pl.col("reward")).alias("reward"))


def test_every_trained_token_is_recorded_with_the_trainers_logprob_before_the_update(small_qwen, make_frame, tmp_path):
    frame = _frame(make_frame)
    before = copy.deepcopy(small_qwen)
    trainer = GRPOTrainer(small_qwen, _cfg(1e-3))
    trainer.recorder = TokenRecorder(tmp_path)
    trainer.fit(frame)

    tokens = read_tokens(tmp_path, step=1)
    meta = json.loads((tmp_path / "tokens" / "step-000001.json").read_text())
    trained = frame.filter(pl.col("group_id") == "grp0")
    # every sampled token of every trained sequence, once, at its position, with the trajectory's values
    want = [(r["trajectory_id"], t, r["input_ids"][t], r["logprobs"][t])
            for r in trained.iter_rows(named=True) for t, m in enumerate(r["loss_mask"]) if m]
    got = sorted(zip(tokens["trajectory_id"], tokens["position"], tokens["token_id"], tokens["behaviour_logprob"]))
    assert [g[:3] for g in got] == sorted(w[:3] for w in want)
    assert max(abs(g[3] - w[3]) for g, w in zip(got, sorted(want))) < 1e-5
    assert set(tokens["step"]) == {1} and (tokens["loss_weight"] > 0).all()
    assert meta["left_out"] == {t: "zero_variance" for t in frame.filter(pl.col("group_id") == "grp1")["trajectory_id"]}
    # advantages: the sample's, the same on all its tokens, both signs present
    adv = tokens.group_by("session_id").agg(pl.col("advantage").n_unique().alias("n"), pl.col("advantage").first())
    assert (adv["n"] == 1).all() and adv["advantage"].min() < 0 < adv["advantage"].max()

    # the trainer's logprobs are those of the weights before the update, recomputed independently
    ref = GRPOTrainer(before, _cfg(1e-3))
    prep = ref.prepare(frame)
    mbs = [mb for part in prep.minibatches for mb in part]
    ref.fill_old_logprobs(mbs)
    expect = {}
    for mb in mbs:
        for k, t, lp in zip(mb.seq_index.tolist(), mb.target_positions.tolist(), mb.old_logp.tolist()):
            expect[(mb.seq_ids[k], t)] = lp
    gap = max(abs(expect[(tid, pos)] - lp) for tid, pos, lp in
              zip(tokens["trajectory_id"], tokens["position"], tokens["trainer_logprob"]))
    assert gap < 1e-4, gap
    # the figures certify's logprob check grades, from the record alone
    gaps = [b - expect[(tid, pos)] for tid, pos, b in zip(tokens["trajectory_id"], tokens["position"], tokens["behaviour_logprob"])]
    g = gap_of(tokens)
    assert g["tokens"] == len(gaps) and abs(g["mismatch_kl"] - sum(gaps) / len(gaps)) < 1e-4
    assert abs(g["max_abs_gap"] - max(abs(x) for x in gaps)) < 1e-4
    after = {}
    ref2 = GRPOTrainer(trainer.model, _cfg(1e-3))
    mbs2 = [mb for part in ref2.prepare(frame).minibatches for mb in part]
    ref2.fill_old_logprobs(mbs2)
    for mb in mbs2:
        for k, t, lp in zip(mb.seq_index.tolist(), mb.target_positions.tolist(), mb.old_logp.tolist()):
            after[(mb.seq_ids[k], t)] = lp
    assert max(abs(after[k] - expect[k]) for k in expect) > 1e-3  # the update moved them: the record is the "before"


def test_the_size_bound_sequences_per_batch_and_files_kept(small_qwen, make_frame, tmp_path):
    frame = make_frame(groups=2, samples=4, vocab=SMALL_VOCAB - 1)
    trainer = GRPOTrainer(small_qwen, _cfg(1e-4))
    trainer.recorder = TokenRecorder(tmp_path, max_sequences=3, keep_files=2)
    torch.manual_seed(0)
    for _ in range(3):
        trainer.fit(frame)
    files = sorted(p.name for p in (tmp_path / "tokens").iterdir())
    assert files == ["step-000002.json", "step-000002.parquet", "step-000003.json", "step-000003.parquet"]
    last = read_tokens(tmp_path, step=3)
    assert last["trajectory_id"].n_unique() == 3
    meta = json.loads((tmp_path / "tokens" / "step-000003.json").read_text())
    assert sorted(meta["left_out"].values()) == ["not_recorded"] * 5
    # the same three every time (a CRC of the id, not Python's per-process hash)
    assert set(read_tokens(tmp_path, step=2)["trajectory_id"]) == set(last["trajectory_id"])
