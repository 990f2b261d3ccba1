"""Log-probabilities of sampled tokens without materializing full-vocabulary logits.

With Qwen's 151,936-token vocabulary, logits for K sampled tokens take K x 0.6 MB in float32
(1,000 sampled tokens: 600 MB, several copies through log-softmax and its backward). The
:class:`ChunkedTokenLogprob` autograd function computes ``log softmax(h W^T)[target]`` (and the
entropy, as a metric) in chunks of rows, keeping only the per-row log-sum-exp; the backward pass
recomputes each chunk's logits. Logits are divided by each token's recorded sampling temperature
and, where the call used top-k/top-p, renormalized over the entries vLLM kept (same algorithm), so
the logprobs are those of the distribution vLLM sampled from. Peak memory is ``chunk x V`` (about 64 MB) whatever K is, at the price of one
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


def sampling_keep_mask(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor | None:
    """Which vocabulary entries survive top-k then top-p on temperature-scaled logits ``z`` [n, V],
    computed the way vLLM 0.32 does (``apply_top_k_top_p_pytorch``: ascending sort, top-k keeps
    values >= the k-th largest, top-p drops the entries whose cumulative probability from the
    bottom is <= 1 - p, always keeping the largest). ``top_k`` [n] (<= 0: off), ``top_p`` [n]
    (>= 1: off). None when no row filters anything."""
    need_k = top_k is not None and bool((top_k > 0).any())
    need_p = top_p is not None and bool((top_p < 1).any())
    if not (need_k or need_p):
        return None
    v = z.shape[-1]
    z_sort, idx = z.sort(dim=-1, descending=False)
    if need_k:
        k = torch.where(top_k > 0, top_k, v).clamp(max=v).to(torch.long)
        kth = z_sort.gather(1, (v - k)[:, None])
        z_sort = z_sort.masked_fill(z_sort < kth, -float("inf"))
    if need_p:
        probs = z_sort.softmax(dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum <= (1 - top_p.to(cum.dtype))[:, None]
        drop[:, -1] = False
        z_sort = z_sort.masked_fill(drop, -float("inf"))
    keep_sorted = z_sort > -float("inf")
    return torch.empty_like(keep_sorted).scatter_(1, idx, keep_sorted)


def _scaled_logits(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, acc: torch.dtype,
    temps: torch.Tensor | None, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits of one chunk divided by each row's temperature, and the top-k/top-p keep mask (the
    sampled token is always kept: its logprob is what the loss needs). ``h`` and ``weight`` are
    already in the matmul dtype (see :func:`_matmul_dtype`)."""
    logits = (h @ weight.T).to(acc)
    if temps is not None:
        logits = logits / temps.to(acc)[:, None]
    keep = sampling_keep_mask(logits.detach(), top_k, top_p)
    if keep is not None:
        keep.scatter_(1, targets[:, None], True)
        logits = logits.masked_fill(~keep, -float("inf"))
    return logits, keep


def _matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype of the output-projection matmul: autocast's when it is on for this device (mixed
    precision computes the logits in bf16), else the inputs' own.

    Forward and backward must use the same one. The backward runs outside the autocast region, so
    a backward that recomputed ``h @ W^T`` with the plain float32 tensors compared float32 logits
    with the log-sum-exp of the bf16 ones: the softmax terms no longer summed to 1 and the weight
    gradient was off by 9.1e-2 (relative) against autograd of the same bf16 forward at T=0.7,
    top-p 0.9 (8.3e-2 without top-p; logits of an LM's scale, tests/training/test_policy.py), more
    than bf16 rounding itself moves it (5.3e-2); with the dtype recorded here and reused, 1.7e-3.
    The same as ``torch.amp.custom_fwd/custom_bwd``, for whichever device the tensors are on.
    """
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return hidden.dtype


class ChunkedTokenLogprob(torch.autograd.Function):
    """(hidden [K, d], weight [V, d], targets [K]) -> (logp [K], entropy [K]), at least float32.

    Optional per-row ``temps`` [K] (the temperature the token was sampled at: logits are divided
    by it), ``top_k`` [K] and ``top_p`` [K] (the distribution is renormalized over the entries vLLM
    kept): the logprob of the distribution the token was actually sampled from."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, temps=None, top_k=None, top_p=None):
        k = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        mm = _matmul_dtype(hidden)
        logp = hidden.new_empty(k, dtype=acc)
        ent = hidden.new_empty(k, dtype=acc)
        lse_all = hidden.new_empty(k, dtype=acc)
        sl = lambda t, s: None if t is None else t[s : s + chunk]  # noqa: E731
        with torch.autocast(hidden.device.type, enabled=False):  # the dtype is explicit from here on
            w_mm = weight.to(mm)  # one cast for all chunks (autocast would cache the same copy)
            for s in range(0, k, chunk):
                logits, keep = _scaled_logits(
                    hidden[s : s + chunk].to(mm), w_mm, targets[s : s + chunk], acc, sl(temps, s), sl(top_k, s), sl(top_p, s)
                )
                lse = torch.logsumexp(logits, dim=-1)
                lse_all[s : s + chunk] = lse
                logp[s : s + chunk] = logits.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - lse
                p = torch.exp(logits - lse[:, None])
                finite = logits if keep is None else logits.masked_fill(~keep, 0.0)
                ent[s : s + chunk] = lse - (p * finite).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse_all, temps, top_k, top_p)
        ctx.chunk = chunk
        ctx.mm_dtype = mm
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_ent: Any):
        hidden, weight, targets, lse_all, temps, top_k, top_p = ctx.saved_tensors
        chunk, mm = ctx.chunk, ctx.mm_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = _acc_dtype(hidden.dtype)
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        sl = lambda t, s: None if t is None else t[s : s + chunk]  # noqa: E731
        with torch.autocast(hidden.device.type, enabled=False):
            w_mm = weight.to(mm)
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s : s + chunk].to(mm)
                g = grad_logp[s : s + chunk].to(acc)
                # the logits exactly as the forward computed them (same matmul dtype), so that
                # exp(logits - lse) is the forward's softmax
                logits, _keep = _scaled_logits(h, w_mm, targets[s : s + chunk], acc, sl(temps, s), sl(top_k, s), sl(top_p, s))
                # d logp / d z = onehot(target) - softmax(z) over the kept entries (masked ones: exp(-inf) = 0)
                grad_logits = torch.exp(logits - lse_all[s : s + chunk, None]).mul_(-g[:, None])
                grad_logits.scatter_add_(-1, targets[s : s + chunk, None], g[:, None])
                if temps is not None:  # z = logits / T
                    grad_logits.div_(temps[s : s + chunk].to(acc)[:, None])
                grad_logits = grad_logits.to(mm)  # as autograd of the forward's matmul would
                if need_h:
                    grad_h[s : s + chunk] = (grad_logits @ w_mm).to(hidden.dtype)
                if need_w:  # summed over chunks in at least float32, in place (no V x d temporary)
                    grad_w.addmm_(grad_logits.T.to(acc), h.to(acc))
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int | None = None,
    temps: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy per row of ``hidden`` for the given target ids (see the module docstring)."""
    chunk = chunk or default_chunk(weight.shape[0])
    if hidden.shape[0] == 0:
        z = hidden.new_zeros(0, dtype=torch.float32) + weight.sum() * 0  # keeps the graph connected
        return z, z.detach()
    if temps is not None and bool((temps == 1).all()):
        temps = None
    return ChunkedTokenLogprob.apply(hidden, weight, targets, chunk, temps, top_k, top_p)


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
        temps: torch.Tensor | None = None,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # use_cache=False is essential: with a cache transformers skips packed-sequence detection.
        out = self.lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
        )
        hidden = out.last_hidden_state[0, logit_positions]
        weight = self.lm.get_output_embeddings().weight
        if hidden.dtype != weight.dtype:  # autocast (mixed precision) computes the decoder in bf16
            hidden = hidden.to(weight.dtype)
        return chunked_token_logprobs(hidden, weight, target_ids, self.chunk, temps, top_k, top_p)


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
    opt = lambda t: None if t is None else t.to(dev)  # noqa: E731
    logp, ent = policy(
        mb.input_ids.to(dev), mb.position_ids.to(dev), mb.logit_positions.to(dev), mb.target_ids.to(dev), mask,
        opt(getattr(mb, "temperature", None)), opt(getattr(mb, "top_k", None)), opt(getattr(mb, "top_p", None)),
    )
    return logp, (ent if with_entropy else None)
