"""A parity self-check of FSDP2 training: one mini-batch's loss and full gradients.

What the multi-process test runs, and what a multi-GPU user can run on their setup::

    torchrun --nproc-per-node 2 -m polar_training.parity parity \\
        --model DIR --trajectories T.parquet --out grads.pt

computes one mini-batch's loss and full (unsharded) gradients without stepping the optimizer.
Run it with one process and with N and compare the files: they must agree to float tolerance.
(A module of its own: it drives the trainer, which itself uses :mod:`polar_training.distributed`.)
"""

from __future__ import annotations

from typing import Any

import torch

from .distributed import full_gradients, init_from_env, is_main, rank_and_world, shutdown
from .trainer import GRPOTrainer, TrainConfig, load_models


def parity(
    model_dir: str, trajectories: str, out: str, token_budget: int = 256, seed: int = 0, dtype: str = "float32"
) -> dict[str, Any]:
    """One mini-batch's loss and full gradients, single- or multi-process (see the module doc)."""
    import polars as pl

    init_from_env()
    torch.manual_seed(seed)
    cfg = TrainConfig(token_budget=token_budget, seed=seed, compute_dtype=dtype)
    model, ref = load_models(model_dir, cfg)
    trainer = GRPOTrainer(model, cfg, ref_model=ref)
    prep = trainer.prepare(pl.read_parquet(trajectories))
    acc = trainer.accumulate(prep.minibatches[0])
    grads = full_gradients(trainer.policy)
    result = {"loss": acc.loss, "n_tokens": acc.sums.get("n_tokens", 0.0), "world": rank_and_world()[1], "grads": grads,
              "param_dtypes": sorted({str(p.dtype) for p in trainer.policy.parameters()})}
    if is_main():
        torch.save(result, out)
    shutdown()  # every rank leaves the group before any exits (distributed.shutdown)
    return result


def _main() -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m polar_training.parity")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("parity", help="one mini-batch's loss and full gradients (compare 1 vs N processes)")
    p.add_argument("--model", required=True)
    p.add_argument("--trajectories", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--token-budget", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="compute dtype: float32 | bfloat16 (mixed precision)")
    a = ap.parse_args()
    r = parity(a.model, a.trajectories, a.out, a.token_budget, a.seed, a.dtype)
    if is_main():
        print(f"world={r['world']} loss={r['loss']:.8f} sampled_tokens={int(r['n_tokens'])} grads={len(r['grads'])}")


if __name__ == "__main__":
    _main()
