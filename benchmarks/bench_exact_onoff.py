"""Exact history on vs off, side by side on the same tasks: what the trainer gets.

Two rollouts of the same tasks, samples and sampling seeds through ``polar rollout`` against one
vLLM server, one with the proxy's ``polar_exact_history`` and one without. For each, the step's
sessions are rebuilt the way ``polar demo`` builds them (prefix merge, the served model's template
facts, rewards attached), in the default and the ``--strict`` builder, and the float32 trainer does
one no-grad pass over the default batch (``fill_old_logprobs``, exactly what the first GRPO update
compares vLLM's logprobs with). Printed per mode:

- merges and their kinds, exact-merge rate, drift causes;
- sequences per session and tokens per training step (all sequence tokens: the prompt prefix a
  ``--strict`` sequence repeats is paid again in every forward/backward);
- ``mismatch_kl`` (mean of vLLM's logprob minus the trainer's, per sampled token) and the largest
  per-token gap, over all tokens and over later turns only (calls after the first of a sequence);
- mean reward and its spread.

    python benchmarks/bench_exact_onoff.py                  # 0.5B, Pi, 2 built-in tasks x 4 samples
    python benchmarks/bench_exact_onoff.py --upstream http://127.0.0.1:8000   # a running `polar serve`
    python benchmarks/bench_exact_onoff.py --reuse          # rebuild and measure the last rollouts
    python benchmarks/bench_exact_onoff.py --model tiny-qwen --harness codex --tasks followups \
        --samples 2 --max-tokens 64 --out runs/onoff-codex-followups
        # a long-prompt harness on tiny-qwen: a model with random weights answers in text, so only
        # follow-up turns (the harness resumed on the next instruction) make it re-send its history

Runs ``polar rollout`` as a child process (exactly the CLI a user runs), so figures include nothing
the product does not do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {"on": "--exact-history", "off": "--no-exact-history"}


def rollout(out: Path, upstream: str, args: argparse.Namespace, mode: str) -> float:
    """One ``polar rollout`` of the tasks in ``mode``; returns its wall time."""
    polar = Path(sys.executable).with_name("polar")
    cmd = [str(polar), "rollout", "--harness", args.harness, "--tasks", args.tasks, "--limit", str(args.limit),
           "--samples", str(args.samples), "--concurrency", str(args.concurrency), "--upstream", upstream,
           "--capture-dir", str(out / mode), "--max-tokens", str(args.max_tokens), "--temperature", "1.0",
           "--seed", str(args.seed), "--timeout", str(args.timeout), MODES[mode]]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if proc.returncode == 1:  # every sample failed or timed out: its calls are still captured and compared
        print(f"note: polar rollout ({mode}) had no sample that ended ok; its captures are measured all the same")
    elif proc.returncode != 0:
        raise SystemExit(f"polar rollout ({mode}) exited with {proc.returncode}")
    return time.monotonic() - t0


def build(captures: Path, model_dir: Path, strict: bool) -> tuple[Any, dict[str, Any], dict[str, int]]:
    """Trajectories of one capture dir as ``polar demo`` builds them, their stats and drift causes."""
    import polars as pl

    from polar_analysis import alignment, drift, frames, rewards
    from polar_analysis.trajectories import common, prefix_merge

    lf = frames.calls(captures, rewards=None)
    template = alignment.template_info_for(alignment.get_renderer(model_dir), lf)
    df, stats = prefix_merge.build(lf, template=template, strict=strict)
    df = common.attach_rewards(df, rewards.load_rewards(captures / rewards.ROLLOUTS_FILE))
    counts = drift.summarize(drift.drift_report(lf, template)).filter(pl.col("calls") > 0)
    d = stats.as_dict() | {"exact_merge_rate": stats.exact_merge_rate, "coverage": stats.coverage}
    return df, d, dict(zip(counts["cause"].to_list(), counts["calls"].to_list()))


def mismatch(frame: Any, model_dir: Path, token_budget: int) -> dict[str, float]:
    """vLLM's logprobs against the float32 trainer's on every sampled token of ``frame``, overall
    and on later turns: ``polar_training.behaviour_gap`` (the one definition ``polar certify`` uses too)."""
    from polar_training.behaviour_gap import behaviour_gap

    return behaviour_gap(frame, model_dir, token_budget=token_budget)


def rewards_of(captures: Path) -> list[float]:
    import polars as pl

    from polar_analysis import rewards

    table = rewards.load_rewards(captures / rewards.ROLLOUTS_FILE)
    table = table.collect() if isinstance(table, pl.LazyFrame) else table
    return [float(r) for r in table.filter(pl.col("reward").is_not_null())["reward"].to_list()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench-exact-onoff"))
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--harness", default="pi-chat")
    ap.add_argument("--tasks", default="coding")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--upstream", help="a running vLLM (started with --enable-scale-out) serving --model")
    ap.add_argument("--reuse", action="store_true", help="measure the rollouts already under --out")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                    help="run only these modes' rollouts (the other's captures already under --out/<mode>, "
                         "e.g. step 0 of a `polar demo` run with the same settings)")
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--threads", type=int, help="vLLM's CPU threads (default: one per core)")
    args = ap.parse_args()

    from polar_runtime.serve import VLLMServer, resolve_model

    out = args.out.resolve()
    model_dir, _ = resolve_model(args.model)
    walls: dict[str, float] = {}
    if not args.reuse:
        for mode in args.modes:
            if (out / mode).exists():
                subprocess.run(["rm", "-rf", str(out / mode)], check=True)
        if args.upstream:
            for mode in args.modes:
                walls[mode] = rollout(out, args.upstream, args, mode)
        else:
            with VLLMServer(args.model, max_model_len=args.max_model_len, log_path=out / "vllm.log",
                            threads=args.threads) as server:
                for mode in args.modes:
                    walls[mode] = rollout(out, server.base_url, args, mode)

    results: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        captures = out / mode
        df, stats, causes = build(captures, model_dir, strict=False)
        _, strict, _ = build(captures, model_dir, strict=True)
        r = rewards_of(captures)
        results[mode] = {
            "rollout_s": walls.get(mode),
            "calls": stats["calls"], "sessions": stats["sessions"], "merges": stats["merges"],
            "merge_kinds": stats["merge_kinds"], "exact_merge_rate": stats["exact_merge_rate"],
            "drift_causes": causes, "coverage": stats["coverage"],
            "sequences_per_session": stats["sequences"] / max(1, stats["sessions"]),
            "tokens_per_step": stats["sequence_tokens"], "sampled_tokens": stats["sampled_tokens"],
            "strict_sequences_per_session": strict["sequences"] / max(1, strict["sessions"]),
            "strict_tokens_per_step": strict["sequence_tokens"],
            "reward_mean": statistics.fmean(r) if r else None,
            "reward_stdev": statistics.pstdev(r) if len(r) > 1 else None, "rewarded_samples": len(r),
        } | mismatch(df, model_dir, args.token_budget)
    (out / "results.json").write_text(json.dumps(results, indent=2))

    keys = ["rollout_s", "calls", "sessions", "merges", "merge_kinds", "exact_merge_rate", "drift_causes",
            "sequences_per_session", "tokens_per_step", "sampled_tokens", "strict_sequences_per_session",
            "strict_tokens_per_step", "tokens", "mismatch_kl", "max_abs_gap", "later_tokens",
            "later_mismatch_kl", "later_max_abs_gap", "reward_mean", "reward_stdev", "rewarded_samples"]
    print(f"{'':32} {'exact on':>28} {'exact off':>28}")
    for k in keys:
        cells = []
        for mode in MODES:
            v = results[mode].get(k)
            cells.append(f"{v:.4g}" if isinstance(v, float) else json.dumps(v) if isinstance(v, dict) else str(v))
        print(f"{k:32} {cells[0]:>28} {cells[1]:>28}")
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
