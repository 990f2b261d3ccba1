"""`polar train` end to end on tiny-qwen: checkpoint, metrics JSONL, PNG curves, --resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polar_training import checkpoint as ckpt

POLAR = str(Path(sys.executable).with_name("polar"))


def _train(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.run([POLAR, "train", *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_polar_train_writes_checkpoint_metrics_plot_and_resumes(tiny_qwen_dir, make_frame, tmp_path):
    traj = tmp_path / "traj.parquet"
    make_frame(groups=2, samples=3, min_len=12, max_len=30, seed=4).write_parquet(traj)
    run = tmp_path / "run"
    common = ["--model", str(tiny_qwen_dir), "-t", str(traj), "-o", str(run), "--lr", "1e-4",
              "--token-budget", "256", "--minibatches", "2", "--warmup-steps", "2"]  # fmt: skip
    first = _train(common)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "padding waste" in first.stderr and "train" in first.stderr
    assert first.stdout.strip().endswith("step-000002")

    second = _train([*common, "--resume", "auto", "--no-progress"])
    assert second.returncode == 0, second.stdout + second.stderr
    latest = ckpt.latest_checkpoint(run)
    assert latest == run / "step-000004"

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows] == pytest.approx([5e-5, 1e-4, 1e-4, 1e-4])  # warm-up survives resume
    for key in ("loss", "kl", "entropy", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max",
                "reward_mean", "advantage_std", "tokens_per_s", "grad_norm", "padding_waste"):  # fmt: skip
        assert all(key in r for r in rows), key
    # 2 mini-batches per invocation: the first step of each is on its own old logprobs (ratio exactly 1),
    # the second comes after an update (off-policy)
    assert [rows[0]["ratio_mean"], rows[2]["ratio_mean"]] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert abs(rows[1]["ratio_mean"] - 1.0) > 1e-5 and abs(rows[3]["ratio_mean"] - 1.0) > 1e-5
    assert rows[0]["kl"] == 0.0 and rows[3]["kl"] > 0.0

    png = run / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    meta = ckpt.read_meta(latest)
    assert meta["policy_version"] == 4 and meta["base_model"] == str(tiny_qwen_dir)
    assert meta["parent"] == str(run / "step-000002")
    assert len(meta["probe"]["ids"]) > 8
    for name in ("model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja", "trainer_state.pt"):
        assert (latest / name).is_file(), name
