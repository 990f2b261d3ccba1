"""The trainer in the users' setting, on one GPU (issue 25, item 8): run by ``scripts/gpu_check.sh``.

Checks, in one process next to one vLLM (CUDA, bf16, ``--weight-transfer-config {"backend": "ipc"}``):

1. parity: the trainer's bf16 logprobs of a probe sequence (the base model) against vLLM's
   ``prompt_logprobs`` for the same ids (max and mean |difference|);
2. one full fine-tuning step (``TrainSession``, bf16 mixed precision) whose weights go to vLLM
   through the weight-transfer API (CUDA IPC, ``polar_training.weight_transfer``), verified by the
   push check (``weights_push.verify_served``: within the bf16 tolerance of the new prediction,
   and moved from the old one to the new one);
3. one LoRA step, its adapters merged, pushed and verified the same way; the logprob gap of each.

Prints a JSON summary (also written to ``$OUT/gpu_check.json`` when ``$OUT`` is set, else
``benchmarks/results/gpu_check.json``). Exit 1 when a check fails. Needs ``scripts/setup.sh`` done
on the GPU machine (the CUDA vLLM venv, the models).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def batch(path: Path, vocab: int, tokens: int = 1024, seed: int = 0) -> None:
    import polars as pl

    rng = random.Random(seed)
    rows = []
    for i in range(4):
        ids = [rng.randrange(1000, vocab - 1000) for _ in range(tokens // 4)]
        prompt = len(ids) // 3
        rows.append({"trajectory_id": f"s{i}/0", "session_id": f"s{i}", "group_id": "g", "input_ids": ids,
                     "loss_mask": [0] * prompt + [1] * (len(ids) - prompt),
                     "logprobs": [0.0] * prompt + [-11.0] * (len(ids) - prompt), "reward": float(i % 2), "status": "ok"})
    pl.DataFrame(rows).write_parquet(path)


def main() -> int:
    import polars as pl
    import torch

    from polar_runtime import models
    from polar_runtime.loop.phases import servable_dir
    from polar_runtime.serve import VLLMServer
    from polar_training import checkpoint as ckpt
    from polar_training import weight_transfer as wt
    from polar_training.config import LossConfig, TrainConfig
    from polar_training.lora import LoraSettings, merged_state_dict
    from polar_training.session import TrainSession
    from polar_training.weights_push import PushError, served_probe_logprobs, verify_served

    if not torch.cuda.is_available():
        print("no CUDA device visible to the main venv's torch: nothing to check here", file=sys.stderr)
        return 2
    os.environ.update(wt.SERVER_ENV)
    t_start = time.perf_counter()
    model_dir = models.ensure_model(models.QWEN05)
    serve = servable_dir(model_dir, print)
    work = Path(tempfile.mkdtemp(prefix="polar-gpu-check-"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    traj = work / "batch.parquet"
    batch(traj, vocab)
    summary: dict = {"device": torch.cuda.get_device_name(0), "checks": {}}
    ok = True

    def check(name: str, passed: bool, **facts) -> None:
        nonlocal ok
        ok &= passed
        summary["checks"][name] = {"passed": passed, **facts}
        print(f"{'PASS' if passed else 'FAIL'} {name}: {json.dumps(facts, default=str)}", flush=True)

    server = VLLMServer(serve, served_model_name="gpu-check", max_model_len=4096, gpu=True,
                        extra_args=("--gpu-memory-utilization", "0.3", *wt.SERVER_ARGS), log_path=work / "vllm.log")
    with server:
        summary["vllm_start_s"] = server.start_seconds
        init = True
        for label, lora in (("full", None), ("lora", LoraSettings(rank=16, alpha=32))):
            cfg = TrainConfig(lr=1e-5 if lora is None else 1e-4, token_budget=4096, compute_dtype="bfloat16",
                              loss=LossConfig(kl_coef=0.0))
            torch.cuda.reset_peak_memory_stats()
            session = TrainSession(model_dir, work / label, cfg, lora=lora, handoff_root=work / f"handoff-{label}")
            probe_ids = [int(x) for x in pl.read_parquet(traj)["input_ids"][0][:48]]
            trainer_before = ckpt.probe_logprobs(session.trainer.policy, probe_ids)
            served_before = served_probe_logprobs(server.base_url, probe_ids)
            gap = [abs(a - b) for a, b in zip(trainer_before, served_before)]
            if label == "full":
                check("parity: trainer bf16 vs vLLM bf16 on the base model", max(gap) < 0.3,
                      max_abs=max(gap), mean_abs=sum(gap) / len(gap))
            t0 = time.perf_counter()
            out = session.step([str(traj)])  # writes the handoff too: its probe is what the push check reads
            step_s = time.perf_counter() - t0
            sd = merged_state_dict(session.trainer.model) if lora else session.trainer.model.state_dict()
            sd = wt.served_names(sd, ckpt.is_tied(session.trainer.model))
            try:
                send_s = wt.send_weights_ipc(server.base_url, sd.items(), version=out.step, init=init)
                init = False
                worst = verify_served(server.base_url, out.handoff)
                served_after = served_probe_logprobs(server.base_url, probe_ids)
                new = ckpt.read_meta(out.handoff)["probe"]["logprobs"]
                gap_after = [abs(a - b) for a, b in zip(new, served_after)]
                check(f"{label} step pushed by CUDA IPC and verified", True, step_s=step_s, send_s=send_s,
                      probe_max_abs=worst, gap_mean_abs=sum(gap_after) / len(gap_after),
                      peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30,
                      trainable_params=sum(p.numel() for p in session.trainer.model.parameters() if p.requires_grad))
            except (PushError, wt.WeightTransferError, OSError) as exc:
                check(f"{label} step pushed by CUDA IPC and verified", False, error=f"{type(exc).__name__}: {exc}")
            session.close(checkpoint=False)
            del session, sd
            torch.cuda.empty_cache()
    summary["total_s"] = time.perf_counter() - t_start
    summary["passed"] = ok
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    target = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"
    target.mkdir(parents=True, exist_ok=True)
    (target / "gpu_check.json").write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
