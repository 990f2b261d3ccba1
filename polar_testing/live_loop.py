"""The small live loop the loop's live tests and ``benchmarks/bench_loop_live.py`` run: tiny-qwen
on vLLM CPU, Pi, one task whose evaluator passes sample 0 and fails sample 1 of a group (so that
every group has reward variance and every step updates), seconds per group and per step."""

from __future__ import annotations

import json
from pathlib import Path

#: evaluator: sample 0 of every group passes (``*.s0``), the others fail
ECHO_TASK = {"id": "echo", "instruction": "Say hello.",
             "evaluator": 'case "$POLAR_SESSION" in *.s0) exit 0;; esac; exit 1'}


def live_config(*, iterations: int, k: int | None = None, in_flight: int | None = None,
                concurrency: int | None = None) -> str:
    """The loop's TOML: ``k``/``in_flight`` set ``[schedule]`` (absent: the synchronous default)."""
    harness = "[harness]\ntimeout_s = 300\n" + (f"concurrency = {concurrency}\n" if concurrency else "")
    schedule = ""
    if k is not None:
        schedule = f"[schedule]\nmax_off_policy_steps = {k}\n" + (
            f"groups_in_flight = {in_flight}\n" if in_flight is not None else "")
    return ('out = "run"\n[model]\nname = "tiny-qwen"\nmax_model_len = 8192\n' + harness
            + '[tasks]\nsource = "tasks.jsonl"\n'
            + f"[rollout]\nsamples_per_group = 2\niterations = {iterations}\n"
            + "[sampling]\nmax_tokens = 16\n" + schedule
            + '[trainer]\nserver_during_train = "keep"\n')


def write_run_dir(d: Path, config: str, task: dict = ECHO_TASK) -> None:
    """``tasks.jsonl`` and ``loop.toml`` in ``d``, as ``polar loop loop.toml`` run there reads them."""
    (d / "tasks.jsonl").write_text(json.dumps(task) + "\n")
    (d / "loop.toml").write_text(config)
