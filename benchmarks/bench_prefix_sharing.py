"""One GRPO step on a real rollout batch, with and without shared-prefix packing.

    flock /tmp/polar-heavy.lock .venv/bin/python benchmarks/bench_prefix_sharing.py \\
        --trajectories runs/learning-qwen2.5-coder-0.5b-instruct-pi-chat-seed0/trajectories/step-0.parquet

A harness's samples share most of their prompt (Pi's system prompt and tools are ~1,390 of the
~1,390-1,520 tokens of a one-word answer's sequence). ``attention=position_ids`` packs the
sequences one after another, so that prefix runs forward and backward once per sample;
``attention=shared_prefix`` (training/prefix_sharing.py) runs it once per unit. Each mode runs in
its own process (peak RSS is the process's), on the same frame, float32, ``kl_coef 0``, the
demo's zero-variance filter, one optimizer step. The gradient norm before clipping must agree
(the two are the same sum). Writes ``benchmarks/results/prefix_sharing.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "prefix_sharing.json"


def one_step(trajectories: str, mode: str, model_dir: str, checkpointing: bool) -> dict:
    import polars as pl

    from polar_training.advantages import AdvantageConfig
    from polar_training.config import TrainConfig
    from polar_training.loss import LossConfig
    from polar_training.trainer import GRPOTrainer, load_model

    frame = pl.read_parquet(trajectories)
    model = load_model(model_dir)
    cfg = TrainConfig(lr=1e-6, attention=mode, token_budget=4096, gradient_checkpointing=checkpointing,
                      adv=AdvantageConfig(drop_zero_variance=True), loss=LossConfig(kl_coef=0.0))
    trainer = GRPOTrainer(model, cfg)
    prepared = trainer.prepare(frame)
    t0 = time.perf_counter()
    for mbs in prepared.minibatches:
        metrics = trainer.train_step(mbs)
    st = prepared.stats[0]
    return {"mode": mode, "step_s": round(time.perf_counter() - t0, 1),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "grad_norm": metrics["grad_norm"], "sequences": st.n_sequences, "tokens_run": st.n_tokens,
            "tokens_shared": st.n_shared_tokens, "sampled_tokens": st.n_sampled_tokens, "bins": st.n_bins}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", required=True, help="a trajectory parquet of a rollout step (polar demo's trajectories/step-N.parquet)")
    ap.add_argument("--model", default=str(Path.home() / ".cache/polar/models/qwen2.5-coder-0.5b-instruct"))
    ap.add_argument("--gradient-checkpointing", action="store_true", help="as polar demo on CPU")
    ap.add_argument("--one", choices=("position_ids", "shared_prefix"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one_step(a.trajectories, a.one, a.model, a.gradient_checkpointing)))
        return 0
    rows = []
    for mode in ("position_ids", "shared_prefix"):
        cmd = [sys.executable, __file__, "--trajectories", a.trajectories, "--model", a.model, "--one", mode]
        if a.gradient_checkpointing:
            cmd.append("--gradient-checkpointing")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    before, after = rows
    res = {"command": " ".join(["benchmarks/bench_prefix_sharing.py", *sys.argv[1:]]), "model": Path(a.model).name,
           "gradient_checkpointing": a.gradient_checkpointing, "rows": rows,
           "speedup": round(before["step_s"] / after["step_s"], 2),
           "grad_norm_rel_diff": abs(before["grad_norm"] - after["grad_norm"]) / max(abs(before["grad_norm"]), 1e-12)}
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print(f"step {before['step_s']} s -> {after['step_s']} s ({res['speedup']}x); tokens run {before['tokens_run']} -> "
          f"{after['tokens_run']}; peak RSS {before['peak_rss_gib']} -> {after['peak_rss_gib']} GiB; grad norm "
          f"relative difference {res['grad_norm_rel_diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
