"""The trainer that stays up (training/session.py): steps in one process equal the disk round trip,
the handoff directory is servable and verifiable, checkpoints follow the schedule, the pipe protocol."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors import safe_open

from polar_training import checkpoint as ckpt
from polar_training.config import LossConfig, TrainConfig
from polar_training.run import TrainJob, run_training
from polar_training.session import SessionError, TrainerProcess, TrainSession


def _cfg(kl: float = 0.0) -> TrainConfig:
    return TrainConfig(lr=1e-3, warmup_steps=2, num_minibatches=2, token_budget=128, loss=LossConfig(kl_coef=kl))


def _data(make_frame, tmp_path: Path, seed: int) -> str:
    path = tmp_path / f"traj-{seed}.parquet"
    make_frame(groups=2, samples=4, min_len=10, max_len=24, seed=seed, vocab=2048).write_parquet(path)
    return str(path)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.slow  # two polar train runs and two session steps: ~15 s on a quiet machine
def test_steps_in_one_session_equal_one_process_per_step(small_qwen_dir, make_frame, tmp_path):
    """Two rollout batches through one session == `polar train` twice with --resume auto (the old
    per-step process): same losses, same learning rates, bit-identical weights. With a KL term the
    reference, freed after each batch's logprobs, is loaded again for the second."""
    kl = 0.05
    d1, d2 = _data(make_frame, tmp_path, 1), _data(make_frame, tmp_path, 2)
    old = tmp_path / "old"
    want = []
    for i, d in enumerate((d1, d2)):
        res = run_training(TrainJob(model=str(small_qwen_dir), trajectories=[d], out=str(old), config=_cfg(kl),
                                    resume="auto" if i else None, show_progress=False))
        want += res.history

    session = TrainSession(small_qwen_dir, tmp_path / "new", _cfg(kl), keep_reference=False)
    a = session.step([d1])
    b = session.step([d2])
    got = [json.loads(x) for x in (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()]
    assert (a.step, b.step) == (2, 4) and a.updated and b.updated
    assert [g["loss"] for g in got] == [w["loss"] for w in want]
    assert [g["lr"] for g in got] == [w["lr"] for w in want]
    assert got[2]["kl"] > 0 and b.timings["load_reference_s"] > 0  # the reference came back
    assert session.trainer.ref_policy is None  # and was freed again before the backward passes
    final = session.close()
    assert final == tmp_path / "new" / "step-000004"
    expect = _weights(ckpt.latest_checkpoint(old))
    for k, v in _weights(final).items():
        assert torch.equal(v, expect[k]), k


def test_handoff_is_servable_and_checkpoints_follow_the_schedule(small_qwen_dir, make_frame, tmp_path):
    out = tmp_path / "run"
    # 2 mini-batches: 2 optimizer steps per rollout batch (steps 2, 4, 6); a checkpoint every 3 steps
    session = TrainSession(small_qwen_dir, out, _cfg(), checkpoint_every=3, handoff_root=tmp_path / "shm")
    first = session.step([_data(make_frame, tmp_path, 1)])
    h1 = Path(first.handoff)
    assert first.step == 2 and first.checkpoint is None and not list(out.glob("step-*"))
    # the handoff: what vLLM reloads and what the push check reads, without the optimizer state
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", ckpt.META_FILE):
        assert (h1 / name).is_file(), name
    assert not (h1 / ckpt.STATE_FILE).exists()
    meta = ckpt.read_meta(h1)
    assert meta["policy_version"] == 2 and meta["compute_dtype"] == "float32"
    probe = meta["probe"]
    assert len(probe["logprobs"]) == len(probe["ids"]) - 1 == len(probe["logprobs_before"])
    assert probe["logprobs"] != probe["logprobs_before"]
    # the handoff's probe is what the trained weights give
    got = ckpt.probe_logprobs(session.trainer.policy, probe["ids"])
    assert got == pytest.approx(probe["logprobs"], abs=1e-6)

    second = session.step([_data(make_frame, tmp_path, 2)])
    assert second.step == 4 and second.checkpoint is None
    assert not h1.exists() and Path(second.handoff).is_dir()  # one handoff at a time
    third = session.step([_data(make_frame, tmp_path, 3)])  # step 6: due
    assert third.checkpoint == str(out / "step-000006") and (out / "step-000006" / ckpt.STATE_FILE).is_file()
    assert ckpt.latest_checkpoint(out) == out / "step-000006"
    assert session.close() == out / "step-000006"  # nothing new since: no second write
    assert not (tmp_path / "shm").exists()  # handoffs removed at the end


def test_a_batch_without_sampled_tokens_changes_nothing(small_qwen_dir, make_frame, tmp_path):
    frame = make_frame(groups=1, samples=2, min_len=10, max_len=12, seed=1, vocab=2048)
    frame = frame.with_columns(pl.col("loss_mask").list.eval(pl.element() * 0))
    path = tmp_path / "none.parquet"
    frame.write_parquet(path)
    session = TrainSession(small_qwen_dir, tmp_path / "run", _cfg())
    out = session.step([str(path)])
    assert not out.updated and out.step == 0 and out.handoff is None and out.checkpoint is None
    assert session.close() is None and not list((tmp_path / "run").glob("step-*"))


def test_the_persistent_trainer_writes_tensorboard_event_files(small_qwen_dir, make_frame, tmp_path):
    """The demo trains through TrainSession: its metrics go through the same writer as `polar
    train`'s (metrics.jsonl and TensorBoard event files under <run>/tensorboard, W&B when there)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    session = TrainSession(small_qwen_dir, out, _cfg())
    session.step([_data(make_frame, tmp_path, 1)])
    session.close(checkpoint=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event files under <run>/tensorboard"
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [r["step"] for r in rows] == [1, 2]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)


@pytest.mark.slow
def test_trainer_process_over_a_pipe(small_qwen_dir, make_frame, tmp_path):
    """The demo's client: the session in a child process that stays up between steps; a bad command
    is an error in the caller and leaves the session usable; close writes the final checkpoint."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = TrainerProcess(small_qwen_dir, tmp_path / "run", _cfg(), env=env, python=sys.executable)
    with proc:
        pid = proc.pid
        assert proc.info["step"] == 0 and proc.info["rss_gib"] > 0
        with pytest.raises(SessionError, match="FileNotFoundError|No such file"):
            proc.step([str(tmp_path / "missing.parquet")])
        first = proc.step([_data(make_frame, tmp_path, 1)])
        second = proc.step([_data(make_frame, tmp_path, 2)])
        assert proc.pid == pid  # one process across steps
        assert (first["step"], second["step"]) == (2, 4) and second["peak_rss_gib"] > 0
        assert Path(second["handoff"]).is_dir() and not Path(first["handoff"]).exists()
        assert second["metrics"]["step"] == 4
    assert not proc.running
    assert ckpt.latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "step-000004"
