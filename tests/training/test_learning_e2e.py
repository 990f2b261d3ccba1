"""End-to-end learning: real vLLM (SmolLM2-135M) -> real proxy captures -> per-request trajectories
-> GRPO steps -> weights pushed in place through the proxy's pause gate -> next rollout.

The reward is checkable (see ``reward``) and the base policy's success rate is moderate, so GRPO
groups have variance; fixed per-request seeds keep the rollouts reproducible.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import polars as pl
import pytest

from polar_core.net import OPENER  # never via HTTP(S)_PROXY
import torch

PROMPTS = (
    "Is the sky blue? Answer yes or no.",
    "Is water wet? Answer yes or no.",
    "Is grass green? Answer yes or no.",
)
SAMPLES = 8
ITERATIONS = 4
MAX_TOKENS = 12
LR = 2e-5
SERVED = "smollm2-untied"


def reward(text: str) -> float:
    """1 when the answer is exactly one word "no" (any case, optional period); else 0."""
    return 1.0 if re.fullmatch(r"\s*no\.?\s*", text, flags=re.IGNORECASE) else 0.0


@pytest.fixture(scope="module")
def untied_smollm(smollm_dir, tmp_path_factory) -> Path:
    """SmolLM2 has tied embeddings; vLLM's in-place reload keeps a stale lm_head for those, so serve
    an untied float32 copy and every push stays an in-place reload."""
    from polar_training.checkpoint import servable_copy

    out = servable_copy(smollm_dir, tmp_path_factory.mktemp("smollm-untied") / "model", dtype="float32")
    return out


@pytest.fixture(scope="module")
def vllm_smollm(untied_smollm):
    from polar_runtime.serve import VLLMServer

    server = VLLMServer(untied_smollm, served_model_name=SERVED, max_model_len=2048)
    try:
        server.start(wait=True)
        yield server
    finally:
        server.stop()


def _chat(url: str, prompt: str, session: str, task: str, sample: int, seed: int) -> dict:
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": seed,
    }
    headers = {
        "content-type": "application/json",
        "x-polar-session": session,
        "x-polar-task": task,
        "x-polar-group": task,
        "x-polar-sample": str(sample),
    }
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), headers)
    with OPENER.open(req, timeout=300) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def _rollout(url: str, it: int) -> dict[str, float]:
    """One iteration's groups through the proxy; returns reward per session id."""
    jobs = []
    for t, prompt in enumerate(PROMPTS):
        for k in range(SAMPLES):
            jobs.append((prompt, f"task-{t}-s{k}-it{it}", f"task-{t}-it{it}", k, 1000 * it + 100 * t + k))
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda j: _chat(url, *j), jobs))
    return {j[1]: reward(o["choices"][0]["message"]["content"] or "") for j, o in zip(jobs, outs)}


def _trajectories(capture_dir: Path, rewards: dict[str, float]) -> pl.DataFrame:
    from polar_analysis import frames
    from polar_analysis.trajectories import build

    calls = frames.calls(capture_dir, rewards=None).filter(pl.col("session_id").is_in(list(rewards)))
    traj, stats = build(calls, mode="per-request")
    table = pl.DataFrame({"session_id": list(rewards), "_r": list(rewards.values())})
    return traj.join(table, on="session_id", how="left").with_columns(reward=pl.col("_r")).drop("_r")


@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_through_proxy_and_vllm_raises_reward(vllm_smollm, untied_smollm, smollm_dir, tmp_path, capsys):
    from polar_proxy.process import ProxyProcess
    from polar_training import checkpoint as ckpt
    from polar_training.loss import LossConfig
    from polar_training.trainer import GRPOTrainer, TrainConfig, load_model
    from polar_training.weights_push import push_weights

    torch.manual_seed(0)
    n_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    model = load_model(str(untied_smollm), dtype="float32")
    cfg = TrainConfig(lr=LR, token_budget=2048, loss=LossConfig(kl_coef=0.0), seed=0)
    cfg.adv.drop_zero_variance = False  # every iteration is an update (zero advantage where a group is all alike)
    trainer = GRPOTrainer(model, cfg)
    captures = tmp_path / "captures"
    # The rollout's sampling enforced by the proxy (as polar rollout / polar demo do): plain sampling
    # at temperature 1 is the distribution the trainer's logprobs are computed from.
    proxy = ProxyProcess(vllm_smollm.base_url, captures, confdir=tmp_path / "mitm", upstream_timeout=300,
                         options={"polar_sampling": "temperature=1,top_p=1,top_k=-1,min_p=0,repetition_penalty=1,"
                                                    "presence_penalty=0,frequency_penalty=0"})
    proxy.start()
    curve, pushes, versions = [], [], {}
    t_start = time.perf_counter()
    try:
        proxy.control.set_policy_version(0)
        for it in range(ITERATIONS + 1):
            rewards = _rollout(proxy.url, it)
            curve.append(sum(rewards.values()) / len(rewards))
            traj = _trajectories(captures, rewards)
            assert traj.height == len(rewards) and traj["reward"].null_count() == 0
            versions[it] = set(traj["policy_version"].to_list())
            if it == ITERATIONS:
                break
            history = trainer.fit(traj)
            assert history, "every group had zero reward variance: no update"
            out = ckpt.save_checkpoint(tmp_path / f"step-{trainer.step:06d}", trainer.model, smollm_dir,
                                       probe_ids=list(traj["input_ids"][0]), update_latest=False)
            res = push_weights(out, vllm_smollm, proxy.url, policy_version=trainer.step)
            assert res.method == "reload_weights", res.notes
            pushes.append(res.reload_s)
    finally:
        proxy.stop()
        torch.set_num_threads(n_threads)
    elapsed = time.perf_counter() - t_start
    with capsys.disabled():
        print("\nreward curve:", " ".join(f"{r:.2f}" for r in curve),
              f"| pushes {' '.join(f'{s:.2f}' for s in pushes)} s | {elapsed:.0f} s total")
    assert versions == {it: {it} for it in range(ITERATIONS + 1)}, versions
    assert 0.1 <= curve[0] <= 0.7, "the base policy's success rate should leave room to learn"
    assert curve[-1] >= curve[0] + 0.25, curve
