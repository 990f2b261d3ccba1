"""Achieved FLOP/s of a GRPO training step vs a plain torch matmul on the same machine, same run.

    .venv/bin/python benchmarks/bench_train_flops.py [--models tiny-qwen qwen2.5-coder-0.5b-instruct]

A step = forward + backward over packed micro-batches + grad clipping + AdamW, exactly what
``GRPOTrainer.train_step`` does (TIS on; the KL term off, so no reference-model pass is timed).

Model FLOPs per step (the useful work, in the usual "6 N T" convention):
  * transformer body:  6 * N_body * T            (N_body: parameters outside embeddings/lm_head,
                                                   T: all input tokens, forward 2NT + backward 4NT)
  * output projection: 6 * V * d * K              (logits only at the K sampled positions)
  * attention:         6 * n_layers * d_attn * sum(L_i^2)
                       (QK^T and AV, causal half, x3 for backward; L_i: each packed sequence)
The matmul reference is a square float32 ``torch.mm`` (2 n^3 FLOPs) timed right before each model.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import polars as pl
import torch
from rich.console import Console
from rich.table import Table

from polar_runtime import models
from polar_training.loss import LossConfig
from polar_training.trainer import GRPOTrainer, TrainConfig, load_model

console = Console(width=170)


def matmul_flops(n: int = 2048, seconds: float = 3.0) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def synthetic_batch(vocab: int, n_seq: int, seq_len: int, seed: int = 0) -> pl.DataFrame:
    """Agent-like rows: a prompt (40%), then turns of 32 sampled tokens and 16 tool-output tokens."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_seq):
        ids = [rng.randrange(vocab) for _ in range(seq_len)]
        prompt = int(seq_len * 0.4)
        mask = [0] * prompt + [1 if (t % 48) < 32 else 0 for t in range(seq_len - prompt)]
        rows.append(
            {
                "trajectory_id": f"s{i}/0",
                "session_id": f"s{i}",
                "group_id": f"g{i // 4}",
                "input_ids": ids,
                "loss_mask": mask,
                "logprobs": [-2.0 if m else 0.0 for m in mask],
                "reward": float(i % 2),
                "status": "ok",
            }
        )
    return pl.DataFrame(rows)


def model_flops(model, microbatches) -> tuple[float, dict[str, float]]:
    cfg = model.config
    emb = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    n_body = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    d = cfg.hidden_size
    d_attn = cfg.num_attention_heads * getattr(cfg, "head_dim", d // cfg.num_attention_heads)
    tokens = sum(mb.n_tokens for mb in microbatches)
    sampled = sum(mb.n_sampled for mb in microbatches)
    sq = sum(L * L for mb in microbatches for L in mb.seq_lengths)
    parts = {
        "body": 6 * n_body * tokens,
        "lm_head": 6 * cfg.vocab_size * d * sampled,
        "attention": 6 * cfg.num_hidden_layers * d_attn * sq,
    }
    return sum(parts.values()), {"n_body": n_body, "tokens": tokens, "sampled": sampled, **parts}


def mem_available_gib() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def needed_gib(path) -> float:
    """fp32 weights + grads + two AdamW moments (16 bytes/param) + 25% for activations and logits."""
    import json

    cfg = json.loads((path / "config.json").read_text())
    d, v, n, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    kv = d // cfg["num_attention_heads"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    params = v * d * (1 if cfg.get("tie_word_embeddings") else 2) + n * (2 * d * d + 2 * d * kv + 3 * d * inter)
    return 16 * params * 1.25 / 2**30


def bench(name: str, n_seq: int, seq_len: int, steps: int, budget: int) -> dict | None:
    path = models.model_path(name)
    need, have = needed_gib(path), mem_available_gib()
    if need > have:  # a shared machine: never push other people's servers into the OOM killer
        console.print(f"[yellow]skipping {name}: needs ~{need:.1f} GiB, {have:.1f} GiB available")
        return None
    model = load_model(str(path))
    cfg = TrainConfig(lr=1e-6, token_budget=budget, loss=LossConfig(kl_coef=0.0))
    trainer = GRPOTrainer(model, cfg)
    frame = synthetic_batch(model.config.vocab_size, n_seq, seq_len)
    prep = trainer.prepare(frame)
    mbs = prep.minibatches[0]
    flops, info = model_flops(model, mbs)
    peak = matmul_flops()
    trainer.train_step(mbs)  # warm-up (allocations, optimizer state)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(mbs)
        times.append(time.perf_counter() - t0)
    t = min(times)
    row = {
        "model": name,
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "tokens": info["tokens"],
        "sampled": info["sampled"],
        "micro_batches": len(mbs),
        "padding_waste": prep.stats[0].padding_waste,
        "step_s": t,
        "tokens_per_s": info["tokens"] / t,
        "model_tflop": flops / 1e12,
        "achieved_gflops": flops / t / 1e9,
        "matmul_gflops": peak / 1e9,
        "utilization": flops / t / peak,
        "attn_share": info["attention"] / flops,
        "lm_head_share": info["lm_head"] / flops,
    }
    del trainer, model
    gc.collect()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=[models.TINY_QWEN, models.SMOLLM, models.QWEN05])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # n_seq, seq_len, token budget per micro-batch
    shapes = {models.TINY_QWEN: (8, 512, 2048), models.SMOLLM: (4, 256, 1024), models.QWEN05: (2, 256, 512)}
    rows = []
    for name in args.models:
        n_seq, seq_len, budget = shapes.get(name, (2, 256, 512))
        console.print(f"[bold]{name}[/]: {n_seq} x {seq_len} tokens, budget {budget}, {args.steps} timed steps ...")
        row = bench(name, n_seq, seq_len, args.steps, budget)
        if row:
            rows.append(row)
    table = Table(title=f"GRPO train step FLOP/s ({args.threads} threads, float32)")
    for col in ("model", "params", "tokens (sampled)", "step s", "tokens/s", "model TFLOP",
                "achieved GFLOP/s", "matmul GFLOP/s", "utilization", "attn / lm_head share"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["model"],
            f"{r['params_M']:.0f}M",
            f"{r['tokens']} ({r['sampled']})",
            f"{r['step_s']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['model_tflop']:.3f}",
            f"{r['achieved_gflops']:.1f}",
            f"{r['matmul_gflops']:.1f}",
            f"{100 * r['utilization']:.0f}%",
            f"{100 * r['attn_share']:.0f}% / {100 * r['lm_head_share']:.0f}%",
        )
    console.print(table)


if __name__ == "__main__":
    main()
