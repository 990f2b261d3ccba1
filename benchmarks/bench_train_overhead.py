"""Per-step overhead of the trainer: one process per step (``python -m polar_training``, the old demo
path) against the trainer that stays up (``polar_training.session``), on a real vLLM.

    flock /tmp/polar-heavy.lock timeout 1800 .venv/bin/python benchmarks/bench_train_overhead.py

Overhead = what a step costs besides its forward/backward/optimizer work (``fit``): for the old path
the process's start, imports, model load, optimizer-state load (from the second step on),
the full checkpoint write (weights + AdamW moments), then vLLM's in-place reload from that
checkpoint; for the session, the probe, the weights-only handoff write and vLLM's reload from it.
The handoff is written twice per step, into the run directory (disk, page cache) and into
``/dev/shm`` (tmpfs), and vLLM reloads from each, so both locations are measured on the same
weights. Every reload is verified by the push check (``weights_push.verify_served``).

Then the same batches with LoRA (``--lora-rank``, 0 to skip; training/lora.py): fit time, peak
and resident memory, and for both runs the trainer-vs-vLLM logprob gap on the probe after the
reload (the merged LoRA weights against the trainer's LoRA model; the full weights against the
trainer's).

Same model, same synthetic rollout batch (``--tokens`` per step, two samples of one group),
float32 with gradient checkpointing and ``kl_coef 0`` as the demo's CPU run; ``--steps`` steps of
each path. Writes ``benchmarks/results/train_overhead.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "train_overhead.json"


def make_batch(path: Path, vocab: int, tokens: int, seed: int) -> None:
    import polars as pl

    rng = random.Random(seed)
    rows = []
    for i in range(2):
        ids = [rng.randrange(vocab) for _ in range(tokens // 2)]
        prompt = len(ids) // 3
        rows.append({"trajectory_id": f"s{seed}-{i}/0", "session_id": f"s{seed}-{i}", "group_id": f"g{seed}",
                     "input_ids": ids, "loss_mask": [0] * prompt + [1] * (len(ids) - prompt),
                     "logprobs": [0.0] * prompt + [-11.0] * (len(ids) - prompt), "reward": float(i), "status": "ok"})
    pl.DataFrame(rows).write_parquet(path)


VERIFIED: list[str] = []  # the push check's verdict on each reload


def reload_and_verify(server, directory: str) -> float:
    from polar_training.weights_push import PushError, verify_served

    t0 = time.perf_counter()
    server.reload_weights(directory)
    reload_s = time.perf_counter() - t0
    try:
        VERIFIED.append(f"{Path(directory).name}: verified, probe max |dlogp| {verify_served(server.base_url, directory):.2e}")
    except PushError as exc:
        VERIFIED.append(f"{Path(directory).name}: NOT verified: {exc}")
    print(VERIFIED[-1])
    return reload_s


def probe_gap(server, directory: str) -> dict:
    """|served - trainer| logprob over the handoff's probe (the trainer-vs-vLLM gap of these weights)."""
    from polar_training import checkpoint as ckpt
    from polar_training.weights_push import served_probe_logprobs

    probe = ckpt.read_meta(directory)["probe"]
    served = served_probe_logprobs(server.base_url, probe["ids"])
    d = [abs(a - b) for a, b in zip(served, probe["logprobs"])]
    return {"max": max(d), "mean": sum(d) / len(d)}


def old_step(model: str, traj: Path, run: Path, resume: bool) -> dict:
    """One ``python -m polar_training`` invocation as the demo ran it; wall and fit seconds."""
    from polar_training import checkpoint as ckpt

    before = sum(1 for _ in open(run / "metrics.jsonl")) if (run / "metrics.jsonl").is_file() else 0
    cmd = [sys.executable, "-m", "polar_training", "--model", model, "-t", str(traj), "-o", str(run), "--lr", "1e-6",
           "--kl-coef", "0", "--token-budget", "8192", "--dtype", "float32", "--gradient-checkpointing", "--no-progress"]
    if resume:
        cmd += ["--resume", "auto"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"polar_training failed: {proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()[before:]]
    fit = sum(r["step_time_s"] for r in rows)
    return {"wall_s": wall, "fit_s": fit, "checkpoint": str(ckpt.latest_checkpoint(run))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--lora-rank", type=int, default=16, help="then the same steps with LoRA at this rank (0: skip)")
    args = ap.parse_args()

    import torch

    from polar_runtime import models
    from polar_runtime.loop.phases import servable_dir
    from polar_runtime.serve import VLLMServer
    from polar_training.config import LossConfig, TrainConfig
    from polar_training.heap import release_freed_memory
    from polar_training.lora import LoraSettings, trainable_parameters
    from polar_training.session import TrainSession

    torch.set_num_threads(os.cpu_count() or 2)
    model_dir = models.ensure_model(args.model) if args.model in models.SPECS else Path(args.model)
    serve_dir = servable_dir(model_dir, print)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-", dir=REPO / "runs" if (REPO / "runs").is_dir() else None))
    shm = Path(tempfile.mkdtemp(prefix="polar-bench-", dir="/dev/shm")) if Path("/dev/shm").is_dir() else None
    batches = []
    for s in range(args.steps):
        p = work / f"batch-{s}.parquet"
        make_batch(p, vocab, args.tokens, s)
        batches.append(p)
    result: dict = {"model": args.model, "tokens_per_step": args.tokens, "steps": args.steps, "old": [], "session": [],
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count()}
    server = VLLMServer(serve_dir, served_model_name="bench", max_model_len=2048, kv_cache_gib=args.kv_cache_gib,
                        log_path=work / "vllm.log")
    try:
        with server:
            print(f"vLLM ready in {server.start_seconds} s")
            # the old path: a process per step, full checkpoint, reload from it
            for s, batch in enumerate(batches):
                r = old_step(str(model_dir), batch, work / "old", resume=s > 0)
                r["reload_s"] = reload_and_verify(server, r["checkpoint"])
                r["overhead_s"] = r["wall_s"] - r["fit_s"] + r["reload_s"]
                result["old"].append(r)
                print(f"old step {s}: wall {r['wall_s']:.1f} s, fit {r['fit_s']:.1f} s, reload {r['reload_s']:.1f} s "
                      f"-> overhead {r['overhead_s']:.1f} s")
            server.reload_weights(serve_dir)  # back to the base weights for the session's first probe
            cfg = TrainConfig(lr=1e-6, token_budget=8192, gradient_checkpointing=True, loss=LossConfig(kl_coef=0.0))
            t0 = time.perf_counter()
            session = TrainSession(model_dir, work / "new", cfg, handoff_root=work / "handoff", keep_reference=False)
            result["session_load_s"] = time.perf_counter() - t0
            for s, batch in enumerate(batches):
                t0 = time.perf_counter()
                out = session.step([str(batch)])
                wall = time.perf_counter() - t0
                r = {"wall_s": wall, "fit_s": out.timings["fit_s"], "handoff_disk_s": out.timings["handoff_s"],
                     "peak_rss_gib": out.peak_rss_gib, "rss_after_gib": out.rss_gib}
                r["reload_disk_s"] = reload_and_verify(server, out.handoff)
                r["logprob_gap"] = probe_gap(server, out.handoff)
                if shm is not None:
                    session.handoff_root = shm
                    t1 = time.perf_counter()
                    shm_dir = session.write_handoff()
                    r["handoff_shm_s"] = time.perf_counter() - t1
                    r["reload_shm_s"] = reload_and_verify(server, str(shm_dir))
                    session.remove_handoff()
                    session.handoff_root = work / "handoff"
                r["overhead_disk_s"] = wall - r["fit_s"] + r["reload_disk_s"]
                if "handoff_shm_s" in r:
                    r["overhead_shm_s"] = wall - r["fit_s"] - r["handoff_disk_s"] + r["handoff_shm_s"] + r["reload_shm_s"]
                result["session"].append(r)
                print(f"session step {s}: wall {wall:.1f} s, fit {r['fit_s']:.1f} s, handoff disk "
                      f"{r['handoff_disk_s']:.1f} s / shm {r.get('handoff_shm_s', float('nan')):.1f} s, reload disk "
                      f"{r['reload_disk_s']:.1f} s / shm {r.get('reload_shm_s', float('nan')):.1f} s")
            t0 = time.perf_counter()
            session.close()
            result["session_final_checkpoint_s"] = time.perf_counter() - t0
            del session
            release_freed_memory()
            # LoRA on the same batches: the adapters trained, merged into the handoff, same reload and check
            if args.lora_rank:
                server.reload_weights(serve_dir)
                settings = LoraSettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
                t0 = time.perf_counter()
                lsession = TrainSession(model_dir, work / "lora", cfg, handoff_root=work / "handoff-lora",
                                        keep_reference=False, lora=settings)
                result["lora"] = {"rank": args.lora_rank, "alpha": settings.alpha, "load_s": time.perf_counter() - t0,
                                  "trainable_params": trainable_parameters(lsession.trainer.model), "steps": []}
                for s, batch in enumerate(batches):
                    t0 = time.perf_counter()
                    out = lsession.step([str(batch)])
                    r = {"wall_s": time.perf_counter() - t0, "fit_s": out.timings["fit_s"],
                         "handoff_disk_s": out.timings["handoff_s"], "peak_rss_gib": out.peak_rss_gib,
                         "rss_after_gib": out.rss_gib}
                    r["reload_disk_s"] = reload_and_verify(server, out.handoff)
                    r["logprob_gap"] = probe_gap(server, out.handoff)
                    result["lora"]["steps"].append(r)
                    print(f"LoRA step {s}: fit {r['fit_s']:.1f} s, peak RSS {r['peak_rss_gib']:.1f} GiB, resident after "
                          f"{r['rss_after_gib']:.1f} GiB, handoff {r['handoff_disk_s']:.1f} s, reload {r['reload_disk_s']:.1f} s, "
                          f"gap max {r['logprob_gap']['max']:.2e}")
                lsession.close(checkpoint=False)
    finally:
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    result["push_check"] = VERIFIED
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"per-step overhead, {args.model} float32 CPU, {args.tokens} tokens per step (seconds)")
    for c in ("path", "step", "wall", "fit", "handoff / checkpoint write", "vLLM reload", "overhead"):
        t.add_column(c, justify="left" if c == "path" else "right")
    for s, r in enumerate(result["old"]):
        t.add_row("process per step", str(s), f"{r['wall_s']:.1f}", f"{r['fit_s']:.1f}", "(in wall)", f"{r['reload_s']:.1f}",
                  f"{r['overhead_s']:.1f}")
    for s, r in enumerate(result["session"]):
        t.add_row("session, disk", str(s), f"{r['wall_s']:.1f}", f"{r['fit_s']:.1f}", f"{r['handoff_disk_s']:.1f}",
                  f"{r['reload_disk_s']:.1f}", f"{r['overhead_disk_s']:.1f}")
        if "overhead_shm_s" in r:
            t.add_row("session, /dev/shm", str(s), "", "", f"{r['handoff_shm_s']:.1f}", f"{r['reload_shm_s']:.1f}",
                      f"{r['overhead_shm_s']:.1f}")
    Console(width=140).print(t)
    t = Table(title="full fine-tuning vs LoRA, same batches (float32 CPU)")
    for c in ("run", "step", "fit s", "peak RSS GiB", "resident after GiB", "handoff s", "reload s", "gap max", "gap mean"):
        t.add_column(c, justify="left" if c == "run" else "right")
    runs = [("full", result["session"])] + ([(f"LoRA r{result['lora']['rank']}", result["lora"]["steps"])] if "lora" in result else [])
    for name, rows in runs:
        for s, r in enumerate(rows):
            t.add_row(name, str(s), f"{r['fit_s']:.1f}", f"{r['peak_rss_gib']:.2f}", f"{r['rss_after_gib']:.2f}",
                      f"{r['handoff_disk_s']:.1f}", f"{r['reload_disk_s']:.1f}", f"{r['logprob_gap']['max']:.2e}",
                      f"{r['logprob_gap']['mean']:.2e}")
    Console(width=140).print(t)
    print(f"session start (once): {result['session_load_s']:.1f} s; final checkpoint (once): "
          f"{result['session_final_checkpoint_s']:.1f} s; results in {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
