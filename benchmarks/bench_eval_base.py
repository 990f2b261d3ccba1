"""The base model's evaluation on the built-in tasks: `polar eval`, written to benchmarks/results/.

Runs ``polar eval`` (vLLM started by it, the default Qwen2.5-Coder-0.5B-Instruct, the Pi harness)
on the built-in coding tasks, then copies its eval.json to ``benchmarks/results/<name>.json`` with
the machine's load and the wall time, and prints the Markdown table of benchmarks/history/eval-base.md.

Resumable: the run directory (default ``runs/bench-eval-<name>``) keeps every finished sample, so
the same command continues after an interruption, and a larger ``--samples`` adds samples to the
ones already drawn (same settings, same seeds).

    .venv/bin/python benchmarks/bench_eval_base.py --samples 4            # sampled, T=1 (the rollout's)
    .venv/bin/python benchmarks/bench_eval_base.py --greedy --samples 1   # greedy
    .venv/bin/python benchmarks/bench_eval_base.py --score-only           # score what finished (a cut run)

A run stopped early (SIGTERM, e.g. by ``timeout``) is scored on the samples that finished, and the
result says ``partial``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def table(res: dict) -> str:
    ks = res["ks"]
    head = "| task | samples | graded | passed | infra | mean reward | " + " | ".join(f"pass@{k}" for k in ks) + " |"
    lines = [head, "|---" + "|---:" * (5 + len(ks)) + "|"]

    def pm(v, se):
        return "-" if v is None else f"{v:.2f}" + (f" ± {se:.2f}" if se is not None else "")

    for t in res["tasks"]:
        mr = "-" if t["mean_reward"] is None else f"{t['mean_reward']:.2f}"
        lines.append(f"| `{t['task_id']}` | {t['samples']} | {t['graded']} | {t['passed']} | {t['infra_failures']} | {mr} | "
                     + " | ".join(pm(t["pass_at"][str(k)], t["stderr"][str(k)]) for k in ks) + " |")
    ov = res["overall"]
    lines.append(f"| **mean over tasks** | {res['samples']} | | | {res['infra_failures']['total']} | | "
                 + " | ".join(f"**{pm(ov[str(k)]['value'], ov[str(k)]['stderr'])}**" for k in ks) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--tasks", default="coding")
    ap.add_argument("--harness", default="pi-chat")
    ap.add_argument("--max-tokens", type=int, default=256, help="the demo's cap on CPU")
    ap.add_argument("--timeout", type=float, default=300.0, help="the demo's per-run limit")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--score-only", action="store_true", help="score the run directory's finished samples, run nothing")
    ap.add_argument("--name", default=None, help="result name (default eval_base_<harness>_<sampled|greedy>)")
    args = ap.parse_args()
    name = args.name or f"eval_base_{args.harness}_{'greedy' if args.greedy else 'sampled'}"
    out = REPO / "runs" / f"bench-{name}"
    cmd = [str(Path(sys.executable).with_name("polar")), "eval", "--tasks", args.tasks, "--harness", args.harness,
           "--samples", str(args.samples), "--max-tokens", str(args.max_tokens), "--timeout", str(args.timeout),
           "--concurrency", str(args.concurrency), "--out", str(out)] + (["--greedy"] if args.greedy else [])
    print(" ".join(cmd), flush=True)
    t0, load0 = time.time(), os.getloadavg()
    rc = 0
    if not args.score_only:
        (out / "eval.json").unlink(missing_ok=True)  # a cut run leaves none: score its finished samples
        proc = subprocess.Popen(cmd, cwd=REPO)
        # SIGTERM (timeout): polar eval, in our process group, stops too; score what finished
        signal.signal(signal.SIGTERM, lambda *_: None)
        rc = proc.wait()
        while rc is None:
            rc = proc.wait()
    if (out / "eval.json").exists():
        res = json.loads((out / "eval.json").read_text())
    elif (out / "rollouts.parquet").exists():
        import polars as pl

        from polar_runtime import evaluation as ev

        rows = pl.read_parquet(out / "rollouts.parquet").to_dicts()
        if not rows:
            print("no finished sample to score", file=sys.stderr)
            return rc or 1
        res = ev.score_rows(rows)
        settings = json.loads((out / ev.SETTINGS_FILE).read_text()) if (out / ev.SETTINGS_FILE).exists() else {}
        res.update(partial=True, settings=settings, finished_samples=len(rows))
    else:
        print(f"polar eval exited {rc} without a result", file=sys.stderr)
        return rc or 1
    res["bench"] = {"command": " ".join(cmd[1:]), "exit_code": rc, "wall_s_this_invocation": round(time.time() - t0, 1),
                    "loadavg_before": load0, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(),
                    "finished_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2))
    print(f"\nwrote {RESULTS / f'{name}.json'}\n")
    print(table(res))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
