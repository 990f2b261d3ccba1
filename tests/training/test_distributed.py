"""FSDP2 on CPU: two gloo processes give the same loss and gradients as one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from polar_training.parity import parity


@pytest.mark.slow
def test_two_process_fsdp2_matches_one_process(small_qwen_dir, make_frame, tmp_path):
    traj = tmp_path / "traj.parquet"
    # 7 samples of uneven length: the ranks get different bin counts (padding micro-batches).
    make_frame(groups=1, samples=7, min_len=10, max_len=60, seed=11, vocab=2048, sequences_per_sample=2).write_parquet(traj)
    budget = "96"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "polar_training.parity", "parity",
        "--model", str(small_qwen_dir), "--trajectories", str(traj), "--out", str(tmp_path / "two.pt"),
        "--token-budget", budget,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world=2" in proc.stdout

    one = parity(str(small_qwen_dir), str(traj), str(tmp_path / "one.pt"), token_budget=int(budget))
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    assert one["world"] == 1 and two["world"] == 2
    assert two["n_tokens"] == one["n_tokens"] > 0
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-8)
    assert abs(one["loss"]) > 1e-4
    assert one["grads"].keys() == two["grads"].keys()
    for name, g in one["grads"].items():
        assert g.abs().max() > 0 or "embed" in name, name
        assert torch.allclose(two["grads"][name], g, atol=1e-6, rtol=1e-4), (name, (two["grads"][name] - g).abs().max())
