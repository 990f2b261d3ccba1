"""Trainer memory per configuration: computed for any model config, measured (peak RSS) on CPU.

    .venv/bin/python benchmarks/bench_train_memory.py --measure smollm2-135m-instruct --tokens 1024
    .venv/bin/python benchmarks/bench_train_memory.py --compute-only          # the 4B table

Computed (bytes):
  * policy weights: 4 B/param (float32 master weights; bf16 "mixed" keeps them float32 too)
  * gradients:      4 B/param (gradients of float32 parameters are float32)
  * AdamW state:    8 B/param (exp_avg + exp_avg_sq, float32)
  * reference:      4 B/param float32, 2 B/param when computing in bf16, 0 with kl_coef = 0
  * activations kept for backward, per token per decoder layer: about 10*d + 4*d_ff elements
    (norm inputs, q/k/v/o projections, attention output, SwiGLU gate/up/act/down inputs) at the
    compute dtype's width; with gradient checkpointing only each layer's input (d elements) is kept
    plus one layer's full set during its recomputation
  * the chunked logprob head: ~64 MB whatever the vocabulary (see training/policy.py)
FSDP over N devices divides weights, gradients and optimizer state by N (activations stay per device);
with ``grad_sync="last"`` (no reduce-scatter on non-final micro-batches) the gradients accumulate
unsharded until the last micro-batch: full size on every device, less communication.
Each measured configuration runs in its own process (``--one``) and reports ``ru_maxrss``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time

GiB = 2**30

#: Qwen3-4B's shape (config.json of the public release): the 4B the Polar recipe trains.
QWEN3_4B = {"name": "Qwen3-4B", "params": 4.02e9, "hidden": 2560, "ffn": 9728, "layers": 36, "vocab": 151936}

CONFIGS = {
    # name: (compute dtype, kl on, gradient checkpointing)
    "fp32, KL (fp32 reference)": ("float32", True, False),
    "fp32, kl_coef 0 (no reference)": ("float32", False, False),
    "fp32, kl_coef 0, grad. checkpointing": ("float32", False, True),
    "bf16 mixed, KL (bf16 reference), grad. ckpt": ("bfloat16", True, True),
    "bf16 mixed, kl_coef 0, grad. checkpointing": ("bfloat16", False, True),
}


def estimate(shape: dict, dtype: str, kl: bool, ckpt: bool, tokens: int, shards: int = 1,
             unsharded_grads: bool = False) -> dict[str, float]:
    n, d, f, L = shape["params"], shape["hidden"], shape["ffn"], shape["layers"]
    width = 2 if dtype == "bfloat16" else 4
    per_layer = (10 * d + 4 * f) * width  # bytes per token per layer
    act = tokens * (L * d * width + per_layer) if ckpt else tokens * L * per_layer
    out = {
        "weights": 4 * n / shards,
        "grads": 4 * n / (1 if unsharded_grads else shards),
        "adam": 8 * n / shards,
        "reference": (width * n / shards) if kl else 0.0,
        "activations": act,
        "head": 64 * 2**20,
    }
    out["total"] = sum(out.values())
    return out


def shape_of(model_dir: str) -> dict:
    cfg = json.loads(open(f"{model_dir}/config.json").read())
    from transformers import AutoConfig, AutoModelForCausalLM

    c = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with __import__("torch").device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(c).parameters())
    return {"name": model_dir.rstrip("/").split("/")[-1], "params": n, "hidden": cfg["hidden_size"],
            "ffn": cfg["intermediate_size"], "layers": cfg["num_hidden_layers"], "vocab": cfg["vocab_size"]}


def one(model: str, conf: str, tokens: int) -> None:
    """Measure one configuration in this process: one optimizer step on one micro-batch."""
    import polars as pl
    import torch

    from polar_runtime import models
    from polar_training.loss import LossConfig
    from polar_training.trainer import GRPOTrainer, TrainConfig, load_models

    torch.set_num_threads(2)
    dtype, kl, ckpt = CONFIGS[conf]
    mdir = str(models.ensure_model(model))
    cfg = TrainConfig(lr=1e-6, token_budget=tokens, compute_dtype=dtype, gradient_checkpointing=ckpt,
                      loss=LossConfig(kl_coef=0.001 if kl else 0.0))
    policy, ref = load_models(mdir, cfg)
    trainer = GRPOTrainer(policy, cfg, ref_model=ref)
    rng = random.Random(0)
    vocab = policy.config.vocab_size
    rows = []
    for i in range(2):
        ids = [rng.randrange(vocab) for _ in range(tokens // 2)]
        prompt = len(ids) // 3
        rows.append({"trajectory_id": f"s{i}/0", "session_id": f"s{i}", "group_id": "g", "input_ids": ids,
                     "loss_mask": [0] * prompt + [1] * (len(ids) - prompt), "logprobs": [-5.0] * len(ids),
                     "reward": float(i), "status": "ok"})
    t0 = time.perf_counter()
    trainer.fit(pl.DataFrame(rows))
    print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "step_s": time.perf_counter() - t0}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", nargs="*", default=[], help="Polar model names to measure on this machine")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--compute-only", action="store_true")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "CONFIG", "TOKENS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        one(a.one[0], a.one[1], int(a.one[2]))
        return
    print(f"computed, {QWEN3_4B['name']} ({QWEN3_4B['params'] / 1e9:.2f}B), micro-batch of 4096 tokens (GiB):")
    print("| configuration | weights | grads | AdamW | reference | activations | total, 1 device | FSDP x8, grad_sync last | FSDP x8, grad_sync every |")
    print("|---|---|---|---|---|---|---|---|---|")
    for conf, (dtype, kl, ckpt) in CONFIGS.items():
        e = estimate(QWEN3_4B, dtype, kl, ckpt, 4096)
        e8 = estimate(QWEN3_4B, dtype, kl, ckpt, 4096, shards=8)
        e8u = estimate(QWEN3_4B, dtype, kl, ckpt, 4096, shards=8, unsharded_grads=True)
        print(f"| {conf} | {e['weights'] / GiB:.1f} | {e['grads'] / GiB:.1f} | {e['adam'] / GiB:.1f} | "
              f"{e['reference'] / GiB:.1f} | {e['activations'] / GiB:.1f} | {e['total'] / GiB:.1f} | {e8u['total'] / GiB:.1f} | "
              f"{e8['total'] / GiB:.1f} |")
    if a.compute_only:
        return
    from polar_runtime import models

    for model in a.measure:
        shape = shape_of(str(models.ensure_model(model)))
        print(f"\nmeasured, {model} ({shape['params'] / 1e6:.0f}M params), one step on {a.tokens} tokens, CPU:")
        print("| configuration | computed GiB | peak RSS GiB | step s |")
        print("|---|---|---|---|")
        for conf in a.configs:
            dtype, kl, ckpt = CONFIGS[conf]
            r = subprocess.run([sys.executable, __file__, "--one", model, conf, str(a.tokens)], capture_output=True,
                               text=True)
            if r.returncode:
                print(f"| {conf} | failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode} | | |")
                continue
            got = json.loads(r.stdout.strip().splitlines()[-1])
            e = estimate(shape, dtype, kl, ckpt, a.tokens)
            print(f"| {conf} | {e['total'] / GiB:.2f} | {got['peak_rss'] / GiB:.2f} | {got['step_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
