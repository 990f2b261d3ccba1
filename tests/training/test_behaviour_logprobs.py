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


def test_first_turn_of_a_merged_sequence_matches_and_later_turns_do_not(policy, trajectories):
    merged = trajectories.filter(pl.col("n_calls") > 1).head(1)
    row = merged.row(0, named=True)
    assert "content_changed" in row["merge_kind"]
    trainer, vllm = _trainer_vs_vllm(policy, merged)
    first_turn = [c for c, kind in zip(row["span_call_index"], row["span_kind"]) if kind == "sampled"]
    n_first = next(e - s for c, s, e, kind in zip(row["span_call_index"], row["span_start"], row["span_end"],
                                                   row["span_kind"]) if kind == "sampled" and c == first_turn[0])
    gap = vllm - trainer
    assert gap[:n_first].abs().max() < 1e-3  # sampled in exactly this context
    assert gap[n_first:].mean() > 0.02  # sampled after another rendering of the history
