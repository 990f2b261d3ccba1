"""The chunked sampled-token logprob equals full log-softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch

from polar_training.policy import chunked_token_logprobs


def test_chunked_logprobs_and_gradients_equal_the_full_log_softmax():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 300, (37,), generator=gen)
    g = torch.randn(37, generator=gen, dtype=torch.float64)

    logits = h @ w.T
    full = torch.log_softmax(logits, -1).gather(-1, t[:, None]).squeeze(-1)
    p = torch.softmax(logits, -1)
    full_ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    gh, gw = torch.autograd.grad((full * g).sum(), (h, w))

    lp, ent = chunked_token_logprobs(h, w, t, chunk=8)  # 5 chunks, the last one partial
    assert torch.allclose(lp.double(), full, atol=1e-10)
    assert torch.allclose(ent.double(), full_ent.detach(), atol=1e-10)
    ch, cw = torch.autograd.grad((lp * g).sum(), (h, w))
    assert torch.allclose(ch, gh, atol=1e-10) and torch.allclose(cw, gw, atol=1e-10)
    assert not ent.requires_grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _bf16_case(top_p: float):
    """Hidden states and an output layer in float32 (master weights), sampled at T=0.7."""
    gen = torch.Generator().manual_seed(1)
    k, d, v = 64, 64, 1000
    h = torch.randn(k, d, generator=gen).requires_grad_(True)
    w = torch.randn(v, d, generator=gen).requires_grad_(True)  # logits ~ 8: an LM's scale
    temps = torch.full((k,), 0.7)
    tp = torch.full((k,), top_p) if top_p < 1 else None
    # targets vLLM could have sampled: inside the top-p set (here the most likely token of each row)
    t = (h @ w.T).argmax(-1).detach()
    g = torch.randn(k, generator=gen)
    return h, w, t, temps, tp, g


def _autograd_bf16(h, w, t, temps, tp):
    """Plain autograd of the same mixed-precision forward: the matmul in bf16 under autocast, the
    softmax math in float32, top-p as vLLM applies it."""
    from polar_training.policy import sampling_keep_mask

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = (h @ w.T).float() / temps[:, None]
    keep = sampling_keep_mask(logits.detach(), None, tp)
    if keep is not None:
        keep.scatter_(1, t[:, None], True)
        logits = logits.masked_fill(~keep, -float("inf"))
    return torch.log_softmax(logits, -1).gather(-1, t[:, None]).squeeze(-1)


@pytest.mark.parametrize("top_p", [1.0, 0.9], ids=["T0.7", "T0.7-top_p0.9"])
def test_bf16_autocast_gradients_equal_autograd_of_the_same_bf16_forward(top_p):
    """Mixed precision on one process (the trainer's autocast): the chunked function's forward
    computes the logits in bf16, and its backward must differentiate that same forward. Before the
    fix the backward (outside autocast) recomputed float32 logits against the bf16 log-sum-exp:
    weight-gradient error 8.3e-2 (T=0.7) and 9.1e-2 (top-p 0.9) relative to autograd here, more
    than bf16 rounding moves the gradient from float32's (4.1e-2, 5.3e-2); fixed: 1.6e-3, 1.7e-3."""
    h, w, t, temps, tp, g = _bf16_case(top_p)
    want = _autograd_bf16(h, w, t, temps, tp)
    gh, gw = torch.autograd.grad((want * g).sum(), (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = chunked_token_logprobs(h, w, t, chunk=16, temps=temps, top_p=tp)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # the forwards are the same computation
    ch, cw = torch.autograd.grad((got * g).sum(), (h, w))
    err_w, err_h = _rel(cw, gw), _rel(ch, gh)
    # for scale: how far bf16 rounding alone moves the gradient from the float32 computation's
    lp32, _ = chunked_token_logprobs(h, w, t, chunk=16, temps=temps, top_p=tp)
    _, fw = torch.autograd.grad((lp32 * g).sum(), (h, w))
    rounding = _rel(gw, fw)
    print(f"top_p={top_p}: weight-gradient error {err_w:.2e}, hidden-gradient error {err_h:.2e} against autograd "
          f"of the bf16 forward (bf16 vs float32: {rounding:.2e})")
    assert err_w < 1e-2 and err_h < 1e-2
    assert err_w < rounding / 3
