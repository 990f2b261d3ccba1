"""Live: real harnesses through the proxy with exact history on, vLLM serving tiny-r1 (the real
DeepSeek-R1-Distill-Qwen tokenizer and template, random weights, vLLM's deepseek_r1 reasoning parser).

For each harness: `polar rollout --model tiny-r1 --tasks followups --samples 1 --limit 1
--exact-history` (a task with a follow-up user turn), then the captures are read back and summed:
calls, calls whose answer reached the harness (text or reasoning), history labels and their causes,
the calls whose streamed text differed from the derendered answer, weight-version mismatches, and
the trajectories rebuilt from them with the trainer-vs-vLLM ``mismatch_kl`` (``--summarize-only``
recomputes these from the captures already there, without running anything heavy).
Writes benchmarks/results/reasoning_live.json. Heavy (starts vLLM, runs npm CLIs): run it under
`flock /tmp/polar-heavy.lock` on a shared machine.

    .venv/bin/python benchmarks/bench_reasoning_live.py [--harness pi-anthropic codex] [--timeout 420]
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from polar_core.schema import read_capture_lines  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "reasoning_live.json"


def summarize(capture_dir: Path) -> dict:
    recs = [r for f in sorted((capture_dir / "sessions").glob("*.jsonl")) for r in read_capture_lines(f)]
    history = collections.Counter(str(r.get("history")).split("=")[0] for r in recs)
    causes = collections.Counter(r.get("history_cause") for r in recs if r.get("history_cause"))
    notes = [n for r in recs for n in (r.get("translation_notes") or [])]
    return {
        "calls": len(recs),
        "ok": sum(r.get("status") == "ok" for r in recs),
        "answered": sum(bool((r.get("output_text") or "").strip() or (r.get("output_reasoning") or "").strip()
                             or r.get("output_tool_calls")) for r in recs),
        "with_reasoning": sum(bool((r.get("output_reasoning") or "").strip()) for r in recs),
        "with_tool_calls": sum(bool(r.get("output_tool_calls")) for r in recs),
        "tool_results_resent": sum(any(m.get("role") == "tool" for m in (r.get("normalized_request") or {}).get("messages") or [])
                                   for r in recs),
        "sampled_ids": sum(len(r.get("sampled_token_ids") or []) for r in recs),
        "history": dict(history),
        "causes": dict(causes),
        "streamed_differs": sum("differs from the derendered" in n for n in notes),
        "weight_version_mismatch": sum(n.startswith("weight_version_mismatch") for n in notes),
    }


def trajectories(capture_dir: Path, model: str) -> dict:
    """The captures rebuilt as ``polar demo`` builds them (rows, merge stats, drift causes) and the
    trainer-vs-vLLM gap on every sampled token (``mismatch_kl``: mean of vLLM's logprob minus the
    float32 trainer's), with bench_exact_onoff's routines; tiny-r1 is small, so this is cheap."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_exact_onoff import build, mismatch

    from polar_runtime import models

    model_dir = models.ensure_model(model) if model in models.SPECS else Path(model).resolve()
    df, stats, causes = build(capture_dir, model_dir, strict=False)
    out = {"rows": df.height, "exact_merge_rate": stats.get("exact_merge_rate"), "drift_causes": causes}
    if df.height:
        out.update(mismatch(df, model_dir, token_budget=65536))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--harness", nargs="+", default=["pi-anthropic", "codex"])
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--model", default="tiny-r1",
                    help="tiny-r1, or a model directory such as tune_tiny_r1_tools.py's output (then the "
                         "results are keyed '<harness>@<dir name>' and captured under runs/reasoning-live/<dir name>/)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=None, help="the sampling temperature (default: polar rollout's)")
    ap.add_argument("--summarize-only", action="store_true",
                    help="recompute the figures from the captures already under runs/reasoning-live (light)")
    args = ap.parse_args()
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    for h in args.harness:
        tuned = args.model != "tiny-r1"
        key = f"{h}@{Path(args.model).name}" if tuned else h
        # captures stay out of git; a rerun starts afresh
        cap = ROOT / "runs" / "reasoning-live" / (f"{Path(args.model).name}/{h}" if tuned else h)
        # how the tuned model was made (tune_tiny_r1_tools.py's record), kept next to its figures
        made = Path(args.model) / "polar_tuned.json"
        tuning = {"tuning": json.loads(made.read_text())} if tuned and made.exists() else {}
        if args.summarize_only:
            row = {k: v for k, v in results.get(key, {}).items() if k in ("rc", "seconds", "output_tail")}
            row.update(summarize(cap), trajectories=trajectories(cap, args.model), **tuning)
            results[key] = row
            print(key, json.dumps(row), flush=True)
            OUT.write_text(json.dumps(results, indent=2))
            continue
        shutil.rmtree(cap, ignore_errors=True)
        t0 = time.monotonic()
        cmd = [str(ROOT / ".venv" / "bin" / "polar"), "rollout", "--model", args.model, "--harness", h,
               "--tasks", "followups", "--samples", "1", "--limit", "1", "--exact-history", "--max-tokens", str(args.max_tokens),
               "--timeout", "240", "--capture-dir", str(cap)]
        if args.temperature is not None:
            cmd += ["--temperature", str(args.temperature)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        row = {"rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1), **summarize(cap)}
        if proc.returncode:  # e.g. no sample passed (random weights): the captures are still read
            row["output_tail"] = (proc.stdout + proc.stderr)[-800:]
        if row["calls"]:
            row["trajectories"] = trajectories(cap, args.model)
        row.update(tuning)
        results[key] = row
        print(key, json.dumps(row), flush=True)
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
