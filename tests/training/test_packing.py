"""Packing: first-fit-decreasing, no cross-sequence attention, packed == unpacked (logits, loss, grads)."""

from __future__ import annotations

import random

import polars as pl
import pytest
import torch

from polar_training.advantages import AdvantageConfig, compute_advantages
from polar_training.loss import LossConfig, grpo_token_loss
from polar_training.packing import build_microbatches, first_fit_decreasing, sequences_from_frame
from polar_training.policy import policy_logprobs

SMALL_VOCAB = 2048  # conftest.small_qwen


def test_first_fit_decreasing_places_every_item_once_within_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(200)] + [150]
    bins = first_fit_decreasing(lengths, 100)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    for b in bins:
        total = sum(lengths[i] for i in b)
        assert total <= 100 or (len(b) == 1 and lengths[b[0]] > 100)


def test_padding_waste_is_within_five_percent_on_agent_like_lengths(make_frame):
    # 64 sequences of 60..1400 tokens (agent turns), budget 4096
    df = compute_advantages(make_frame(groups=8, samples=8, min_len=60, max_len=1400, seed=7), AdvantageConfig())
    _, stats = build_microbatches(sequences_from_frame(df), token_budget=4096)
    print(stats.describe())
    assert stats.n_tokens == sum(len(x) for x in df["input_ids"])
    assert stats.padding_waste <= 0.05
    assert max(stats.bin_tokens) <= 4096


def test_masked_tokens_are_never_targets_and_sampled_ones_all_are(make_frame):
    df = compute_advantages(make_frame(seed=3), AdvantageConfig())
    seqs = sequences_from_frame(df)
    mbs, stats = build_microbatches(seqs, token_budget=64)
    n_sampled = sum(sum(m) for m in df["loss_mask"])
    assert stats.n_sampled_tokens == n_sampled == sum(mb.n_sampled for mb in mbs)
    for mb in mbs:  # each target is the token after its logit position, and was sampled
        ids = mb.input_ids[0]
        assert torch.equal(ids[mb.logit_positions + 1], mb.target_ids)
    # the weights of one mini-batch sum to one (token-mean over all its tokens)
    assert sum(float(mb.weights.sum()) for mb in mbs) == pytest.approx(1.0)


def test_corrupt_rows_raise_instead_of_dropping_tokens():
    base = {"trajectory_id": "x/0", "advantage": 1.0}
    with pytest.raises(ValueError, match="lengths differ"):
        sequences_from_frame(pl.DataFrame([{**base, "input_ids": [1, 2, 3], "loss_mask": [0, 1], "logprobs": [0.0, -1.0, -1.0]}]))
    with pytest.raises(ValueError, match="position 0"):
        sequences_from_frame(pl.DataFrame([{**base, "input_ids": [1, 2], "loss_mask": [1, 1], "logprobs": [-1.0, -1.0]}]))


def _logprobs_by_sequence(model, mbs):
    out = {}
    with torch.no_grad():
        for mb in mbs:
            lp, _ = policy_logprobs(model, mb)
            for k in mb.seq_index.unique().tolist():
                out[k] = lp[mb.seq_index == k]
    return out


@pytest.mark.parametrize("attention", ["position_ids", "block_mask"])
def test_packed_equals_unpacked_logprobs(small_qwen, make_frame, attention):
    df = compute_advantages(make_frame(groups=2, samples=4, seed=1, vocab=SMALL_VOCAB), AdvantageConfig())
    seqs = sequences_from_frame(df)
    packed, st = build_microbatches(seqs, token_budget=128, attention=attention)
    alone, _ = build_microbatches(seqs, token_budget=1)  # every sequence in a bin of its own
    assert st.n_bins < len(seqs) and all(len(mb.seq_lengths) == 1 for mb in alone)
    a = _logprobs_by_sequence(small_qwen, packed)
    b = _logprobs_by_sequence(small_qwen, alone)
    assert a.keys() == b.keys() == set(range(len(seqs)))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-5), (k, (a[k] - b[k]).abs().max())


def test_packing_without_position_resets_would_leak_attention(small_qwen, make_frame):
    """The check above can fail: positions that do not restart let sequences see each other."""
    df = compute_advantages(make_frame(groups=1, samples=4, seed=2, vocab=SMALL_VOCAB), AdvantageConfig())
    packed, _ = build_microbatches(sequences_from_frame(df), token_budget=512)
    mb = packed[0]
    assert len(mb.seq_lengths) > 1
    good, _ = policy_logprobs(small_qwen, mb)
    mb.position_ids = torch.arange(mb.n_tokens)[None]
    leaky, _ = policy_logprobs(small_qwen, mb)
    first = mb.seq_index == mb.seq_index[0]
    later = ~first
    assert torch.allclose(good[first], leaky[first], atol=1e-5)  # the first sequence sees nothing new
    assert (good[later] - leaky[later]).abs().max() > 1e-3


def _loss(model, mbs, cfg, backward: bool) -> float:
    total = 0.0
    for mb in mbs:  # gradient accumulation over micro-batches
        lp, _ = policy_logprobs(model, mb)
        # an "old policy" off by a token-dependent amount, so ratios differ from 1 (some clipped)
        old = lp.detach() + 0.3 * torch.cos(mb.target_ids.double()).float()
        out = grpo_token_loss(lp, mb.behaviour_logp, mb.advantages, mb.weights, cfg, old_logp=old)
        if backward:
            out.loss.backward()
        total += out.loss.item()
    return total


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_packed_and_unpacked_batches_give_the_same_loss(small_qwen, make_frame, aggregation):
    df = compute_advantages(make_frame(groups=2, samples=3, seed=5, sequences_per_sample=2, vocab=SMALL_VOCAB), AdvantageConfig())
    seqs = sequences_from_frame(df)
    cfg = LossConfig(kl_coef=0.0, aggregation=aggregation)
    packed, _ = build_microbatches(seqs, token_budget=256, aggregation=aggregation)
    alone, _ = build_microbatches(seqs, token_budget=1, aggregation=aggregation)
    assert len(packed) < len(alone) == len(seqs)
    with torch.no_grad():
        a, b = _loss(small_qwen, packed, cfg, False), _loss(small_qwen, alone, cfg, False)
    assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
    assert abs(a) > 1e-4


def test_packed_and_unpacked_batches_give_the_same_gradients(small_qwen, make_frame):
    df = compute_advantages(make_frame(groups=2, samples=3, seed=5, sequences_per_sample=2, vocab=SMALL_VOCAB), AdvantageConfig())
    seqs = sequences_from_frame(df)
    cfg = LossConfig(kl_coef=0.0)
    grads = []
    for budget in (256, 1):
        mbs, _ = build_microbatches(seqs, token_budget=budget)
        small_qwen.zero_grad(set_to_none=True)
        _loss(small_qwen, mbs, cfg, True)
        grads.append({n: p.grad.clone() for n, p in small_qwen.named_parameters() if p.grad is not None})
    g_packed, g_alone = grads
    assert g_packed.keys() == g_alone.keys() and len(g_packed) > 10
    for name in g_packed:
        assert torch.allclose(g_packed[name], g_alone[name], atol=1e-6, rtol=1e-4), name
