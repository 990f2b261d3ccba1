"""Shared-prefix packing gives what packing each sequence alone gives (logprobs, loss, gradients)
for fewer row tokens; a mask that let members see each other would be caught."""

from __future__ import annotations

import random

import polars as pl
import pytest
import torch

from polar_training.advantages import AdvantageConfig, compute_advantages
from polar_training.loss import LossConfig, grpo_token_loss
from polar_training.packing import build_microbatches, sequences_from_frame
from polar_training.policy import policy_logprobs
from polar_training.prefix_sharing import group_by_prefix

from .test_packing import _logprobs_by_sequence

SMALL_VOCAB = 2048  # conftest.small_qwen


def shared_prompt_frame(groups: int = 2, samples: int = 4, seed: int = 0) -> pl.DataFrame:
    """A harness's rows: one system prompt for every group, a task prompt per group, sampled answers
    per sample. In each group samples 0 and 1 share a whole first turn (sampled answer and tool
    result), so some sampled tokens lie inside a shared prefix."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(SMALL_VOCAB - 1) for _ in range(n)]  # noqa: E731
    system = tok(48)
    rows = []
    for g in range(groups):
        prompt = system + tok(12)
        first_turn = tok(5) + tok(4)  # a sampled answer, then a tool result
        for s in range(samples):
            ids, mask = list(prompt), [0] * len(prompt)
            if s < 2:
                ids += first_turn
                mask += [1] * 5 + [0] * 4
            answer = tok(rng.randint(3, 9))
            ids += answer
            mask += [1] * len(answer)
            lps = [-2.0 + rng.uniform(-0.5, 0.5) if m else 0.0 for m in mask]
            rows.append({
                "trajectory_id": f"g{g}-s{s}/0", "session_id": f"g{g}-s{s}", "task_id": f"task{g}",
                "group_id": f"grp{g}", "segment_index": 0, "chain_index": 0, "input_ids": ids,
                "loss_mask": mask, "logprobs": lps, "reward": float((s + g) % 2), "status": "ok",
                "n_calls": 1, "policy_version": 0,
            })
    return pl.DataFrame(rows)


def _sequences(seed: int = 0, groups: int = 2, samples: int = 4):
    return sequences_from_frame(compute_advantages(shared_prompt_frame(groups, samples, seed), AdvantageConfig()))


def test_units_share_the_common_prefix_and_respect_the_budget():
    seqs = _sequences()
    units = group_by_prefix([s.input_ids for s in seqs], budget=4096)
    assert sorted(m for u in units for m in u.members) == list(range(len(seqs)))
    assert len(units) == 1 and units[0].prefix_len == 48  # every group shares the system prompt
    unshared = sum(s.length for s in seqs)
    assert units[0].tokens == 48 + sum(s.length - 48 for s in seqs) < unshared
    small = group_by_prefix([s.input_ids for s in seqs], budget=150)
    assert all(u.tokens <= 150 for u in small) and len(small) > 1


def test_shared_prefix_logprobs_equal_each_sequence_alone(small_qwen):
    seqs = _sequences(seed=1)
    shared, st = build_microbatches(seqs, token_budget=4096, attention="shared_prefix")
    alone, _ = build_microbatches(seqs, token_budget=1)
    assert len(shared) == 1 and st.n_shared_tokens > 0
    assert st.n_tokens == shared[0].n_tokens == sum(s.length for s in seqs) - st.n_shared_tokens
    a, b = _logprobs_by_sequence(small_qwen, shared), _logprobs_by_sequence(small_qwen, alone)
    assert a.keys() == b.keys() == set(range(len(seqs)))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-5), (k, (a[k] - b[k]).abs().max())


def test_a_mask_that_lets_members_see_each_other_changes_the_logprobs(small_qwen):
    """The equality above can fail: a plain causal mask over the same row leaks earlier members."""
    seqs = _sequences(seed=2)
    (mb,), _ = build_microbatches(seqs, token_budget=4096, attention="shared_prefix")
    good, _ = policy_logprobs(small_qwen, mb)
    n = mb.n_tokens
    causal = torch.zeros(n, n).masked_fill_(~torch.ones(n, n, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    mb.attention_mask = causal[None, None]
    leaky, _ = policy_logprobs(small_qwen, mb)
    assert (good - leaky).abs().max() > 1e-3


def _loss_and_grads(model, mbs, cfg):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in mbs:
        lp, _ = policy_logprobs(model, mb)
        old = lp.detach() + 0.3 * torch.cos(mb.target_ids.double()).float()
        out = grpo_token_loss(lp, mb.behaviour_logp, mb.advantages, mb.weights, cfg, old_logp=old)
        out.loss.backward()
        total += out.loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum"])
def test_shared_prefix_loss_and_gradients_equal_each_sequence_alone(small_qwen, aggregation):
    seqs = _sequences(seed=3, groups=2, samples=4)
    cfg = LossConfig(kl_coef=0.0, aggregation=aggregation)
    shared, _ = build_microbatches(seqs, token_budget=4096, aggregation=aggregation, attention="shared_prefix")
    alone, _ = build_microbatches(seqs, token_budget=1, aggregation=aggregation)
    loss_s, g_s = _loss_and_grads(small_qwen, shared, cfg)
    loss_a, g_a = _loss_and_grads(small_qwen, alone, cfg)
    assert abs(loss_a) > 1e-4 and loss_s == pytest.approx(loss_a, rel=1e-5, abs=1e-7)
    assert g_s.keys() == g_a.keys() and len(g_s) > 10
    for name in g_s:
        assert torch.allclose(g_s[name], g_a[name], atol=1e-6, rtol=1e-4), name


def test_sampled_tokens_inside_a_shared_prefix_keep_one_entry_per_member():
    seqs = _sequences(seed=4, groups=1, samples=2)  # the two samples that share their first turn
    (mb,), st = build_microbatches(seqs, token_budget=4096, attention="shared_prefix")
    assert st.n_sampled_tokens == mb.n_sampled == sum(len(s.sampled_positions) for s in seqs)
    # their first sampled turn is in the shared prefix: same logit positions, an entry per member
    pos = mb.logit_positions.tolist()
    assert len(set(pos)) < len(pos)
    ids = mb.input_ids[0]
    for k, s in enumerate(seqs):  # each entry's target is the member's own next token
        assert mb.target_ids[mb.seq_index == k].tolist() == [s.input_ids[t] for t in s.sampled_positions]
    assert int(ids.numel()) == st.n_tokens
