"""The chunked sampled-token logprob equals full log-softmax, values and gradients."""

from __future__ import annotations

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
