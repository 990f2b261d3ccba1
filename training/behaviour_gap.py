"""vLLM's behaviour logprobs against the trainer's own, on every sampled token of a trajectory frame.

The first GRPO update compares the captured (behaviour) logprobs with the trainer's logprobs of the
same tokens under the same weights (``fill_old_logprobs``); where a token is trained in the context
it was sampled in, at the temperature it was sampled at, the two agree to the kernels' error
(float32 on CPU: ~1e-5 per token measured, ``tests/training/test_behaviour_logprobs.py``). The mean
gap is the trainer's ``mismatch_kl`` (k1: vLLM's logprob minus the trainer's); its largest
per-token value points at the token that broke.

One definition for the benchmarks that measure it (``bench_exact_onoff``, ``bench_reasoning_live``)
and for ``polar certify``'s logprob-agreement check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def behaviour_gap(frame: Any, model_dir: str | Path, token_budget: int = 65536, dtype: str = "float32") -> dict[str, float]:
    """``tokens``, ``mismatch_kl`` (mean of vLLM's logprob minus the trainer's) and ``max_abs_gap``
    over every sampled token of ``frame``, and the same over later turns (``later_*``: the tokens of
    a sequence's second and later calls, whose context depends on how the history was re-sent).

    One no-grad pass of the trainer in ``dtype`` over the weights in ``model_dir`` (those that
    served the frame's tokens). Rows the trainer would refuse (``sampling_issue``) are left out
    and counted (``refused_rows``): the sampling check names them."""
    import polars as pl
    import torch

    from .trainer import GRPOTrainer, TrainConfig, load_model

    refused = 0
    if "sampling_issue" in frame.columns:
        refused = int(frame["sampling_issue"].is_not_null().sum())
        frame = frame.filter(pl.col("sampling_issue").is_null())
    if frame.height == 0:
        return {"tokens": 0.0, "mismatch_kl": float("nan"), "max_abs_gap": float("nan"), "refused_rows": float(refused)}
    cfg = TrainConfig(lr=1e-6, token_budget=token_budget)
    cfg.loss.kl_coef = 0.0
    cfg.adv.drop_zero_variance = False  # every sampled token is measured, whatever the group's rewards
    torch.manual_seed(0)
    trainer = GRPOTrainer(load_model(str(model_dir), dtype), cfg)
    prep = trainer.prepare(frame)
    assert len(prep.minibatches) == 1  # num_minibatches 1: seq_index is the row of prep.frame
    mbs = [mb for part in prep.minibatches for mb in part]
    trainer.fill_old_logprobs(mbs)
    seq = torch.cat([mb.seq_index for mb in mbs])
    gap = torch.cat([mb.behaviour_logp.float() - mb.old_logp.float() for mb in mbs])
    later = []
    for i, row in enumerate(prep.frame.iter_rows(named=True)):
        g, k = gap[seq == i], 0  # a row's tokens stay in order inside its bin
        sampled = [e - s for s, e, kind in zip(row["span_start"], row["span_end"], row["span_kind"]) if kind == "sampled"]
        for n, length in enumerate(sampled):
            if n > 0:
                later.append(g[k : k + length])
            k += length
    out = {"tokens": float(gap.numel()), "mismatch_kl": float(gap.mean()), "max_abs_gap": float(gap.abs().max()),
           "refused_rows": float(refused)}
    if later and sum(t.numel() for t in later):
        lg = torch.cat(later)
        out |= {"later_tokens": float(lg.numel()), "later_mismatch_kl": float(lg.mean()),
                "later_max_abs_gap": float(lg.abs().max())}
    return out
