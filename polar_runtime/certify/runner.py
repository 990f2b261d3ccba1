"""One certify cell (a harness on a model), live: rollout, trajectories, one GRPO step, push, rollout.

The run is the loop's own machinery, driven step by step (``LocalPlacement``: vLLM, or the running
server ``--upstream`` names; the proxy in front of it with every flow saved; the harness in its
sandbox through the rollout runner; the persistent trainer; ``push_weights``), so what certify
judges is what ``polar loop`` would train on:

1. rollout 0: the built-in ``followups`` tasks (the harness writes files with its tools, then is
   started again on two later user turns), ``samples`` each, exact history on;
2. trajectories as the loop builds them (prefix merge, rewards attached);
3. logprob agreement: the trainer's float32 pass over them at the served weights;
4. one GRPO step on them, with rewards spread inside each group (a delivery test: the update must
   be visible on the canary probe, not useful), and a push;
5. the served canary probe, then rollout 1 (one sample of one task): every call after the push
   must carry the new version;
6. the offline checks over rollout 0's captures (``checks.py``).

Against ``--upstream`` the server is attached to, never started, stopped or restarted (a push that
cannot reload in place fails instead of restarting someone else's server), and its base weights are
reloaded at the end. A cell's directory keeps the run (captures, flows, trajectories, checkpoint);
its ``certify.json`` is written last, so a cell with one is done and a rerun skips it, and an
interrupted cell reuses the samples that finished (the rollout runner's result store).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import platform
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from polar_runtime.loop.config import LoopConfig

from . import checks as C
from .delivery import check_logprob_agreement, check_policy_delivery, served_verdict

CELL_FILE = "certify.json"
#: built-in tasks: tools (write a file, make a directory), then later user turns on the same conversation
TASKS = "followups"
#: per task: a GRPO group needs two samples for a reward spread; three give a harness that makes no
#: tool calls (a random-weight model) 6 sessions x 2 follow-up turns = 12 re-sent answers, over the
#: exact-history check's minimum of 10 (2 samples gave 8: NOT EXERCISED)
SAMPLES = 3
#: the delivery step's learning rate: the canary must move well above the serving noise (tiny-qwen in
#: float32: separation 369 noise units at 1e-5 against 37 at 1e-6, benchmarks/history/push-margin.md)
DELIVERY_LR = 1e-5
ORDER = ("capture", "exact history", "mask", "logprob agreement", "sampling", "tool calls", "reasoning",
         "policy delivery")


def cell_name(harness: str, model: str) -> str:
    safe = lambda s: "".join(c if c.isalnum() or c in "._-" else "-" for c in s)  # noqa: E731
    return f"{safe(harness)}__{safe(Path(model).name if '/' in model else model)}"


def certify_config(base: LoopConfig, harness: str | None, model: str | None, out: Path, *, samples: int = SAMPLES,
                   task_ids: list[str] | None = None) -> LoopConfig:
    """``base``'s [model], [harness], [sandbox] and [sampling] keys with certify's own tasks, samples
    and one delivery step (``samples``, ``task_ids``: fewer, for a quick cell in the tests)."""
    import copy

    cfg = copy.deepcopy(base)
    if harness:
        cfg.harness.name = harness
    if model:
        cfg.model.name = model
    cfg.out = str(out)
    cfg.harness.exact_history = True
    cfg.tasks.source, cfg.tasks.ids, cfg.tasks.limit = TASKS, list(task_ids or []), 0
    cfg.rollout.samples_per_group, cfg.rollout.groups_per_step, cfg.rollout.iterations = samples, 0, 1
    cfg.trainer.lr, cfg.trainer.lora_rank, cfg.trainer.kl_coef = DELIVERY_LR, 0, 0.0
    cfg.eval.every = 0
    return cfg


def spread_rewards(frame: Any) -> Any:
    """The delivery step's rewards: 1 for every other sample of a group, 0 for the rest, every sample
    counted as finished, so that every group has a reward spread and the step changes the weights."""
    import polars as pl

    order = (frame.select("group_id", "session_id").unique().sort("group_id", "session_id")
             .with_columns(_r=(pl.int_range(pl.len()).over("group_id") % 2).cast(pl.Float64)))
    return (frame.drop("reward").join(order, on=["group_id", "session_id"], how="left")
            .rename({"_r": "reward"}).with_columns(status=pl.lit("ok")).select(frame.columns))


def delivery_pair(frame: Any) -> Any:
    """The delivery step's training set: the first two samples (rewards 1 and 0 after
    ``spread_rewards``) of the first group that has two. A step that moves the weights is all
    policy delivery needs; training every sequence made a Codex x 0.5B cell take an hour (12
    sequences of ~5.5k tokens: a 1,965 s step on our 2-core CPU), where a pair takes a sixth of it.
    A frame with no such group is returned whole (its step then has no spread, and says so)."""
    import polars as pl

    spread = spread_rewards(frame)
    sessions = (spread.select("group_id", "session_id").unique().sort("group_id", "session_id")
                .with_columns(_n=pl.int_range(pl.len()).over("group_id"), _size=pl.len().over("group_id")))
    pair = sessions.filter((pl.col("_size") >= 2) & (pl.col("_n") < 2))
    if pair.is_empty():
        return spread
    first = pair["group_id"][0]
    keep = pair.filter(pl.col("group_id") == first).select("session_id")
    return spread.join(keep, on="session_id", how="semi")


class _NoRestart:
    """A server someone else runs, as push_weights sees it: reload in place, never restart."""

    def __init__(self, server: Any) -> None:
        self._server, self.base_url = server, server.base_url

    def reload_weights(self, model_dir: str) -> float:
        return self._server.reload_weights(model_dir)


def rows_of_step(captures: Path, step: int) -> list[dict[str, Any]]:
    """The rollout runner's rows of ``step`` (``rollouts.parquet``, written before the loop judges them)."""
    import polars as pl

    from polar_analysis.rewards import ROLLOUTS_FILE

    path = Path(captures) / ROLLOUTS_FILE
    return pl.read_parquet(path).filter(pl.col("step") == step).to_dicts() if path.is_file() else []


def judged_rollout(placement: Any, step: int, ids: list[str], version: int, run: dict[str, Any],
                   note_key: str) -> list[dict[str, Any]]:
    """``placement.rollout``, where every sample failing is no end of the cell: the loop refuses a
    step with nothing to learn from (``LoopError``), but certify judges the calls the samples made
    (Claude Code ends a sample in an error after four answers cut at ``max_tokens``, having made
    its calls, under the pushed version too). Raises only when no sample made a call; the loop's
    reason goes into ``run[note_key]``."""
    from polar_runtime.loop.groups import LoopError

    try:
        return placement.rollout(step, ids, version)
    except LoopError as exc:
        rows = rows_of_step(placement.captures, step)
        if not sum(int(r.get("calls") or 0) for r in rows):
            raise
        run[note_key] = str(exc)
        return rows


def vllm_version(base_url: str) -> str | None:
    from polar_core.net import http_json

    with contextlib.suppress(OSError, ValueError, KeyError):
        return str(http_json(f"{base_url}/version", timeout=10)["version"])
    return None


def harness_version(name: str) -> str | None:
    from polar_runtime import harnesses as h

    with contextlib.suppress(KeyError):
        preset = h.get_preset(name)
        if preset.package:
            pkg = h.PACKAGES[preset.package]
            return f"{pkg.npm}@{pkg.version}"
    return None


def calls_after_push(proxy_url: str, control: Any, model: str, n: int = 3) -> None:
    """``n`` plain chat calls through the proxy under a rollout-step-1 session of their own (registered
    with the proxy, which serves registered sessions only): the quick stand-in for the harness's
    rollout after the push (the tests' cell; a real cell runs the harness)."""
    from polar_core.net import http_request
    from polar_runtime.rollout import SessionRegistry

    sid = "certify-after-push.st1.s0"
    key = SessionRegistry(control).register(sid, "certify-after-push", "certify-after-push.st1", 0)
    for i in range(n):
        body = {"model": model, "messages": [{"role": "user", "content": f"Say ok ({i})."}], "max_tokens": 4}
        status, raw = http_request(f"{proxy_url}/v1/chat/completions", body, timeout=300,
                                   headers={"authorization": f"Bearer {key}", "x-polar-session": sid})
        if status != 200:
            raise RuntimeError(f"a call after the push answered {status}: {raw[:200]!r}")


def run_cell(cfg: LoopConfig, out: Path, upstream: str | None = None, log: Callable[[str], None] = print,
             harness_after_push: bool = True) -> dict[str, Any]:
    """Run one cell in ``out`` and write ``out/certify.json``; returns the report. ``harness_after_push``
    False: the calls after the push are plain chat calls through the proxy, not a harness run (tests)."""
    import polars as pl

    from polar_analysis import frames
    from polar_analysis.steps import versions_of_step
    from polar_runtime.loop.placement import LocalPlacement
    from polar_training.push_probe import PushError
    from polar_training.weights_push import push_weights

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if upstream:
        cfg.trainer.server_during_train = "keep"  # someone else's server is never stopped
    placement = LocalPlacement(cfg, out, upstream=upstream)
    report: dict[str, Any] = {
        "harness": cfg.harness.name, "model": cfg.model.name, "harness_version": harness_version(cfg.harness.name),
        "vllm_version": None, "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {'GPU' if cfg.on_gpu else 'CPU'}", "upstream": upstream,
        "tasks": TASKS, "samples_per_task": cfg.rollout.samples_per_group, "error": None, "phases": {}, "run": {},
        "sampling": {"temperature": cfg.sampling.temperature, "seed": cfg.sampling.seed,
                     "max_tokens": cfg.resolved_max_tokens()}, "timeout_s": cfg.resolved_timeout(),
    }
    results: dict[str, C.CheckResult] = {}
    frame = None
    sessions: list[str] = []
    version, push_error, verdict, later, train_note = None, None, None, [], None
    gap, gap_error, dtype = None, None, "float32"

    def phase(name: str, started: float) -> None:
        report["phases"][name] = round(time.monotonic() - started, 1)

    try:
        t = time.monotonic()
        placement.start(None, 0)
        phase("start", t)
        base = placement.server.base_url
        report["vllm_version"] = vllm_version(base)
        # the dtype vLLM computes in: the one `polar serve` starts it with (float32 on CPU, bf16 on a
        # GPU); a server someone else runs is asked (dev mode's /server_info, else its model's config,
        # which for a bf16 checkpoint served in float32 says bf16: measured, not graded)
        if upstream:
            with contextlib.suppress(Exception):
                from polar_training.push_probe import served_dtype

                dtype = served_dtype(base) or "float32"
        else:
            dtype = "bfloat16" if placement.server.gpu else "float32"
        report["served_dtype"] = dtype
        ids = placement.task_ids()
        t = time.monotonic()
        rows = judged_rollout(placement, 0, ids, 0, report["run"], "rollout_note")
        phase("rollout", t)
        sessions = [r["session_id"] for r in rows]
        report["run"]["samples"] = {r["session_id"]: {"status": r["status"], "calls": r["calls"], "reward": r["reward"]}
                                    for r in rows}
        t = time.monotonic()
        path, stats = placement.trajectories(0, rows)
        phase("trajectories", t)
        report["run"]["trajectories"] = {k: stats.get(k) for k in ("sequences", "sampled_tokens", "merge_kinds", "drift")}
        if path:
            frame = pl.read_parquet(path)
            t = time.monotonic()
            try:
                from polar_training.behaviour_gap import behaviour_gap

                # the loop's own token budget per packed bin (8,192 on CPU): one bin of a whole
                # rollout would hold a quadratic attention mask of all its tokens
                gap = behaviour_gap(frame, placement.serve_dir if not upstream else placement.model_dir,
                                    token_budget=max(4096, cfg.model.max_model_len // 2))
            except Exception as exc:  # noqa: BLE001 - graded as the check's failure
                gap_error = f"{type(exc).__name__}: {exc}"
            phase("logprobs", t)
            train_path = out / "trajectories" / "certify-delivery.parquet"
            delivery_pair(frame).write_parquet(train_path)
            t = time.monotonic()
            res = placement.train(0, str(train_path))
            phase("train", t)
            train_note = res.note
            if res.updated and res.checkpoint:
                version = res.policy_version
                t = time.monotonic()
                try:
                    if upstream:  # in place or not at all: someone else's server is never restarted
                        pushed = asdict(push_weights(res.checkpoint, [_NoRestart(placement.server)],
                                                     [placement.proxy.url], version))
                    else:  # the loop's own push (a server stopped while training is restarted on the weights)
                        pushed = placement.push(res.checkpoint, version)
                    report["run"]["push"] = {k: pushed.get(k) for k in ("method", "reload_s", "paused_s", "notes")}
                except (PushError, OSError, RuntimeError) as exc:
                    push_error = f"{type(exc).__name__}: {exc}"
                phase("push", t)
                with contextlib.suppress(Exception):
                    verdict = served_verdict(placement.server.base_url, res.checkpoint)
                if push_error is None:  # a failed push may leave the gate closed: nothing more to serve
                    t = time.monotonic()
                    if harness_after_push:
                        cfg.rollout.samples_per_group = 1
                        rows1 = judged_rollout(placement, 1, ids[:1], version, report["run"], "after_push_note")
                        report["run"]["after_push"] = {r["session_id"]: r["calls"] for r in rows1}
                    else:
                        calls_after_push(placement.proxy.url, placement.proxy.control, placement.served)
                        time.sleep(1.0)  # the proxy writes a record before it answers; let the file settle
                    phase("rollout after push", t)
                    calls = frames.calls(placement.captures, rewards=None).collect()
                    later = versions_of_step(calls, 1)
    except Exception as exc:  # noqa: BLE001 - any break of the run is the cell's failure, named in its report
        report["error"] = f"{type(exc).__name__}: {exc}"
        log(f"certify: {report['error']}")
        report["traceback"] = traceback.format_exc(limit=6)
    finally:
        if upstream and version is not None:  # leave the server as it was found: its base weights
            with contextlib.suppress(Exception):
                placement.server.reload_weights(placement.model_dir)
                report["run"]["restored"] = str(placement.model_dir)
        placement.close()

    t = time.monotonic()
    if sessions:
        results.update(offline_checks(placement.captures, placement.model_dir, sessions, frame, cfg.sampling.temperature))
    results["logprob agreement"] = check_logprob_agreement(gap, dtype, gap_error)
    results["policy delivery"] = check_policy_delivery(version, push_error, verdict, later, train_note)
    if verdict:
        report["run"]["canary"] = verdict
    phase("checks", t)
    for name in ORDER:
        results.setdefault(name, C.judge(name, 0, [], "the run did not get this far"))
    report["checks"] = [results[n].to_dict() for n in ORDER]
    report["wall_s"] = round(time.monotonic() - t0, 1)
    return _write(out, report)


def offline_checks(captures: Path, model_dir: Path, sessions: list[str], frame: Any,
                   temperature: float) -> dict[str, C.CheckResult]:
    """The checks read from what rollout 0 left on disk (its sessions' captures and flows, its
    trajectories)."""
    ev = C.Evidence.load(captures, model_dir, sessions=sessions, trajectories=frame)
    return {"capture": C.check_capture(ev), "exact history": C.check_exact_history(ev), "mask": C.check_mask(ev),
            "sampling": C.check_sampling(ev, temperature), "tool calls": C.check_tool_calls(ev),
            "reasoning": C.check_reasoning(ev)}


def regrade(out: Path) -> dict[str, Any]:
    """Grade a finished cell again from its directory (after a change to a check): the offline checks
    are recomputed from its captures and trajectories; logprob agreement and policy delivery, which
    needed the trainer and the server of the run, are kept as measured."""
    import polars as pl

    from polar_runtime.serve import resolve_model

    out = Path(out)
    report = json.loads((out / CELL_FILE).read_text())
    sessions = list((report.get("run") or {}).get("samples") or {})
    traj = out / "trajectories" / "step-0.parquet"
    frame = pl.read_parquet(traj) if traj.is_file() else None
    temperature = float((report.get("sampling") or {}).get("temperature", 1.0))
    results = {c["name"]: c for c in report["checks"]}
    if sessions:
        model_dir, _ = resolve_model(report["model"])
        for name, res in offline_checks(out / "captures", model_dir, sessions, frame, temperature).items():
            results[name] = res.to_dict()
    report["checks"] = [results[n] for n in ORDER]
    report["regraded"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    return _write(out, report)


def _write(out: Path, report: dict[str, Any]) -> dict[str, Any]:
    """Set the verdict and write ``certify.json`` atomically (last: a cell with one is done)."""
    report["verdict"] = verdict_of(report)
    tmp = out / f".{CELL_FILE}.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out / CELL_FILE)
    return report


def verdict_of(report: dict[str, Any]) -> str:
    """FAIL when the run broke or any check failed; PASS otherwise (NOT EXERCISED checks are named
    in the table, never counted as passes)."""
    if report.get("error") or any(c["state"] == C.FAIL for c in report.get("checks") or []):
        return C.FAIL
    return C.PASS
