"""Does the loop make an agent better? Base-model evaluation, N GRPO iterations, evaluation of the
trained policy on the same tasks, under a real harness against real vLLM (issue 26).

It is ``polar demo`` with an evaluation before the first update and after the last one
(``--eval-every N`` with ``--iterations N`` evaluates at step 0, on the base policy, and at step N),
run in one run directory, and then read back into:

* a table of the training reward per rollout step (mean ± standard error over its samples);
* per task, the success rate of the base and of the trained policy on held-out sampling seeds
  (evaluation sessions ``eval-<task>.st<step>.s<k>``: their per-call seeds are derived from session
  ids the training rollouts never use), each with its standard error ``sqrt(p(1-p)/(n-1))``
  (polar_analysis.passk), and the difference with ``se = sqrt(se_pre^2 + se_post^2)`` (independent
  samples) and a pooled two-proportion z;
* where an iteration's time goes: rollout decode (vLLM's time on the calls, from the captures),
  harness start-up and tool time (the rest of each run's wall time), timeouts, training, push;
* samples per hour and sampled tokens per second of the rollouts, against vLLM's own decode rate on
  the same calls (first streamed byte to last, per call) and, with ``--decode-probe``, of vLLM alone;
* ``benchmarks/results/learning_<name>.json`` and a plot ``learning_<name>.png`` beside it.

**Resumable.** The run directory keeps every finished sample (``polar demo --keep``): the base
evaluation, the rollouts and the final evaluation are not redone after an interruption (a session
ends, ``timeout`` stops it). The trainer is recomputed: its state is the deterministic result of
the samples it trains on, and a final checkpoint left by a cut run would otherwise be resumed and
trained on again, so ``<run>/train`` is removed before a run that did not finish. A finished run
(``report.json`` with the same settings) is only scored again.

    .venv/bin/python benchmarks/bench_learning.py --seed 0          # the experiment of benchmarks/history/learning.md
    .venv/bin/python benchmarks/bench_learning.py --seed 1          # the second seed
    .venv/bin/python benchmarks/bench_learning.py --seed 0 --score-only   # read back a cut run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
TASKS = "benchmarks/tasks/learning.jsonl"
EVAL_PREFIX = "eval-"
#: the demo's settings that decide what a sample is: a run directory is reused only under the same
SETTINGS = ("model", "harness", "tasks", "task", "samples", "iterations", "eval_samples", "seed", "max_tokens",
            "timeout", "lr", "lora_rank", "kl_coef", "max_model_len")


# ---------------------------------------------------------------------------------------------
# statistics (pure: tests/runtime/test_bench_learning.py)


def rate(passed: int, n: int) -> tuple[float | None, float | None]:
    """Success rate and its standard error sqrt(p(1-p)/(n-1)) (passk's jackknife for pass@1)."""
    if n == 0:
        return None, None
    p = passed / n
    return p, (math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None)


def compare(pre: tuple[int, int], post: tuple[int, int]) -> dict[str, Any]:
    """(passed, graded) before and after: both rates with standard errors, the difference with its
    standard error (independent samples) and difference / se, and the pooled two-proportion z (which
    stays defined when both rates are 0 or 1 on one side: sqrt(p(1-p)/(n-1)) is 0 there)."""
    (c0, n0), (c1, n1) = pre, post
    p0, se0 = rate(c0, n0)
    p1, se1 = rate(c1, n1)
    out: dict[str, Any] = {"pre": {"passed": c0, "graded": n0, "rate": p0, "se": se0},
                           "post": {"passed": c1, "graded": n1, "rate": p1, "se": se1},
                           "diff": None, "diff_se": None, "diff_over_se": None, "z_pooled": None}
    if p0 is None or p1 is None:
        return out
    out["diff"] = p1 - p0
    if se0 is not None and se1 is not None:
        out["diff_se"] = math.sqrt(se0 ** 2 + se1 ** 2)
        out["diff_over_se"] = out["diff"] / out["diff_se"] if out["diff_se"] > 0 else None
    pool = (c0 + c1) / (n0 + n1)
    denom = math.sqrt(pool * (1 - pool) * (1 / n0 + 1 / n1))
    out["z_pooled"] = out["diff"] / denom if denom > 0 else None
    return out


def graded(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(passed, graded, infrastructure failures) of rollouts rows, by polar_runtime.evaluation.outcome
    (a timeout, a crash or no verdict is left out of n)."""
    from polar_runtime.evaluation import outcome

    oks = [outcome(r)[0] for r in rows]
    return sum(1 for o in oks if o), sum(1 for o in oks if o is not None), sum(1 for o in oks if o is None)


def evaluation_table(eval_rows: list[dict[str, Any]], pre_step: int, post_step: int) -> dict[str, Any]:
    """Per task and over tasks: pre (step ``pre_step``) against post (``post_step``)."""
    tasks = sorted({str(r["task_id"]).removeprefix(EVAL_PREFIX) for r in eval_rows})
    per: dict[str, Any] = {}
    tot = [0, 0, 0, 0]
    for t in tasks:
        mine = [r for r in eval_rows if str(r["task_id"]).removeprefix(EVAL_PREFIX) == t]
        c0, n0, i0 = graded([r for r in mine if r["step"] == pre_step])
        c1, n1, i1 = graded([r for r in mine if r["step"] == post_step])
        per[t] = compare((c0, n0), (c1, n1)) | {"infra_pre": i0, "infra_post": i1}
        tot = [tot[0] + c0, tot[1] + n0, tot[2] + c1, tot[3] + n1]
    return {"tasks": per, "pooled": compare((tot[0], tot[1]), (tot[2], tot[3]))}


def reward_curve(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean reward per training rollout step with its standard error and spread (a null reward, an
    evaluator without verdict, counts as 0 here: the figure is what the trainer was shown)."""
    out = []
    for step in sorted({r["step"] for r in rows}):
        vals = [float(r["reward"] or 0.0) for r in rows if r["step"] == step]
        n = len(vals)
        mean = sum(vals) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else None
        out.append({"step": step, "samples": n, "mean": mean, "sd": sd, "se": sd / math.sqrt(n) if sd is not None else None,
                    "timeouts": sum(1 for r in rows if r["step"] == step and r["status"] == "timeout")})
    return out


def call_times(sessions_dir: Path) -> dict[str, dict[str, float]]:
    """Per session: vLLM's time on its calls (request sent upstream -> last byte), the streamed part
    (first byte -> last byte: vLLM streams the role chunk before the prefill, so it holds the prefill
    too), the calls and their sampled tokens, from the proxy's captures."""
    from polar_core.schema import read_capture_lines

    out: dict[str, dict[str, float]] = {}
    for f in sorted(sessions_dir.glob("*.jsonl")):
        for rec in read_capture_lines(f, expand=False):
            if rec.get("record_type") != "call" or rec.get("status") != "ok":
                continue
            s = out.setdefault(rec["session_id"], {"calls": 0, "upstream_s": 0.0, "decode_s": 0.0, "tokens": 0})
            sent, first, end = rec.get("t_upstream_sent"), rec.get("t_upstream_first_byte"), rec.get("t_upstream_end")
            s["calls"] += 1
            s["tokens"] += int(rec.get("completion_tokens") or 0)
            if sent and end:
                s["upstream_s"] += end - sent
            if first and end:
                s["decode_s"] += end - first
    return out


def time_split(rows: list[dict[str, Any]], calls: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Where the samples' time went, summed over samples (harness-seconds): vLLM on the calls, the
    harness around them (start-up, tools, the verifier's own seconds apart), and the runs that hit
    the time limit; with the sampled tokens and vLLM's decode rate on these calls."""
    ok = [r for r in rows if r["status"] != "timeout"]
    to = [r for r in rows if r["status"] == "timeout"]
    up = sum(calls.get(r["session_id"], {}).get("upstream_s", 0.0) for r in ok)
    dec = sum(calls.get(r["session_id"], {}).get("decode_s", 0.0) for r in rows)
    toks = sum(calls.get(r["session_id"], {}).get("tokens", 0) for r in rows)
    wall_ok = sum(float(r["wall_s"] or 0.0) for r in ok)
    return {"samples": len(rows), "harness_s": round(wall_ok + sum(float(r["wall_s"] or 0.0) for r in to), 1),
            "vllm_s": round(up, 1), "harness_overhead_s": round(max(wall_ok - up, 0.0), 1),
            "timeout_s": round(sum(float(r["wall_s"] or 0.0) for r in to), 1), "timeouts": len(to),
            "verifier_s": round(sum(float(r.get("eval_s") or 0.0) for r in rows), 1),
            "overhead_per_sample_s": round(max(wall_ok - up, 0.0) / len(ok), 2) if ok else None,
            "sampled_tokens": int(toks), "vllm_decode_tok_s": round(toks / dec, 1) if dec else None}


PHASE = re.compile(r"^(\w+(?: \d+)?) done in ([\d.]+) s")


def phase_times(logs: list[Path]) -> dict[str, float]:
    """Seconds per demo phase (``rollout 0``, ``eval 0``, ``train 0``, ``push 0``, ...) from the demo's
    console logs; a phase that ran again in a resumed run is summed (its time was spent)."""
    out: dict[str, float] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            m = PHASE.match(line.strip())
            if m:
                out[m[1]] = round(out.get(m[1], 0.0) + float(m[2]), 1)
    return out


def per_iteration(phases: dict[str, float], iterations: int) -> list[dict[str, Any]]:
    return [{"iteration": i, **{k: phases.get(f"{k} {i}") for k in ("rollout", "trajectories", "eval", "train", "push")}}
            for i in range(iterations + 1)]


# ---------------------------------------------------------------------------------------------
# the run


def tools_model(model: str) -> str:
    """The model to serve: ``model`` itself when its chat template renders tools, else (SmolLM2-135M's
    ChatML template ignores them, and vLLM then refuses every harness call with tools: "auto tool
    choice requires --enable-auto-tool-choice") an untied copy of it (in-place reloads, as the demo
    serves) under ``<models>/.servable/<name>-tools`` with Qwen2.5's ChatML template, which renders the
    harness's tools in the system message and its ``<tool_call>`` blocks: the same special tokens,
    the same weights."""
    from polar_core import paths
    from polar_runtime.serve import resolve_model, template_supports_tools
    from polar_training.checkpoint import servable_copy

    src, name = resolve_model(model)
    if template_supports_tools(src):
        return model
    out = paths.models_dir() / ".servable" / f"{name}-tools"
    if not (out / "chat_template.jinja").exists() or not template_supports_tools(out):
        copy = servable_copy(src, out)
        if copy == src:  # untied already: a directory of links to it
            out.mkdir(parents=True, exist_ok=True)
            for f in src.iterdir():
                if f.name != "chat_template.jinja" and not (out / f.name).exists():
                    (out / f.name).symlink_to(f)
        qwen, _ = resolve_model("qwen2.5-coder-0.5b-instruct")
        own = (src / "chat_template.jinja").read_text() if (src / "chat_template.jinja").exists() else ""
        m = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", own, re.S)
        template = (qwen / "chat_template.jinja").read_text()
        if m:  # the model's own default system prompt, not Qwen's
            template = template.replace("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", m[1])
        (out / "chat_template.jinja").write_text(template)
    return str(out)


def demo_argv(a: argparse.Namespace, run: Path) -> list[str]:
    argv = [str(REPO / ".venv" / "bin" / "polar"), "demo", "--out", str(run), "--harness", a.harness, "--model", a.model,
            "--tasks", a.tasks, "--n-tasks", "0", "--samples", str(a.samples), "--iterations", str(a.iterations),
            "--eval-every", str(a.iterations), "--eval-samples", str(a.eval_samples), "--seed", str(a.seed),
            "--max-tokens", str(a.max_tokens), "--timeout", str(a.timeout), "--concurrency", str(a.concurrency),
            "--lr", str(a.lr), "--lora-rank", str(a.lora_rank), "--max-model-len", str(a.max_model_len),
            "--no-notebooks", "--keep"]
    if a.kl_coef is not None:
        argv += ["--kl-coef", str(a.kl_coef)]
    for t in a.task or []:
        argv += ["--task", t]
    return argv


def prepare_resume(run: Path, settings: dict[str, Any]) -> str:
    """'done' (a finished run under these settings), 'resume' (a cut one: its samples are reused,
    its trainer state removed) or 'new'; other settings in ``run`` are refused."""
    path = run / "bench-settings.json"
    if path.exists():
        before = json.loads(path.read_text())
        if before != settings:
            diff = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
            raise SystemExit(f"{run} holds a run with other settings {diff} (was, now): use another --run-dir")
        if (run / "report.json").exists():
            return "done"
        shutil.rmtree(run / "train", ignore_errors=True)  # recomputed from the reused samples
        (run / "loop-state.json").unlink(missing_ok=True)  # the demo's loop starts at step 0 again, on them
        (run / "report.json").unlink(missing_ok=True)
        return "resume"
    run.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2))
    return "new"


def run_demo(argv: list[str], log: Path) -> int:
    """The demo as a child, its output to the terminal and to ``log``; SIGTERM/SIGINT reach it (it
    stops what it started) and the scoring below still runs on what finished."""
    env = dict(os.environ, COLUMNS="160")
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, env=env, text=True)

        def forward(sig: int, _frame: Any) -> None:
            proc.send_signal(sig)

        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                fh.write(line)
                fh.flush()
            return proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def decode_probe(model: str, max_model_len: int, concurrency: int, tokens: int = 128) -> dict[str, Any]:
    """vLLM alone on the same model: ``concurrency`` requests of ``tokens`` sampled tokens each
    (ignore_eos), one warm-up first; sampled tokens per second of the batch."""
    import concurrent.futures as cf
    import urllib.request

    from polar_core.net import OPENER
    from polar_runtime.serve import VLLMServer

    def ask(url: str, name: str) -> int:
        body = {"model": name, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": tokens,
                "temperature": 1.0, "ignore_eos": True}
        req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"})
        with OPENER.open(req, timeout=600) as r:
            return int(json.loads(r.read())["usage"]["completion_tokens"])

    with VLLMServer(model, max_model_len=max_model_len, kv_cache_gib=1.0) as server:
        name = server.served_model_name
        ask(server.base_url, name)
        out = {}
        for c in sorted({1, concurrency}):
            t0 = time.monotonic()
            with cf.ThreadPoolExecutor(c) as ex:
                n = sum(ex.map(lambda _: ask(server.base_url, name), range(c)))
            out[f"concurrency_{c}_tok_s"] = round(n / (time.monotonic() - t0), 1)
        out["start_s"] = server.start_seconds
    return out


# ---------------------------------------------------------------------------------------------
# the report


def analyse(run: Path, a: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    import polars as pl

    eval_pq, roll_pq = run / "eval" / "rollouts.parquet", run / "captures" / "rollouts.parquet"
    eval_rows = pl.read_parquet(eval_pq).to_dicts() if eval_pq.exists() else []
    rows = pl.read_parquet(roll_pq).to_dicts() if roll_pq.exists() else []
    calls = call_times(run / "captures" / "sessions")
    phases = phase_times(sorted(run.glob("bench-demo-*.log")))
    iters = per_iteration(phases, a.iterations)
    roll_s = sum(v for k, v in phases.items() if k.split(" ")[0] in ("rollout", "eval"))
    all_rows = rows + eval_rows
    split = time_split(all_rows, calls)
    report = json.loads((run / "report.json").read_text()) if (run / "report.json").exists() else None
    res: dict[str, Any] = {
        "settings": settings, "run_dir": str(run), "finished": report is not None,
        "command": " ".join(["benchmarks/bench_learning.py", *sys.argv[1:]]),
        "evaluation": evaluation_table(eval_rows, 0, a.iterations) if eval_rows else None,
        "reward_curve": reward_curve(rows) if rows else [],
        "phases": phases, "per_iteration": iters, "time_split": split,
        "throughput": {"samples": len(all_rows), "rollout_and_eval_s": round(roll_s, 1),
                       "samples_per_hour": round(len(all_rows) / roll_s * 3600, 1) if roll_s else None,
                       "sampled_tok_s": round(split["sampled_tokens"] / roll_s, 2) if roll_s else None},
        "training": [{k: t.get(k) for k in ("iteration", "step", "skipped", "note", "groups_with_variance", "peak_rss_gib")}
                     | {"loss": (t.get("metrics") or {}).get("loss"), "push_s": (t.get("push") or {}).get("reload_s")}
                     for t in (report or {}).get("training", [])],
        "load_avg": os.getloadavg(),
    }
    return res


def print_tables(res: dict[str, Any]) -> None:
    def f(v: Any, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    print("\nreward per rollout step (training rollouts; mean ± se, sd)")
    print("| step | samples | mean reward | sd | timeouts |\n|---:|---:|---:|---:|---:|")
    for r in res["reward_curve"]:
        print(f"| {r['step']} | {r['samples']} | {f(r['mean'])} ± {f(r['se'])} | {f(r['sd'])} | {r['timeouts']} |")
    ev = res["evaluation"]
    if ev:
        print("\nsuccess rate on held-out seeds, base (step 0) vs trained (last step)")
        print("| task | pre | post | diff ± se | diff / se | z (pooled) | infra pre/post |\n|---|---:|---:|---:|---:|---:|---:|")
        for t, c in [*ev["tasks"].items(), ("**all tasks (pooled)**", ev["pooled"])]:
            pre, post = c["pre"], c["post"]
            infra = f"{c.get('infra_pre', '')}/{c.get('infra_post', '')}" if "infra_pre" in c else ""
            print(f"| {t} | {f(pre['rate'])} ± {f(pre['se'])} ({pre['passed']}/{pre['graded']}) | "
                  f"{f(post['rate'])} ± {f(post['se'])} ({post['passed']}/{post['graded']}) | {f(c['diff'])} ± {f(c['diff_se'])} | "
                  f"{f(c['diff_over_se'], 1)} | {f(c['z_pooled'], 1)} | {infra} |")
    print("\nseconds per iteration (demo phases)")
    print("| iteration | rollout | trajectories | eval | train | push |\n|---:|---:|---:|---:|---:|---:|")
    for it in res["per_iteration"]:
        print(f"| {it['iteration']} | " + " | ".join(f(it[k], 1) for k in ("rollout", "trajectories", "eval", "train", "push")) + " |")
    s, t = res["time_split"], res["throughput"]
    print(f"\nharness-seconds over {s['samples']} samples: vLLM {s['vllm_s']}, harness around the calls {s['harness_overhead_s']} "
          f"({s['overhead_per_sample_s']} s per sample), timed-out runs {s['timeout_s']} ({s['timeouts']}), verifier {s['verifier_s']}")
    print(f"throughput: {t['samples_per_hour']} samples/hour, {t['sampled_tok_s']} sampled tok/s over the rollout and eval phases; "
          f"vLLM on these calls {s['vllm_decode_tok_s']} sampled tok/s per call stream (first streamed byte -> last: "
          "vLLM streams its first byte before the prefill, so this includes the prompt's prefill)"
          + (f"; vLLM alone {res['decode_probe']}" if res.get("decode_probe") else ""))


def plot(res: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    curve = res["reward_curve"]
    if curve:
        ax1.errorbar([c["step"] for c in curve], [c["mean"] for c in curve], yerr=[c["se"] or 0 for c in curve],
                     marker="o", capsize=4, label="training rollouts (mean ± se)")
        ax1.fill_between([c["step"] for c in curve], [c["mean"] - (c["sd"] or 0) for c in curve],
                         [c["mean"] + (c["sd"] or 0) for c in curve], alpha=0.15, label="± sd")
    ax1.set(xlabel="rollout step (policy version)", ylabel="reward", ylim=(-0.05, 1.05), title="reward per iteration")
    ax1.legend(fontsize=8)
    ev = res["evaluation"]
    if ev:
        names = [*ev["tasks"], "pooled"]
        cs = [*ev["tasks"].values(), ev["pooled"]]
        x = range(len(names))
        for off, side, color in ((-0.15, "pre", "tab:gray"), (0.15, "post", "tab:green")):
            nan = float("nan")  # a side not measured (a cut run) is not drawn, rather than drawn at 0
            ax2.errorbar([i + off for i in x], [nan if c[side]["rate"] is None else c[side]["rate"] for c in cs],
                         yerr=[c[side]["se"] or 0 for c in cs],
                         fmt="o", capsize=4, color=color, label=f"{side} (rate ± se)")
        ax2.set_xticks(list(x), [n + ("" if c["diff_over_se"] is None else f"\n{c['diff_over_se']:+.1f} se")
                                 for n, c in zip(names, cs)], fontsize=8)
    ax2.set(ylabel="success rate (held-out seeds)", ylim=(-0.05, 1.05), title="base vs trained policy")
    ax2.legend(fontsize=8)
    s = res["settings"]
    fig.suptitle(f"{s['harness']} + {s['model']} on vLLM, seed {s['seed']}, lr {s['lr']:g}, "
                 f"{s['samples']} samples/group, {s['eval_samples']} eval samples/task", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="the demo's seed base (sampling seeds of every call)")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8, help="samples per task per training step (one GRPO group)")
    ap.add_argument("--eval-samples", type=int, default=32, help="samples per task of each evaluation")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--harness", default="pi-chat")
    ap.add_argument("--tasks", default=TASKS)
    ap.add_argument("--task", action="append", help="only these task ids (repeatable; default: every task of --tasks)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--kl-coef", type=float, default=None)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--run-dir", type=Path, default=None, help="default runs/learning-<model>-<harness>-seed<seed>")
    ap.add_argument("--name", default=None, help="results name (default <model>_<harness>_seed<seed>)")
    ap.add_argument("--score-only", action="store_true", help="read back what the run directory holds; run nothing")
    ap.add_argument("--own-template", action="store_true", help="serve --model with its own chat template even when "
                    "it does not render tools (see tools_model)")
    ap.add_argument("--decode-probe", action="store_true", help="also time vLLM alone on the model (one more server start)")
    a = ap.parse_args()
    if a.iterations < 1 or a.eval_samples < 2:
        ap.error("--iterations must be >= 1 and --eval-samples >= 2")
    run = (a.run_dir or REPO / "runs" / f"learning-{a.model}-{a.harness}-seed{a.seed}").resolve()
    name = a.name or f"{a.model}_{a.harness}_seed{a.seed}"
    settings = {k: getattr(a, k) for k in SETTINGS}
    if not a.score_only and not a.own_template:
        a.model = tools_model(a.model)
        print(f"serving {a.model}")
    rc = 0
    if not a.score_only:
        state = prepare_resume(run, settings)
        print(f"run directory {run}: {state}")
        if state != "done":
            n = len(list(run.glob("bench-demo-*.log")))
            rc = run_demo(demo_argv(a, run), run / f"bench-demo-{n}.log")
    res = analyse(run, a, settings)
    if a.decode_probe:
        res["decode_probe"] = decode_probe(a.model, a.max_model_len, a.concurrency)
    res["demo_exit"] = rc
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"learning_{name}.json"
    out.write_text(json.dumps(res, indent=2, default=str))
    plot(res, out.with_suffix(".png"))
    print_tables(res)
    print(f"\nwrote {out} and {out.with_suffix('.png')}" + ("" if res["finished"] else
          " (a partial run: the same command resumes it)"))
    return 0 if rc == 0 else rc


if __name__ == "__main__":
    sys.exit(main())
