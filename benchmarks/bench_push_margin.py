"""How well the push check (``weights_push.probe_verdict``) tells new weights from old, per dtype.

For a model on this machine's CPU: the probe ``polar train`` stores (the first 48 ids of the first
trajectory row of a recorded ``polar demo`` run), the trainer's float32 logprobs of it before and
after one AdamW step (from fresh optimizer state a step moves every weight with a gradient by
``lr * sign(grad)``; the gradient is the policy gradient of the first 64 sampled tokens of two
recorded samples, advantages +1 and -1), and a bf16 "server": the same forward under bf16 autocast, which rounds
weights and activations to bf16 as a bf16 vLLM does (other kernels: the real server's noise is
larger, see ``PROBE_NOISE``).

Prints and writes ``benchmarks/results/push_margin-<model>.json``: the bf16 noise (rms of bf16 minus
float32 probe logprobs), the update's probe change, and the verdict (alpha, separation in noise
units) with and without the baseline measured before the reload, for old and new weights served.

    .venv/bin/python benchmarks/bench_push_margin.py [--model DIR] [--lr 1e-6 --lr 1e-5]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import polars as pl
import torch

from polar_core.paths import models_dir
from polar_training.checkpoint import probe_logprobs
from polar_training.policy import TokenLogprobs
from polar_training.weights_push import ServedBefore, probe_verdict

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "demo-run-exact" / "trajectories" / "step-0.parquet"


def rms(xs):
    return math.sqrt(sum(x * x for x in xs) / max(len(xs), 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(models_dir() / "qwen2.5-coder-0.5b-instruct"))
    ap.add_argument("--lr", type=float, action="append")
    ap.add_argument("--out", help="default: benchmarks/results/push_margin-<model dir name>.json")
    args = ap.parse_args()
    lrs = args.lr or [1e-6, 1e-5]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    frame = pl.read_parquet(FIXTURE)
    probe = list(frame["input_ids"][0][:48])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True)
    policy = TokenLogprobs(model)

    def both() -> tuple[list[float], list[float]]:
        f32 = probe_logprobs(policy, probe)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b16 = probe_logprobs(policy, probe)
        return f32, b16

    t0 = time.perf_counter()
    old32, old16 = both()
    # the policy gradient of two recorded samples' first 64 sampled tokens (advantages +1 and -1)
    rows = frame.head(2)
    loss = 0.0
    for sign, (ids, mask) in zip((1.0, -1.0), zip(rows["input_ids"].to_list(), rows["loss_mask"].to_list())):
        pos = [t for t in range(1, len(ids)) if mask[t]][:64]
        ids = ids[: pos[-1] + 1]
        x = torch.tensor([ids])
        lp, _ = policy(x, torch.arange(len(ids))[None], torch.tensor(pos) - 1, x[0, pos])
        loss = loss - sign * lp.mean()
    loss.backward()
    grads = {n: p.grad.sign() for n, p in model.named_parameters() if p.grad is not None}
    originals = {n: p.detach().clone() for n, p in model.named_parameters() if n in grads}
    out = {"model": args.model, "probe_tokens": len(probe) - 1,
           "bf16_noise_rms": rms([a - b for a, b in zip(old16, old32)]),
           "bf16_noise_max": max(abs(a - b) for a, b in zip(old16, old32)), "steps": []}
    for lr in lrs:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in grads:
                    p.copy_(originals[n] - lr * grads[n])
        new32, new16 = both()
        u = [a - b for a, b in zip(new32, old32)]
        row = {"lr": lr, "update_rms": rms(u), "update_max": max(abs(x) for x in u),
               "bf16_change_error_rms": rms([(a - b) - c for a, b, c in zip(new16, old16, u)])}
        for name, served, before in (("new_served_baseline", new16, ServedBefore(old16)),
                                     ("old_served_baseline", old16, ServedBefore(old16)),
                                     ("new_served_no_baseline", new16, None),
                                     ("old_served_no_baseline", old16, None),
                                     ("new_served_float32_no_baseline", new32, None)):
            dtype = "float32" if "float32" in name else "bfloat16"
            v = probe_verdict(served, new32, old32, dtype, before)
            row[name] = {"state": v.state, "alpha": v.alpha, "separation": v.separation, "noise": v.noise}
        out["steps"].append(row)
        print(json.dumps(row))
    out["seconds"] = time.perf_counter() - t0
    print(f"bf16 noise rms {out['bf16_noise_rms']:.4f} (max {out['bf16_noise_max']:.4f}) over {out['probe_tokens']} probe tokens")
    path = Path(args.out or REPO / "benchmarks" / "results" / f"push_margin-{Path(args.model).name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
