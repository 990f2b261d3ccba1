"""The GRPO loss and its gradient against a hand-computed reference, token by token."""

from __future__ import annotations

import math

import pytest
import torch

from polar_training.loss import LossConfig, aggregation_weights, grpo_token_loss, kl_penalty

# (advantage, log ratio to the old policy): every side of the asymmetric clip.
CASES = [
    (+1.0, math.log(1.10)),  # A>0 inside the range: gradient flows
    (+1.0, math.log(1.50)),  # A>0 above 1+0.28: clipped, no gradient
    (-1.0, math.log(0.90)),  # A<0 inside: gradient flows
    (-1.0, math.log(0.50)),  # A<0 below 1-0.2: clipped, no gradient
    (+0.7, math.log(0.50)),  # A>0 below the range: pessimistic min keeps the unclipped term
    (-0.4, math.log(1.50)),  # A<0 above the range: unclipped term, gradient flows
    (+2.0, math.log(1.25)),  # A>0 just inside the high side (0.28), outside a symmetric 0.2
    (0.0, math.log(1.30)),  # zero advantage: only the KL term
]


def reference(logp, old, beh, adv, ref, w, cfg: LossConfig):
    """Plain-Python loss and d loss / d logp (the formulas of the loss module's docstring)."""
    loss, grads = 0.0, []
    for lp, o, b, a, rf, wt in zip(logp, old, beh, adv, ref, w):
        if cfg.use_tis:
            r = math.exp(lp - o)
            isw = min(math.exp(o - b), cfg.tis_cap)
        else:
            r = math.exp(lp - b)
            isw = 1.0
        rc = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
        unclipped, clipped = -a * r, -a * rc
        if unclipped >= clipped:
            pg, dpg = isw * unclipped, isw * (-a * r)
        else:
            pg, dpg = isw * clipped, 0.0
        kl = dkl = 0.0
        if cfg.use_kl:
            kl = math.exp(rf - lp) - (rf - lp) - 1
            dkl = 1 - math.exp(rf - lp)
        loss += wt * (pg + cfg.kl_coef * kl)
        grads.append(wt * (dpg + cfg.kl_coef * dkl))
    return loss, grads


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_loss_and_gradient_match_hand_reference(kl_coef, tis_cap):
    cfg = LossConfig(kl_coef=kl_coef, tis_cap=tis_cap)
    gen = torch.Generator().manual_seed(1)
    n = len(CASES)
    old = (-torch.rand(n, generator=gen, dtype=torch.float64) * 5 - 0.1).tolist()
    adv = [a for a, _ in CASES]
    logp = [o + d for o, (_, d) in zip(old, CASES)]
    # engine/trainer mismatch: one token far enough to be truncated at C=2
    beh = [o + 0.05 * (i % 3 - 1) for i, o in enumerate(old)]
    beh[2] = old[2] - 1.5  # exp(1.5) = 4.48 > 2
    ref = [o + 0.3 * (i % 2) - 0.1 for i, o in enumerate(old)]
    w = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.1).tolist()
    if not cfg.use_tis:  # without TIS the ratio is against the behaviour logprobs
        beh = old
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    out = grpo_token_loss(
        lp,
        torch.tensor(beh, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(w, dtype=torch.float64),
        cfg,
        old_logp=torch.tensor(old, dtype=torch.float64),
        ref_logp=torch.tensor(ref, dtype=torch.float64),
    )
    out.loss.backward()
    want_loss, want_grad = reference(logp, old, beh, adv, ref, w, cfg)
    assert out.loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    assert lp.grad.tolist() == pytest.approx(want_grad, rel=1e-10, abs=1e-12)
    # the clipped tokens carry no policy gradient; the others do
    if kl_coef == 0:
        assert lp.grad[1] == 0 and lp.grad[3] == 0
        assert all(lp.grad[i] != 0 for i in (0, 2, 4, 5, 6))
    assert out.sums["clip_high_count"] == 1  # case 1 only (case 6 is inside 0.28)
    assert out.sums["clip_low_count"] == 1  # case 3
    if cfg.use_tis:
        assert out.sums["tis_truncated_count"] == 1
        assert out.sums["tis_weight_sum"] == pytest.approx(
            sum(min(math.exp(o - b), 2.0) for o, b in zip(old, beh)), rel=1e-12
        )


def test_symmetric_clip_would_clip_what_asymmetric_keeps():
    lp = torch.tensor([math.log(1.25)], dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros(1, dtype=torch.float64)
    ones = torch.ones(1, dtype=torch.float64)
    for high, clipped in ((0.28, False), (0.2, True)):
        lp.grad = None
        cfg = LossConfig(clip_high=high, kl_coef=0.0, tis_cap=None)
        out = grpo_token_loss(lp, zeros, ones, ones, cfg)
        out.loss.backward()
        assert (lp.grad.item() == 0.0) is clipped


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_ratio_is_exactly_one_on_policy(tis_cap):
    """Policy == behaviour logprobs (and == the trainer's old logprobs): ratio 1, no clipping."""
    cfg = LossConfig(tis_cap=tis_cap, kl_coef=0.0)
    logp = torch.log_softmax(torch.randn(50, 7, generator=torch.Generator().manual_seed(3)), -1)[:, 0]
    lp = logp.clone().requires_grad_(True)
    adv = torch.linspace(-2, 2, 50)
    w = torch.full((50,), 1 / 50)
    out = grpo_token_loss(lp, logp.clone(), adv, w, cfg, old_logp=lp.detach())
    assert out.sums["ratio_sum"] == 50.0
    assert out.maxes["ratio_max"] == 1.0
    assert out.sums["clip_low_count"] == 0 and out.sums["clip_high_count"] == 0
    assert out.sums["tis_weight_sum"] == 50.0
    # d/dlogp of -A * ratio at ratio 1 is exactly -A * w
    out.loss.backward()
    assert torch.allclose(lp.grad, -adv * w, atol=1e-7)


def test_kl_k3_is_nonnegative_zero_at_equality_and_clamped():
    lp = torch.tensor([-1.0, -2.0, -3.0, -30.0])
    ref = torch.tensor([-1.0, -1.5, -3.5, -1.0])
    k3 = kl_penalty(lp, ref, "k3")
    assert k3[0] == 0 and (k3 >= 0).all()
    assert k3[1].item() == pytest.approx(math.exp(0.5) - 0.5 - 1)
    assert kl_penalty(lp, ref, "low_var_kl")[3] == 10.0 and k3[3] > 10.0


def test_nonfinite_behaviour_logprob_is_bounded():
    """A -inf behaviour logprob (e.g. a token vLLM reported as impossible) must not poison the batch."""
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    beh = torch.tensor([-float("inf"), -2.0])
    for cap in (None, 2.0):
        out = grpo_token_loss(
            lp, beh, torch.ones(2), torch.full((2,), 0.5), LossConfig(tis_cap=cap, kl_coef=0.0), old_logp=lp.detach()
        )
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()


def test_aggregation_weights_give_the_documented_means():
    seq = torch.tensor([0, 0, 0, 1, 2, 2])  # lengths 3, 1, 2
    losses = torch.tensor([1.0, 2.0, 3.0, 10.0, 4.0, 6.0], dtype=torch.float64)
    tm = aggregation_weights(seq, 3, "token-mean") @ losses
    smtm = aggregation_weights(seq, 3, "seq-mean-token-mean") @ losses
    smts = aggregation_weights(seq, 3, "seq-mean-token-sum") @ losses
    assert tm.item() == pytest.approx(26 / 6)
    assert smtm.item() == pytest.approx((2.0 + 10.0 + 5.0) / 3)
    assert smts.item() == pytest.approx((6.0 + 10.0 + 10.0) / 3)
    with pytest.raises(ValueError):
        LossConfig(aggregation="mean")
