"""Sampling fidelity on a real capture: vLLM (tiny-qwen, float32, started by ``VLLMServer`` with
``--logprobs-mode processed_logprobs --generation-config vllm``) samples through the proxy at
temperature 0.7 (and with top-p 0.9 / top-k 20); the proxy records the effective sampling
parameters of each call; per-request trajectories carry them; the float32 trainer, dividing logits
by the recorded temperature and applying vLLM's top-k/top-p, reproduces vLLM's returned logprobs
to 1e-3. The old trainer (plain logits, temperature 1) misses them by far more."""

from __future__ import annotations

import json
import urllib.request

import polars as pl
import pytest
import torch

from polar_analysis import frames
from polar_analysis.trajectories import build
from polar_training.packing import build_microbatches, sequences_from_frame
from polar_training.policy import policy_logprobs

pytestmark = pytest.mark.vllm

PROMPTS = ["Name a color.", "Write one word about the sea.", "Count to five.", "Say something about cats."]


def _post(url: str, body: dict, headers: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **headers})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=300) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def policy(tiny_qwen_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen_dir), dtype=torch.float32, local_files_only=True).eval()


def _capture(vllm_tiny, tmp_path, spec: str, harness_sampling: dict, exact: bool = False) -> tuple[pl.DataFrame, list[dict]]:
    from polar_proxy.process import ProxyProcess

    cap = tmp_path / "captures"
    options = {"polar_sampling": spec, **({"polar_exact_history": True} if exact else {})}
    proxy = ProxyProcess(vllm_tiny.base_url, cap, confdir=tmp_path / "mitm", upstream_timeout=300,
                         options=options).start()
    try:
        for i, prompt in enumerate(PROMPTS):
            _post(proxy.url + "/v1/chat/completions",
                  {"model": "gpt-x", "max_tokens": 24, "messages": [{"role": "user", "content": prompt}],
                   **harness_sampling},  # what the harness asks for is overridden by polar_sampling
                  {"x-polar-session": f"fid-{i}"})
    finally:
        proxy.stop()
    records = [json.loads(line) for f in sorted((cap / "sessions").glob("*.jsonl")) for line in f.read_text().splitlines()]
    traj, stats = build(frames.calls(cap, rewards=None), mode="per-request")
    assert stats.skipped_no_logprobs == 0 and stats.coverage == 1.0
    return traj.with_columns(advantage=pl.lit(0.0)), records


def _trainer_vs_vllm(policy, frame: pl.DataFrame, plain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = sequences_from_frame(frame)
    got, want = [], []
    for mb in build_microbatches(seqs, token_budget=sum(s.length for s in seqs))[0]:
        if plain:  # what the trainer computed before: logits at temperature 1, no top-k/top-p
            mb.temperature = mb.top_k = mb.top_p = None
        with torch.no_grad():
            got.append(policy_logprobs(policy, mb)[0])
        want.append(mb.behaviour_logp)
    return torch.cat(got), torch.cat(want)


@pytest.mark.parametrize(
    "spec, expect, exact",
    [
        ("temperature=0.7,top_p=1,top_k=-1,min_p=0,seed=5", {"temperature": 0.7, "top_p": 1.0, "top_k": 0}, False),
        ("temperature=0.7,top_p=0.9,top_k=-1,min_p=0,seed=6", {"temperature": 0.7, "top_p": 0.9, "top_k": 0}, False),
        ("temperature=0.7,top_p=0.9,top_k=20,min_p=0,seed=7", {"temperature": 0.7, "top_p": 0.9, "top_k": 20}, False),
        ("temperature=0.7,top_p=0.9,top_k=-1,min_p=0,seed=8", {"temperature": 0.7, "top_p": 0.9, "top_k": 0}, True),
    ],
    ids=["T0.7", "T0.7-top_p0.9", "T0.7-top_p0.9-top_k20", "exact-history-T0.7-top_p0.9"],
)
def test_trainer_reproduces_vllm_processed_logprobs(vllm_tiny, policy, tmp_path, spec, expect, exact):
    frame, records = _capture(vllm_tiny, tmp_path, spec, {"temperature": 0.2, "top_p": 0.5}, exact)
    if exact:  # generated through render/generate: the render's own sampling_params confirm the record
        assert all(r["sampling"].get("confirmed_by") == "render" and r["history"] for r in records)
    assert len(records) == len(PROMPTS)
    for rec in records:  # (1) the effective parameters, as vLLM applied them, in one field
        s = rec["sampling"]
        assert {k: s[k] for k in expect} == expect
        assert s["min_p"] == 0.0 and s["repetition_penalty"] == 1.0 and s["frequency_penalty"] == 0.0
        assert s["logprobs_mode"] == "processed_logprobs" and s["defaults_from"] == "vllm"
        assert "temperature" in s["enforced"] and s["seed"] is not None
    assert frame["temperature"].to_list() == [expect["temperature"]] * frame.height
    assert frame["sampling_issue"].null_count() == frame.height
    trainer, vllm = _trainer_vs_vllm(policy, frame)
    assert trainer.numel() == sum(len(r["sampled_token_ids"]) for r in records) > 40
    gap = (trainer - vllm).abs().max().item()
    old, _ = _trainer_vs_vllm(policy, frame, plain=True)
    old_gap = (old - vllm).abs()
    print(f"{spec}: max |trainer - vLLM| = {gap:.2e} over {trainer.numel()} tokens; "
          f"old trainer (T=1, nothing cut): mean {old_gap.mean().item():.3f}, max {old_gap.max().item():.3f}")
    assert gap < 1e-3
    assert old_gap.mean() > 0.05  # the old trainer's logprobs belong to another distribution


def test_server_defaults_are_recorded_when_the_harness_sends_none(vllm_tiny, tmp_path):
    """Without polar_sampling, fields the harness leaves out take the server's defaults (here
    --generation-config vllm: neutral), and the record says where they came from."""
    from polar_proxy.process import ProxyProcess

    cap = tmp_path / "captures"
    with ProxyProcess(vllm_tiny.base_url, cap, confdir=tmp_path / "mitm", upstream_timeout=300) as proxy:
        _post(proxy.url + "/v1/chat/completions",
              {"model": "gpt-x", "max_tokens": 4, "temperature": 0.5, "messages": [{"role": "user", "content": "Hi"}]},
              {"x-polar-session": "defaults-0"})
    rec = json.loads((cap / "sessions" / "defaults-0.jsonl").read_text().splitlines()[0])
    assert rec["sampling"] == {"temperature": 0.5, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                               "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": None, "enforced": [],
                               "defaults_from": "vllm", "logprobs_mode": "processed_logprobs"}
