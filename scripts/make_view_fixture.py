"""Make a small run directory for the viewer's tests (tests/fixtures/view-run), or a big one for its
benchmark: synthetic calls with a real tokenizer and chat template, the loop's own trajectory
builder and records, and a real GRPO step of the trainer on tiny-qwen with its per-token record.

    .venv/bin/python scripts/make_view_fixture.py tests/fixtures/view-run
    .venv/bin/python scripts/make_view_fixture.py /tmp/big --samples 1000 --calls 20 --no-train

What is synthetic: the calls (``polar_analysis.synthetic``: prompts rendered with tiny-qwen's Qwen2.5
template, answers tokenized, behaviour logprobs made up by ``fake_logprobs``), the rollout rows,
the harness logs and the saved flows (mitmproxy flows written with its ``FlowWriter``, metadata as
the proxy writes it). What is real: the prefix-merged trajectories and drift (the loop's
``build_trajectories``), the loop's state and report (``LoopState``, ``build_report``,
``metrics_row``) and, unless ``--no-train``, one GRPO step of ``GRPOTrainer`` on tiny-qwen with
``TokenRecorder`` (so trainer logprobs are tiny-qwen's, far from the made-up behaviour ones).

The small run (2 steps x 2 samples of one task; step 0 trained) carries what the tests look for:
sample ``make-note.st0.s0`` re-sends its history with another system prompt before its third call,
so that call starts a new segment (the known split, cause ``system_changed``); its tool result and
its answer carry HTML and script; sample ``make-note.st0.s1`` has a failed call.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TASK = "make-note"
SYSTEM = "You are a coding agent. Use the tools to change files."
TOOLS = [{"type": "function", "function": {"name": "write", "description": "Write a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                         "required": ["path", "content"]}}}]
#: what a hostile tool result and answer look like: the page must show them as text, run nothing
TOOL_HTML = 'wrote notes.md <script>window.__pwned = "tool"</script><img src=x onerror="window.__pwned=\'img\'">'
ANSWER_HTML = ('Done. </script><script>window.__pwned = "answer"</script> <b>bold?</b> '
               '<!-- comment --> & \u2028 line separator')


def _session(renderer, sid: str, k: int, step: int, policy: int, t0: float, hostile: bool, split: bool,
             fail: bool, extra_calls: int, odd: bool = False):
    from polar_analysis.synthetic import SyntheticSession

    s = SyntheticSession(renderer, sid, system=SYSTEM, tools=TOOLS, task_id=TASK, group_id=f"{TASK}.st{step}",
                         sample_index=k, policy_version=policy, t0=t0, harness="openai-sdk-js")
    s.user("Write notes.md with a one-line summary of the project.")
    r = s.generate(tool_calls=[("write", {"path": "notes.md", "content": "Polar: token-faithful RL."})])
    s.tool(TOOL_HTML if hostile else "wrote notes.md", r.output_tool_calls[0]["id"])
    if fail:
        s.generate(status="error", echo=False)  # the upstream failed once; the harness retried
    s.generate(content=ANSWER_HTML if hostile else "Done: notes.md written.")
    for j in range(extra_calls):  # more turns: a tool call and its answer each (a last odd one: an answer)
        s.user(f"Add line {j} to notes.md.")
        if j == extra_calls - 1 and odd:
            s.generate(content=f"Line {j} is already there.")
            break
        r = s.generate(tool_calls=[("write", {"path": "notes.md", "content": f"line {j}"})])
        s.tool("wrote notes.md", r.output_tool_calls[0]["id"])
        s.generate(content=f"Added line {j}.")
    if split:
        s.user("Now add a title.")
        s.messages[0]["content"] = SYSTEM + " Today is Monday."  # the harness re-sends another system prompt
        s.generate(content="Added the title.")
    return s.records


def _flows(records, path: Path) -> None:
    """One saved flow per call, as the proxy's flow file holds them (request = the harness's body)."""
    from mitmproxy import http, io
    from mitmproxy.test import tflow

    from polar_core.flowmeta import pack_tokens

    with open(path, "wb") as fh:
        w = io.FlowWriter(fh)
        for rec in records:
            f = tflow.tflow(resp=True)
            body = json.dumps(rec.native_request).encode()
            f.request = http.Request.make("POST", "http://127.0.0.1:8080/v1/chat/completions", body,
                                          {"content-type": "application/json", "user-agent": "OpenAI/JS 5.0",
                                           "authorization": "Bearer sk-polar-session-secret"})
            f.request.timestamp_start = f.request.timestamp_end = rec.t_request_in
            answer = {"id": "chatcmpl-" + rec.call_id[:8], "object": "chat.completion", "model": rec.requested_model,
                      "choices": [{"index": 0, "finish_reason": rec.finish_reason,
                                   "message": {"role": "assistant", "content": rec.output_text,
                                               "tool_calls": [{"id": c["id"], "type": "function",
                                                               "function": {"name": c["name"], "arguments": c["arguments"]}}
                                                              for c in rec.output_tool_calls] or None}}]}
            f.response = http.Response.make(rec.http_status, json.dumps(answer).encode(), {"content-type": "application/json"})
            f.response.timestamp_start = f.response.timestamp_end = rec.t_response_out
            f.metadata["polar"] = {"session": rec.session_id, "call_index": rec.call_index, "call_id": rec.call_id,
                                   "provider": rec.provider, "status": rec.status, "finish_reason": rec.finish_reason,
                                   "policy_version": rec.policy_version,
                                   "tokens": pack_tokens(rec.prompt_token_ids, rec.sampled_token_ids, rec.sampled_logprobs),
                                   "capture_file": f"sessions/{rec.session_id}.jsonl"}
            w.add(f)


def make_run(out: Path, model_dir: Path, samples: int = 2, steps: int = 2, calls: int = 2, train: bool = True,
             flows: bool = True) -> Path:
    import polars as pl

    from polar_analysis.alignment import ChatTemplateRenderer
    from polar_analysis.synthetic import write_capture
    from polar_runtime import rollout as r
    from polar_runtime.demo import demo_config
    from polar_runtime.loop import phases
    from polar_runtime.loop.loop import FINAL_ROLLOUT_NOTE, build_report
    from polar_runtime.loop.measures import metrics_row
    from polar_runtime.loop.state import LoopState

    work = Path(tempfile.mkdtemp(prefix="view-run-"))
    renderer = ChatTemplateRenderer(model_dir)
    cfg = demo_config(out=str(out), model="tiny-qwen", samples=samples, iterations=steps - 1, notebooks=False)
    rows, all_records, t = [], [], 1_796_000_000.0
    extra, odd = max(0, calls - 2) // 2 + max(0, calls - 2) % 2, max(0, calls - 2) % 2 == 1  # 2 calls, then pairs
    for step in range(steps):
        policy = min(step, 1)
        for k in range(samples):
            sid = f"{TASK}.st{step}.s{k}"
            recs = _session(renderer, sid, k, step, policy, t, hostile=(step, k) == (0, 0), split=(step, k) == (0, 0),
                            fail=(step, k) == (0, 1), extra_calls=extra, odd=odd)
            t += 30
            all_records += recs
            reward = 1.0 if (k + step) % 2 == 0 else 0.0
            rows.append({"task_id": TASK, "sample_index": k, "session_id": sid, "group_id": f"{TASK}.st{step}",
                         "step": step, "status": "ok", "reward": reward, "calls": sum(1 for x in recs if x.status == "ok"),
                         "prompt_tokens": sum(len(x.prompt_token_ids) for x in recs),
                         "sampled_tokens": sum(len(x.sampled_token_ids) for x in recs), "wall_s": 12.5 + k,
                         "evaluator_output": "test_notes ... " + ("PASSED" if reward else "FAILED: <title> missing & more"),
                         "evaluator_status": "pass" if reward else "fail", "eval_s": 0.4, "exit_code": 0,
                         "harness": "pi-chat", "mode": "base_url", "model": "tiny-qwen", "attempt": 0, "error": None,
                         "started_at": recs[0].t_request_in, "workdir": str(out / "captures" / "work" / sid / "work"),
                         "error_calls": sum(1 for x in recs if x.status != "ok"), "turns": 1, "sandbox": "bubblewrap",
                         "sandbox_notes": "network: the model proxy only\nmemory limit 4 GiB", "verifier_dir": None})
            logs = work / "captures" / "work" / sid / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            (logs / "pi-chat.stderr").write_text("pi: starting\n<script>window.__pwned='log'</script>\n")
    write_capture(work / "captures", all_records)
    rollouts = pl.DataFrame(rows, schema=r.ROLLOUT_SCHEMA)
    rollouts.write_parquet(work / "captures" / r.ROLLOUTS_FILE)
    if flows:
        _flows(all_records, work / "captures" / "flows.mitm")
    state = LoopState(config=cfg.to_dict(), next_step=steps, policy_version=1 if train else 0)
    metrics = []
    for step in range(steps):
        data = phases.StepData(step, rollouts.filter(pl.col("step") == step), policy=min(step, 1))
        phases.build_trajectories(work, data, model_dir)
        rec = {"step": step, "policy_version": data.policy, "groups": [TASK], "rewards": phases_rewards(data.rollouts),
               "trajectories": {**data.stats, "drift": data.drift}, "train": None, "push": None, "note": None,
               "wall_s": 60.0 + step}
        if step == steps - 1:
            rec["note"] = FINAL_ROLLOUT_NOTE
        elif train:
            t0 = time.time()
            hist = _train(work / "train", data.trajectories, model_dir)
            rec["train"] = {"updated": True, "policy_version": 1, "checkpoint": None, "metrics": hist[-1], "note": None,
                            "t_start": t0, "t_end": t0 + 20.0, "timings": {}}
            rec["push"] = {"method": "in_place", "policy_version": 1, "paused_s": 2.5, "reload_s": 2.0, "notes": []}
            rec["staleness_tokens"] = {"0": int(data.stats["sampled_tokens"])}
            rec["groups_with_variance"] = [TASK]
        state.steps.append(rec)
        busy = {"trainer_busy_s": 20.0 * (step + 1), "vllm_busy_s": 35.0 * (step + 1)}
        wall = 60.0 * (step + 1) + step
        state.timing = {"wall_s": wall, **busy, "overlap_s": 0.0, "trainer_idle_frac": round(1 - busy["trainer_busy_s"] / wall, 4),
                        "vllm_idle_frac": round(1 - busy["vllm_busy_s"] / wall, 4)}
        metrics.append(metrics_row(rec, state.timing, 0))
    out.mkdir(parents=True, exist_ok=True)
    for part in ("captures/sessions", "captures/work", "trajectories", "train"):
        if (work / part).exists():
            shutil.copytree(work / part, out / part, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("tensorboard", ".*"))
    for part in ("captures/rollouts.parquet", "captures/flows.mitm"):
        if (work / part).exists():
            shutil.copyfile(work / part, out / part)
    state.save(out)
    build_report(cfg, state, out, 120.0)
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    shutil.rmtree(work, ignore_errors=True)
    return out


def phases_rewards(rows):
    from polar_runtime.loop.groups import reward_summary

    return reward_summary(rows.to_dicts())


def _train(train_dir: Path, trajectories: Path, model_dir: Path) -> list[dict]:
    import polars as pl
    import torch

    from polar_training.token_record import TokenRecorder
    from polar_training.trainer import GRPOTrainer, TrainConfig, load_model

    torch.manual_seed(0)
    cfg = TrainConfig(lr=1e-5, token_budget=8192)
    cfg.loss.kl_coef = 0.0
    trainer = GRPOTrainer(load_model(str(model_dir)), cfg)
    trainer.recorder = TokenRecorder(train_dir)
    hist = trainer.fit(pl.read_parquet(trajectories))
    train_dir.mkdir(parents=True, exist_ok=True)
    (train_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in hist))
    return hist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--samples", type=int, default=2, help="samples per step")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2, help="calls per sample (the fixture's first sample has one more: the split; its second one a failed call)")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--no-flows", action="store_true")
    args = ap.parse_args()
    from polar_core.paths import model_dir_for

    model = model_dir_for("tiny-qwen")
    if model is None:
        sys.exit("tiny-qwen is not built: polar models build")
    if args.out.exists():
        shutil.rmtree(args.out)
    make_run(args.out, model, args.samples, args.steps, args.calls, train=not args.no_train, flows=not args.no_flows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
