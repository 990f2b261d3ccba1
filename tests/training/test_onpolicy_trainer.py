"""The trainer's side of issue 15: logprobs of the distribution actually sampled (temperature,
vLLM's top-k/top-p), refusals that name the call, ungrouped samples, real mixed precision, the
reference computed once per rollout batch, FSDP gradient sync and the attention start-up check."""

from __future__ import annotations

import copy

import polars as pl
import pytest
import torch

from polar_training import distributed as pdist
from polar_training.advantages import AdvantageConfig, compute_advantages
from polar_training.loss import LossConfig
from polar_training.packing import build_microbatches, sequences_from_frame
from polar_training.policy import chunked_token_logprobs, sampling_keep_mask
from polar_training.trainer import GRPOTrainer, TrainConfig, check_attention_support

from .conftest import SMALL_VOCAB


def vllm_reference(h, w, targets, temps, top_k, top_p):
    """vLLM 0.32's processed logprobs, written out: logits / T, apply_top_k_top_p_pytorch, log_softmax."""
    logits = (h @ w.T) / temps[:, None]
    logits_sort, idx = logits.sort(dim=-1, descending=False)
    kth = logits_sort.gather(1, (logits_sort.size(1) - top_k.clamp(min=1))[:, None])
    logits_sort = torch.where((top_k[:, None] > 0) & (logits_sort < kth), -float("inf"), logits_sort)
    probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    mask = probs_sum <= 1 - top_p[:, None]
    mask[:, -1] = False
    logits_sort = logits_sort.masked_fill(mask, -float("inf"))
    processed = torch.empty_like(logits).scatter_(1, idx, logits_sort)
    return processed.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)


def test_logprobs_and_gradients_match_vllms_processed_distribution():
    torch.manual_seed(0)
    k, d, v = 12, 16, 64
    h = torch.randn(k, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    temps = torch.tensor([0.7] * 4 + [1.0] * 4 + [1.3] * 4, dtype=torch.float64)
    top_k = torch.tensor([0, 5, 0, 20, 0, 0, 3, 0, 8, 0, 0, 1])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 0.5, 1.0, 0.95, 0.9, 1.0, 0.7, 1.0], dtype=torch.float64)
    # targets inside what vLLM keeps (it can only sample those): the highest-logit token of each row
    targets = ((h @ w.T) / temps[:, None]).argmax(-1).detach()
    got, _ = chunked_token_logprobs(h, w, targets, chunk=5, temps=temps, top_k=top_k, top_p=top_p)
    want = vllm_reference(h, w, targets, temps, top_k, top_p)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    plain, _ = chunked_token_logprobs(h, w, targets, chunk=5)
    assert (plain - want).abs().max() > 0.1  # what the trainer computed before (T=1, nothing cut)
    g = torch.randn(k, dtype=torch.float64)
    gh, gw = torch.autograd.grad((got * g).sum(), (h, w))
    rh, rw = torch.autograd.grad((want * g).sum(), (h, w))
    torch.testing.assert_close(gh, rh, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(gw, rw, rtol=1e-9, atol=1e-10)
    keep = sampling_keep_mask((h @ w.T).detach() / temps[:, None], top_k, top_p)
    assert keep[1].sum() == 5 and keep[11].sum() == 1 and keep[0].all()


def _frame(make_frame, **cols) -> pl.DataFrame:
    return make_frame(groups=1, samples=2, vocab=SMALL_VOCAB).with_columns(advantage=pl.lit(0.5), **cols)


def test_packing_carries_each_sequences_distribution_and_refuses_naming_the_call(make_frame):
    frame = _frame(make_frame).with_columns(
        temperature=pl.Series([0.7, 1.0]), top_k=pl.Series([20, 0], dtype=pl.Int32), top_p=pl.Series([0.9, 1.0]),
        sampling_issue=pl.Series([None, None], dtype=pl.String),
    )
    mbs, _ = build_microbatches(sequences_from_frame(frame), token_budget=10_000)
    (mb,) = mbs
    n0 = sum(frame["loss_mask"][0])
    assert {round(t, 6) for t in mb.temperature.tolist()} == {0.7, 1.0} and mb.temperature.numel() == mb.n_sampled
    order = mb.seq_index.tolist()
    assert all((t == pytest.approx(0.7)) == (s == 0) for t, s in zip(mb.temperature.tolist(), order))
    assert mb.top_k.tolist().count(20) == n0 and mb.top_p.tolist().count(pytest.approx(0.9)) == n0
    bad = frame.with_columns(sampling_issue=pl.Series([None, "call abc (session g0-s1, call #3): greedy decoding"]))
    with pytest.raises(ValueError, match=r"call abc \(session g0-s1, call #3\): greedy decoding.*polar_sampling"):
        sequences_from_frame(bad)


def test_a_sample_without_group_is_its_own_group(make_frame):
    frame = make_frame(groups=1, samples=2).with_columns(group_id=pl.lit(None, dtype=pl.String),
                                                          reward=pl.Series([0.0, 1.0]))
    out = compute_advantages(frame, AdvantageConfig(drop_zero_variance=False))  # kept: a group of one has advantage 0
    assert compute_advantages(frame, AdvantageConfig()).height == 0  # dropped by default (zero variance)
    assert out["advantage"].to_list() == [0.0, 0.0] and out["group_size"].to_list() == [1, 1]
    mixed = pl.concat([frame, make_frame(groups=1, samples=2, seed=1).with_columns(reward=pl.Series([0.0, 1.0]))])
    adv = compute_advantages(mixed, AdvantageConfig(scale_std=False, drop_zero_variance=False))["advantage"].to_list()
    assert adv == [0.0, 0.0, -0.5, 0.5]


@pytest.mark.parametrize("start_dtype", [torch.float32, torch.bfloat16])
def test_bf16_mixed_precision_moves_the_weights_by_the_learning_rate(small_qwen, make_frame, start_dtype):
    """One AdamW step at lr 1e-6 moves each weight with a gradient by ~1e-6 (Adam's first step is
    lr * g / |g|). Stored in bf16 (8 mantissa bits: a weight of 0.02 has a spacing of 1.2e-4),
    nearly all of those updates used to round to nothing."""
    model = small_qwen.to(start_dtype)
    cfg = TrainConfig(lr=1e-6, token_budget=4096, compute_dtype="bfloat16", max_grad_norm=0.0,
                      loss=LossConfig(kl_coef=0.0))
    trainer = GRPOTrainer(model, cfg)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert all(p.dtype == torch.float32 for p in before.values())  # master weights
    frame = make_frame(groups=1, samples=4, vocab=SMALL_VOCAB)
    trainer.fit(frame)
    assert all(s.dtype == torch.float32 for st in trainer.optimizer.state.values() for s in st.values() if s.dim())
    deltas, big_grads = [], 0
    for n, p in trainer.model.named_parameters():
        grad = p.grad
        moved = (p.detach() - before[n]).abs()
        sel = grad.abs() > 1e-6 if grad is not None else torch.zeros_like(moved, dtype=torch.bool)
        big_grads += int(sel.sum())
        deltas.append(moved[sel])
    d = torch.cat(deltas)
    assert big_grads > 10_000
    med = d.median().item()
    print(f"bf16 mixed precision, one step at lr 1e-6: median |dw| = {med:.3e} over {d.numel()} weights, "
          f"{(d == 0).float().mean().item():.1%} unchanged")
    assert 0.9e-6 < med < 1.1e-6 and (d == 0).float().mean() < 0.01


def test_float16_is_refused():
    with pytest.raises(ValueError, match="float16 is refused"):
        TrainConfig(compute_dtype="float16")


def test_float16_weights_are_refused(small_qwen):
    with pytest.raises(ValueError, match="float16 weights are refused"):
        GRPOTrainer(small_qwen.to(torch.float16), TrainConfig(loss=LossConfig(kl_coef=0.0)))


def test_reference_logprobs_are_computed_once_per_rollout_batch(small_qwen, make_frame, monkeypatch):
    ref = copy.deepcopy(small_qwen)
    cfg = TrainConfig(lr=1e-4, token_budget=64, ppo_epochs=3, num_minibatches=2)
    trainer = GRPOTrainer(small_qwen, cfg, ref_model=ref)
    calls = []
    real = trainer._ref_logprobs
    monkeypatch.setattr(trainer, "_ref_logprobs", lambda mb: calls.append(mb) or real(mb))
    prep = trainer.prepare(make_frame(groups=2, samples=2, vocab=SMALL_VOCAB))
    n_micro = sum(len(m) for m in prep.minibatches)
    history = trainer.fit(prep)
    assert len(history) == 6 and n_micro >= 2
    assert len(calls) == n_micro  # not once per epoch
    assert all(h["kl"] > 0 for h in history[1:])


def test_gradient_sync_only_on_the_last_micro_batch(small_qwen, make_frame):
    trainer = GRPOTrainer(small_qwen, TrainConfig(token_budget=40, loss=LossConfig(kl_coef=0.0)))
    flags = []
    trainer.policy.set_requires_gradient_sync = flags.append  # what FSDP2 modules expose
    prep = trainer.prepare(make_frame(groups=1, samples=4, vocab=SMALL_VOCAB))
    trainer.accumulate(prep.minibatches[0])
    assert len(flags) == len(prep.minibatches[0]) >= 3
    assert flags == [False] * (len(flags) - 1) + [True]
    pdist.set_gradient_sync(torch.nn.Linear(1, 1), False)  # a module without FSDP: nothing to do


def test_attention_implementation_is_configured_and_checked(monkeypatch):
    check_attention_support(TrainConfig())
    check_attention_support(TrainConfig(attention="block_mask", attn_implementation="eager"))
    with pytest.raises(ValueError, match="flash_attention_2"):
        check_attention_support(TrainConfig(attention="block_mask", attn_implementation="flash_attention_2"))
    with pytest.raises(ValueError, match="must be one of"):
        check_attention_support(TrainConfig(attn_implementation="magic"))
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(ValueError, match="packed sequences would attend to each other. Use attention=block_mask"):
        check_attention_support(TrainConfig())
    check_attention_support(TrainConfig(attention="block_mask"))


def test_last_batch_frees_the_reference_and_gradients_without_changing_the_update(small_qwen, make_frame):
    """``python -m polar_training`` trains one rollout batch per process: the reference is freed once
    its logprobs are filled and the gradients after the last step (a resumed 0.5B step's peak held
    both), and the update is the same as when they are kept."""
    import gc
    import weakref

    frame = make_frame(groups=2, samples=2, vocab=SMALL_VOCAB)
    cfg = TrainConfig(lr=1e-4, token_budget=64, num_minibatches=2)
    kept = GRPOTrainer(copy.deepcopy(small_qwen), copy.deepcopy(cfg), ref_model=copy.deepcopy(small_qwen))
    want = kept.fit(frame)
    ref = copy.deepcopy(small_qwen)
    alive = weakref.ref(ref)
    freed = GRPOTrainer(copy.deepcopy(small_qwen), copy.deepcopy(cfg), ref_model=ref)
    del ref
    got = freed.fit(frame, last_batch=True)
    gc.collect()
    assert alive() is None and freed.ref_policy is None
    assert all(p.grad is None for p in freed.model.parameters())
    assert any(p.grad is not None for p in kept.model.parameters())
    assert len(got) == len(want) == 2 and all(g["kl"] > 0 for g in got[1:])
    for g, w in zip(got, want):
        for key in ("loss", "kl", "pg_loss", "grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-9), key
    for (n, a), b in zip(kept.model.named_parameters(), freed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
