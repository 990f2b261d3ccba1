"""Log-probabilities of sampled tokens without materializing full-vocabulary logits.

With Qwen's 151,936-token vocabulary, logits for K sampled tokens take K x 0.6 MB in float32
(1,000 sampled tokens: 600 MB, several copies through log-softmax and its backward). The
:class:`ChunkedTokenLogprob` autograd function computes ``log softmax(h W^T)[target]`` (and the
entropy, as a metric) in chunks of rows, keeping only the per-row log-sum-exp; the backward pass
recomputes each chunk's logits. Peak memory is ``chunk x V`` (about 64 MB) whatever K is, at the price of one
extra output-projection matmul in the backward (the same trade as fused linear-cross-entropy
kernels).

:class:`TokenLogprobs` wraps a Hugging Face causal LM so that one ``forward`` call runs the decoder
and the chunked head. It is the module the trainer (and FSDP2, as the root of sharding) calls, so
the embeddings, final norm and output projection are unsharded inside that call.
"""

from __future__ import annotations

from typing import Any

import torch

#: Rows per chunk: about 2**24 logits (64 MB in float32) at a time; 110 rows for Qwen's vocabulary.
CHUNK_ELEMENTS = 2**24


def default_chunk(vocab_size: int) -> int:
    return max(8, CHUNK_ELEMENTS // max(vocab_size, 1))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax math in at least float32 (bf16/fp16 logits are upcast, float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


class ChunkedTokenLogprob(torch.autograd.Function):
    """(hidden [K, d], weight [V, d], targets [K]) -> (logp [K], entropy [K]), at least float32."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):
        k = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        logp = hidden.new_empty(k, dtype=acc)
        ent = hidden.new_empty(k, dtype=acc)
        lse_all = hidden.new_empty(k, dtype=acc)
        for s in range(0, k, chunk):
            logits = (hidden[s : s + chunk] @ weight.T).to(acc)
            lse = torch.logsumexp(logits, dim=-1)
            lse_all[s : s + chunk] = lse
            logp[s : s + chunk] = logits.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - lse
            p = torch.exp(logits - lse[:, None])
            ent[s : s + chunk] = lse - (p * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_ent: Any):
        hidden, weight, targets, lse_all = ctx.saved_tensors
        chunk = ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = _acc_dtype(hidden.dtype)
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            g = grad_logp[s : s + chunk].to(acc)
            logits = (h @ weight.T).to(acc)
            # d logp / d logits = onehot(target) - softmax(logits)
            grad_logits = torch.exp(logits - lse_all[s : s + chunk, None]).mul_(-g[:, None])
            grad_logits.scatter_add_(-1, targets[s : s + chunk, None], g[:, None])
            grad_logits = grad_logits.to(hidden.dtype)
            if need_h:
                grad_h[s : s + chunk] = grad_logits @ weight
            if need_w:
                grad_w.addmm_(grad_logits.T.to(acc), h.to(acc))
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy per row of ``hidden`` for the given target ids (see the module docstring)."""
    chunk = chunk or default_chunk(weight.shape[0])
    if hidden.shape[0] == 0:
        z = hidden.new_zeros(0, dtype=torch.float32) + weight.sum() * 0  # keeps the graph connected
        return z, z.detach()
    return ChunkedTokenLogprob.apply(hidden, weight, targets, chunk)


class TokenLogprobs(torch.nn.Module):
    """A causal LM as ``(packed ids, positions) -> logprobs of the sampled tokens``."""

    def __init__(self, lm: torch.nn.Module, chunk: int | None = None):
        super().__init__()
        self.lm = lm
        self.chunk = chunk
        head = lm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("output projections with a bias are not supported")

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logit_positions: torch.Tensor,
        target_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # use_cache=False is essential: with a cache transformers skips packed-sequence detection.
        out = self.lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
        )
        hidden = out.last_hidden_state[0, logit_positions]
        return chunked_token_logprobs(hidden, self.lm.get_output_embeddings().weight, target_ids, self.chunk)


def policy_logprobs(policy: torch.nn.Module, mb: Any, with_entropy: bool = False) -> tuple[torch.Tensor, Any]:
    """Logprobs (and entropies) of one packed micro-batch's sampled tokens.

    ``policy`` is a :class:`TokenLogprobs` (possibly FSDP-sharded) or a plain causal LM, which is
    wrapped on the fly.
    """
    if not isinstance(policy, TokenLogprobs) and not isinstance(getattr(policy, "_orig_mod", None), TokenLogprobs):
        policy = TokenLogprobs(policy)
    param = next(policy.parameters())
    dev = param.device
    mask = None
    if mb.attention_mask is not None:
        mask = mb.attention_mask.to(device=dev, dtype=param.dtype)
    logp, ent = policy(
        mb.input_ids.to(dev), mb.position_ids.to(dev), mb.logit_positions.to(dev), mb.target_ids.to(dev), mask
    )
    return logp, (ent if with_entropy else None)
