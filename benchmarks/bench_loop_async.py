"""Synchronous vs asynchronous rollouts (max_off_policy_steps = 0, 1, 2): samples per hour, trainer
and vLLM idle fractions, token ages, drops.

NOT a real-vLLM run. The real loop (``polar_runtime.loop.run_loop``: admission control, the state
file, the idle meter) drives the loop's fake placement (tests/runtime/loop_fakes.py), whose groups,
training steps and pushes *sleep* for durations measured on a real run: the learning benchmark's
seed-0 run (benchmarks/results/learning_qwen2.5-coder-0.5b-instruct_pi-chat_seed0.json, Pi +
Qwen2.5-Coder-0.5B on this 2-core CPU box, 2 groups x 8 samples per step, 4 harness runs at once):
per step rollout 55.5, 150.8, 37.5, 30.6, 30.8, 31.8 s (one group = half of it: the groups of a
step ran one after another's samples through the same 4 slots), training 95.7 and 119.8 s, push
3.4 and 3.7 s. Time is scaled by ``--scale`` (default 0.01: 1 s slept = 100 s modelled) and scaled
back in the figures. What this leaves out: on one CPU machine the trainer and vLLM share the cores,
so running them at once slows both (here they overlap for free): the figures are the schedule's
upper bound, not a CPU measurement. One group runs at a time (``groups_in_flight = 1``), as the
measured run's 4 slots held one group's samples.

    .venv/bin/python benchmarks/bench_loop_async.py            # ~1 min; --rounds, --steps, --scale

Resumable: each (round, k) result is kept in the JSON as soon as it is measured; a rerun measures
only what is missing (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "runtime"))

from loop_fakes import FakePlacement  # noqa: E402

from polar_runtime.loop import config as c  # noqa: E402
from polar_runtime.loop.loop import run_loop  # noqa: E402

RESULT = HERE / "results" / "loop_async.json"
SOURCE = "benchmarks/results/learning_qwen2.5-coder-0.5b-instruct_pi-chat_seed0.json"
ROLLOUT_STEP_S = [55.5, 150.8, 37.5, 30.6, 30.8, 31.8]  # per step of 2 groups (measured, see the docstring)
GROUP_S = [s / 2 for s in ROLLOUT_STEP_S for _ in range(2)]
TRAIN_S = [95.7, 119.8]
PUSH_S = 3.55
SAMPLES_PER_GROUP = 8


def measure(k: int, steps: int, scale: float) -> dict:
    cfg = c.parse_config(f"[tasks]\nlimit = 2\n[rollout]\nsamples_per_group = {SAMPLES_PER_GROUP}\ngroups_per_step = 2\n"
                         f"iterations = {steps}\n[schedule]\nmax_off_policy_steps = {k}\ngroups_in_flight = 1\n")
    with tempfile.TemporaryDirectory(prefix="bench-loop-async-") as tmp:
        out = Path(tmp)
        p = FakePlacement(cfg, out)
        p.timing.update(calls=2, group_s=[g * scale for g in GROUP_S], train_s=[t * scale for t in TRAIN_S],
                        push_s=PUSH_S * scale)
        t0 = time.monotonic()
        rep = run_loop(cfg, p, out, log=lambda _m: None, metrics=False)
        wall = time.monotonic() - t0
    trained = [s for s in rep["steps"] if (s.get("train") or {}).get("updated")]
    samples = sum(s["rewards"]["samples"] for s in rep["steps"])
    t = rep["timing"]
    return {"k": k, "steps": steps, "wall_s_modelled": round(wall / scale, 1), "samples": samples,
            "trained_steps": len(trained), "samples_per_hour": round(samples / (wall / scale) * 3600, 1),
            "trainer_idle_frac": t["trainer_idle_frac"], "vllm_idle_frac": t["vllm_idle_frac"],
            "token_ages": rep["staleness_tokens"], "dropped_groups": len(rep["dropped_groups"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="training steps per run (then one measuring rollout)")
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--fresh", action="store_true")
    args = ap.parse_args()
    data = {} if args.fresh or not RESULT.exists() else json.loads(RESULT.read_text())
    settings = {"steps": args.steps, "scale": args.scale, "groups_per_step": 2, "samples_per_group": SAMPLES_PER_GROUP,
                "groups_in_flight": 1, "group_s": GROUP_S, "train_s": TRAIN_S, "push_s": PUSH_S}
    if data.get("settings") != settings:
        data = {"settings": settings, "runs": {}}
    data["what"] = ("NOT real vLLM: the real loop scheduling the loop's fake placement, whose groups, training steps "
                    f"and pushes sleep for durations measured on a real CPU run ({SOURCE}), time-scaled; trainer and "
                    "vLLM overlap for free here (on one CPU box they share the cores)")
    for r in range(args.rounds):
        for k in (0, 1, 2) if r % 2 == 0 else (2, 1, 0):  # interleaved, order alternated
            key = f"round{r}-k{k}"
            if key in data["runs"]:
                continue
            data["runs"][key] = measure(k, args.steps, args.scale)
            RESULT.parent.mkdir(parents=True, exist_ok=True)
            RESULT.write_text(json.dumps(data, indent=2))
            print(f"{key}: {data['runs'][key]}", flush=True)
    summary = {}
    print(f"\n{'k':>2} {'samples/h':>10} {'trainer idle':>13} {'vLLM idle':>10} {'wall (modelled)':>16}  token ages   dropped")
    for k in (0, 1, 2):
        runs = [v for v in data["runs"].values() if v["k"] == k]
        if not runs:
            continue
        s = {m: round(statistics.mean(v[m] for v in runs), 4) for m in
             ("samples_per_hour", "trainer_idle_frac", "vllm_idle_frac", "wall_s_modelled")}
        s.update(rounds=len(runs), token_ages=runs[-1]["token_ages"], dropped_groups=sum(v["dropped_groups"] for v in runs))
        summary[str(k)] = s
        print(f"{k:>2} {s['samples_per_hour']:>10.0f} {s['trainer_idle_frac']:>13.1%} {s['vllm_idle_frac']:>10.1%} "
              f"{s['wall_s_modelled']:>15.0f}s  {s['token_ages']}   {s['dropped_groups']}")
    data["summary"] = summary
    RESULT.write_text(json.dumps(data, indent=2))
    print(f"\n{RESULT}")


if __name__ == "__main__":
    main()
