"""The Ray placement against the local placement on this one machine, and a simulation of many nodes.

**1. Measured (overhead, not scaling).** The same rollouts through both placements, on the same
real parts: the Polar proxy (mitmdump + addon), the rollout runner, the generic harness (``curl``,
one chat call per sample) in the default sandbox and its evaluator; the model is the scripted
vLLM-format upstream (milliseconds per call), so what is timed is what a placement adds around a
sample, and what it takes to hand the step's training sequences to the trainer (``trajectories``:
the local placement builds them after the rollout from its one capture directory, the Ray placement
on each node as each sample finishes). Local: ``LocalPlacement.rollout`` with one proxy, 4 harness runs at once. Ray: a
``ray.cluster_utils.Cluster`` (head + 2 nodes) on this machine, ``RayPlacement`` with a node agent
(and its own proxy) per node, 2 harness runs at once on each. Two simulated nodes on two shared
cores measure Ray's overhead, never scaling: both placements share the same two cores. Figures:
start-up (the cluster's own start apart from the placement's), and samples per hour over
``--rounds`` rollouts of ``--groups`` x ``--samples`` (interleaved: local, ray, local, ray, ...).

**2. Simulated (scaling).** ``polar_runtime.loop.staleness.simulate`` (the asynchronous loop's own
schedule, k = 1) on the per-group and per-step durations measured on a real CPU run (the learning
benchmark's seed 0: Pi + Qwen2.5-Coder-0.5B, groups of 8 samples, one group per node at a time,
group times 15.3-75.4 s, training 95.7/119.8 s per 2-group step, push 3.55 s), plus part 1's
measured Ray overhead per sample, with N nodes each running one group at a time. The trainer's time
per step grows with the groups it trains (linear in groups, from the measured 2-group steps); each
push reloads every replica from a weights directory on shared storage: 3.55 s measured reload plus
the N replicas' reads of the checkpoint (``--ckpt-gib``, 1.9 GiB: the 0.5B in float32) over a
shared ``--fs-gibps`` (1.0 GiB/s). It shows where samples/hour stop growing with nodes: the trainer
(or the push) is then the bottleneck. A second scenario divides the measured training time by 25
(an assumed GPU trainer, not measured) to show where the push, growing with the replicas, takes over.

    .venv/bin/python benchmarks/bench_ray_placement.py        # ~4 min; writes results/ray_placement.json
    .venv/bin/python benchmarks/bench_ray_placement.py --simulate-only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "ray_placement.json"
BODY = json.dumps({"model": "gpt-4o-mini", "temperature": 0.9, "messages": [{"role": "user", "content": "Say hi."}]})
CURL = ("curl -sSf {base_url}/v1/chat/completions -H 'authorization: Bearer {api_key}' "
        "-H 'content-type: application/json' -d @body.json")

# measured on a real CPU run (see benchmarks/bench_loop_async.py: the learning benchmark's seed 0)
GROUP_S = [27.75, 75.4, 18.75, 15.3, 15.4, 15.9]  # one group of 8 = half of each step's rollout
TRAIN_S_PER_2_GROUPS = [95.7, 119.8]
PUSH_S = 3.55
SAMPLES_PER_GROUP = 8


def _config(tmp: Path, kind: str, address: str, upstream: str, groups: int, samples: int, concurrency: int) -> Any:
    from polar_runtime.loop import config as c

    tasks = [{"id": f"t{i}", "instruction": "Say hi.", "files": {"body.json": BODY}, "evaluator": "true"}
             for i in range(groups)]
    (tmp / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    text = (f'out = "{tmp / kind}"\n[model]\nname = "tiny-qwen"\n'
            f'[harness]\nname = "generic"\ncommand = "{CURL}"\nconcurrency = {concurrency}\ntimeout_s = 120\n'
            f'[tasks]\nsource = "{tmp / "tasks.jsonl"}"\nlimit = 0\n[rollout]\nsamples_per_group = {samples}\n'
            f'[placement]\nkind = "{kind}"\naddress = "{address}"\nnode_resource = "polar_rollout"\n'
            f'replicas = ["{upstream}"]\n')
    return c.parse_config(text)


def _local(cfg: Any, out: Path, upstream: str) -> tuple[Any, float]:
    """LocalPlacement with its proxy in front of the scripted upstream (its start() would start vLLM)."""
    from polar_proxy.process import ProxyProcess
    from polar_runtime import harnesses as h
    from polar_runtime import rollout as r
    from polar_runtime.loop.placement import LocalPlacement

    from polar_runtime import models

    p = LocalPlacement(cfg, out, log=lambda _m: None)
    p.model_dir = models.ensure_model("tiny-qwen")  # the chat template its trajectories are built with
    t = time.monotonic()
    p.preset, p.served = h.get_preset("generic", cfg.harness.command), "scripted-model"
    p.tasks = {t.id: t for t in r.load_tasks(cfg.tasks.source)}
    p.proxy = ProxyProcess(upstream, out / "captures", mode="reverse", served_model="scripted-model",
                           options={"polar_require_session_key": True, "polar_exact_history": True,
                                    "polar_sampling": r.sampling_spec(1.0, None)},
                           log_file=out / "proxy.log", passthrough=False)
    out.mkdir(parents=True, exist_ok=True)
    p.stack.enter_context(p.proxy)
    p.endpoint = h.Endpoint(mode="base_url", base_url=p.proxy.url, proxy_url=p.proxy.url, ca_cert=p.proxy.ca_cert)
    return p, time.monotonic() - t


def measure(rounds: int, groups: int, samples: int) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    from polar_runtime.cluster.placement import RayPlacement
    from polar_testing.scripted_upstream import Script, ServerThread

    res: dict[str, Any] = {"local": {"rollouts": []}, "ray": {"rollouts": []}}
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as d, \
            ServerThread(served_model="scripted-model", script=Script(["text"])) as up:
        tmp = Path(d)
        t = time.monotonic()
        cl = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        for _ in range(2):
            cl.add_node(num_cpus=1, resources={"polar_rollout": 1})
        cl.wait_for_nodes()
        res["ray"]["cluster_start_s"] = round(time.monotonic() - t, 2)
        try:
            local, res["local"]["start_s"] = _local(_config(tmp, "local", "", up.url, groups, samples, 4), tmp / "local",
                                                    up.url)
            cfg = _config(tmp, "ray", cl.address, up.url, groups, samples, 2)
            rp = RayPlacement(cfg, tmp / "ray", log=lambda _m: None)
            t = time.monotonic()
            rp.start(None, 0)
            res["ray"]["start_s"] = round(time.monotonic() - t, 2)
            res["ray"]["start_parts"] = rp.timing
            ids = [f"t{i}" for i in range(groups)]
            for step in range(rounds):
                for name, p in (("local", local), ("ray", rp)):
                    t = time.monotonic()
                    rows = p.rollout(step, ids, 0)
                    t_roll = time.monotonic() - t
                    path, stats = p.trajectories(step, rows)  # what the trainer is handed, both ways
                    wall = time.monotonic() - t
                    assert len(rows) == groups * samples and all(r["status"] == "ok" for r in rows), rows[:2]
                    assert path and stats["coverage"] == 1.0, stats
                    res[name]["rollouts"].append(round(wall, 2))
                    res[name].setdefault("rollout_only", []).append(round(t_roll, 2))
                    print(f"round {step} {name}: {len(rows)} samples in {wall:.1f} s (rollout {t_roll:.1f} s, "
                          f"trajectories {wall - t_roll:.1f} s)", flush=True)
            local.close()
            rp.close()
        finally:
            ray.shutdown()
            cl.shutdown()
    n = groups * samples
    for name in ("local", "ray"):
        walls = res[name]["rollouts"]
        res[name]["samples_per_hour"] = round(3600 * n * len(walls) / sum(walls), 1)
        res[name]["s_per_sample"] = round(sum(walls) / (n * len(walls)), 3)
    res["ray_over_local_samples_per_hour"] = round(res["ray"]["samples_per_hour"] / res["local"]["samples_per_hour"], 3)
    # the overhead per sample slot: wall per sample x the harness runs at once (4 in both)
    res["ray_overhead_s_per_sample_slot"] = round(4 * (res["ray"]["s_per_sample"] - res["local"]["s_per_sample"]), 3)
    res["workload"] = {"rounds": rounds, "groups": groups, "samples_per_group": samples, "runs_at_once": 4,
                       "harness": "generic (curl, one chat call)", "upstream": "scripted vLLM-format",
                       "note": "two simulated nodes on the same two shared cores: overhead, not scaling"}
    return res


def simulate_nodes(overhead_s_per_sample: float, ckpt_gib: float, fs_gibps: float,
                   nodes: tuple[int, ...] = (1, 2, 4, 8, 16, 32), groups_per_step: tuple[int, ...] = (2, 8),
                   train_speedups: tuple[float, ...] = (1.0, 25.0)) -> list[dict]:
    """Samples/hour with N nodes (one group at a time each), k = 1. ``train_speedups``: 1 is the
    measured CPU trainer; 25 is an assumed GPU trainer (not measured here), to show where the push
    takes over as the bottleneck."""
    from polar_runtime.loop.staleness import simulate

    out = []
    group_s = [g + overhead_s_per_sample * SAMPLES_PER_GROUP / 4 for g in GROUP_S]  # 4 samples at once per node
    for speed in train_speedups:
        for gps in groups_per_step:
            train_s = sum(TRAIN_S_PER_2_GROUPS) / len(TRAIN_S_PER_2_GROUPS) * gps / 2 / speed
            for n in nodes:
                push_s = PUSH_S + n * ckpt_gib / fs_gibps
                r = simulate(1, gps, 30, group_s, train_s, push_s=push_s, slots=n)
                sph = 3600 * r.trained_groups * SAMPLES_PER_GROUP / r.wall
                capacity = 3600 * n * SAMPLES_PER_GROUP / (sum(group_s) / len(group_s))
                bound = 3600 * gps * SAMPLES_PER_GROUP / (train_s + push_s)  # one step trained and pushed at a time
                # k = 1 admits at most (k + 1) x groups_per_step groups at once: more nodes than that idle
                usable = capacity * min(n, 2 * gps) / n
                what = (("staleness bound (nodes > 2 x groups/step)" if n > 2 * gps else "rollouts") if usable < bound
                        else ("trainer" if train_s >= push_s else "push"))
                out.append({"train_speedup": speed, "nodes": n, "groups_per_step": gps, "train_s": round(train_s, 1),
                            "push_s": round(push_s, 2), "samples_per_hour": round(sph, 1),
                            "rollout_capacity_per_hour": round(capacity, 1), "train_push_bound_per_hour": round(bound, 1),
                            "trainer_idle": round(r.trainer_idle, 3), "bottleneck": what})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--ckpt-gib", type=float, default=1.9)
    ap.add_argument("--fs-gibps", type=float, default=1.0)
    ap.add_argument("--simulate-only", action="store_true", help="reuse the measured part of the result file")
    args = ap.parse_args()
    old = json.loads(RESULT.read_text()) if RESULT.is_file() else {}
    if args.simulate_only and old.get("measured"):
        measured = old["measured"]
    else:
        measured = measure(args.rounds, args.groups, args.samples)
    over = max(0.0, measured["ray_overhead_s_per_sample_slot"])
    sim = simulate_nodes(over, args.ckpt_gib, args.fs_gibps)
    res = {"date": time.strftime("%Y-%m-%d"), "load_avg": os.getloadavg(), "measured": measured,
           "simulation": {"k": 1, "ckpt_gib": args.ckpt_gib, "fs_gibps": args.fs_gibps,
                          "ray_overhead_s_per_sample": over, "rows": sim}}
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(res, indent=2))
    m = measured
    print(f"start-up: local {m['local']['start_s']} s, ray {m['ray']['start_s']} s (+ cluster {m['ray']['cluster_start_s']} s)")
    print(f"samples/h: local {m['local']['samples_per_hour']}, ray {m['ray']['samples_per_hour']} "
          f"(ray/local {m['ray_over_local_samples_per_hour']})")
    for row in sim:
        print(f"  trainer x{row['train_speedup']:<4g} groups/step {row['groups_per_step']:2d} nodes {row['nodes']:2d}: "
              f"{row['samples_per_hour']:8.1f} samples/h (rollouts could {row['rollout_capacity_per_hour']:8.1f}, "
              f"train+push allow {row['train_push_bound_per_hour']:8.1f}; bottleneck {row['bottleneck']})")


if __name__ == "__main__":
    sys.exit(main())
