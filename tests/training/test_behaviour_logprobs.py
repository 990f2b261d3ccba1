"""The trainer's logprobs against vLLM's, on a real capture (Pi + Qwen2.5-Coder-0.5B, the demo run
in tests/fixtures/demo-run): where a token is trained in the context it was sampled in, the float32
trainer must reproduce vLLM's (float32, CPU) logprob; where a non-exact prefix merge changed that
context, the gap is what the trainer's mismatch_kl reports."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch

from polar_training.packing import build_microbatches, sequences_from_frame
from polar_training.policy import policy_logprobs

pytestmark = pytest.mark.slow

STEP0 = Path(__file__).resolve().parents[1] / "fixtures" / "demo-run" / "trajectories" / "step-0.parquet"


@pytest.fixture(scope="module")
def policy(qwen05_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(qwen05_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trajectories() -> pl.DataFrame:
    return pl.read_parquet(STEP0).with_columns(advantage=pl.lit(0.0))


def _trainer_vs_vllm(policy, frame: pl.DataFrame) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = sequences_from_frame(frame)
    out_trainer, out_vllm = [], []
    for mb in build_microbatches(seqs, token_budget=sum(s.length for s in seqs))[0]:
        with torch.no_grad():
            logp, _ = policy_logprobs(policy, mb)
        out_trainer.append(logp)
        out_vllm.append(mb.behaviour_logp)
    return torch.cat(out_trainer), torch.cat(out_vllm)


def test_unmerged_calls_packed_together_match_vllm(policy, trajectories):
    """Single-call sequences, packed into one micro-batch (position-id resets): every sampled
    token's logprob equals vLLM's."""
    single = trajectories.filter(pl.col("n_calls") == 1)
    assert single.height >= 2
    trainer, vllm = _trainer_vs_vllm(policy, single)
    assert trainer.numel() == sum(sum(m) for m in single["loss_mask"].to_list()) > 50
    assert (trainer - vllm).abs().max() < 1e-3


def test_every_token_trained_in_the_context_it_was_sampled_in_matches_vllm(policy, trajectories, tmp_path):
    """The property the trainer needs, per sampled span of every (merged) sequence: where the tokens
    before the span are exactly the call's own prompt, the trainer reproduces vLLM's logprobs.
    Spans after a non-exact merge (content_changed: the history was re-rendered) are outside the
    property; exact-history captures make every span satisfy it.

    The capture predates recorded sampling parameters (schema 1); its requests carried none and
    the 0.5B's generation_config.json has none, so vLLM sampled plainly at T=1, which is what the
    trainer assumes for a frame without sampling columns."""
    import shutil

    from polar_analysis import frames

    caps = tmp_path / "captures"
    shutil.copytree(STEP0.parents[1] / "captures", caps)
    calls = frames.calls(caps, rewards=None).select("call_id", "call_index", "prompt_token_ids").collect()
    prompt = {r["call_id"]: r["prompt_token_ids"] for r in calls.iter_rows(named=True)}
    checked = skipped = 0
    for i in range(trajectories.height):
        frame = trajectories.slice(i, 1)
        row = frame.row(0, named=True)
        by_index = {calls.filter(call_id=c)["call_index"].item(): c for c in row["call_ids"]}
        trainer, vllm = _trainer_vs_vllm(policy, frame)
        k = 0
        for ci, s, e, kind in zip(row["span_call_index"], row["span_start"], row["span_end"], row["span_kind"]):
            if kind != "sampled":
                continue
            gap = (trainer[k : k + e - s] - vllm[k : k + e - s]).abs()
            k += e - s
            if row["input_ids"][:s] == prompt[by_index[ci]]:
                assert gap.max() < 1e-3, (row["trajectory_id"], ci, gap.max())
                checked += e - s
            else:
                skipped += e - s
        assert k == trainer.numel()
    assert checked > 200 and skipped > 0  # both kinds occur in this capture
