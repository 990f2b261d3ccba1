"""Learning that carries over (issue 41): train on some tasks, evaluate base against trained on tasks
the training never saw, under a real harness against real vLLM, in the sandbox.

It is ``polar loop`` with the evaluation on another task set (``[eval] tasks``, docs/loop.md): the
loop's TOML is written into the run directory, ``polar loop`` runs it (``eval.every = iterations``:
the base policy is evaluated at step 0, the trained one after the last update) and this script reads
the run directory back, with the readers of ``bench_learning.py`` (issue 26), into:

* per eval task, base and trained success rate ± ``sqrt(p(1-p)/(n-1))``, the difference ± the root
  sum of squares, diff/se and a pooled z; pooled over every eval task and, apart, over each kind
  (``same-operation``: an operation some train task asks, other names and values; ``new-operation``:
  no train task asks it), each with the difference 2 se can resolve at its base rate (``mde_2se``);
* what changed, read from the eval sessions' captures: samples with a tool call, model calls and tool
  calls per sample, the tools called, timeouts, tokens of the final answer and of the whole sample;
* the training reward per rollout step, seconds per iteration (rollout, eval, trajectories, train,
  push), where the harness-seconds went, samples per hour: as ``learning_*.json`` reports them;
* ``benchmarks/results/transfer_<name>_seed<N>.json`` (the keys of ``learning_*.json`` plus
  ``train_tasks``, ``eval_tasks``, ``behaviour``, ``family``) and a plot beside it.

The tasks (``benchmarks/tasks/transfer/``, written by its ``generate.py``; ``manifest.json`` names
each task's operation and each eval task's kind): family ``shell`` (file-system and shell tasks,
Harbor directories, graded on the work dir) and family ``trivia`` (the cheap control: one-word
answers, graded on the final answer; train and eval questions disjoint).

**Resumable.** Everything lives in the run directory (``runs/transfer-<family>-<model>-<harness>-
seed<N>``): the loop's ``loop-state.json`` (finished steps, the checkpoint served and trained from),
the rollout runner's finished samples (training and evaluation), the settings of this script
(``bench-settings.json``: a run directory is resumed only under the same ones). The same command
resumes after a kill; a finished run is only scored again.

    .venv/bin/python benchmarks/bench_transfer.py --family shell --base-rates         # base rates, pick the band
    .venv/bin/python benchmarks/bench_transfer.py --family shell --seed 0             # one seed (then --seed 1)
    .venv/bin/python benchmarks/bench_transfer.py --family trivia --seed 0            # the control
    .venv/bin/python benchmarks/bench_transfer.py --family shell --seed 0 --dry-run   # the TOML and the cost, nothing run
    .venv/bin/python benchmarks/bench_transfer.py --smoke                             # tiny-qwen, minutes: the pipeline only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_learning as bl  # noqa: E402  (its statistics and readers: one definition of each)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
TASKS = REPO / "benchmarks" / "tasks" / "transfer"
KINDS = ("same-operation", "new-operation")
BAND = (0.2, 0.6)
#: what decides what a sample is: a run directory is resumed only under the same values
SETTINGS = ("family", "mode", "model", "harness", "train_task", "eval_task", "samples", "groups_per_step", "iterations",
            "eval_samples", "base_samples", "seed", "max_tokens", "timeout", "lr", "lora_rank", "kl_coef", "max_model_len",
            "final_rollout")
#: settings added later: a run directory written before them holds these values
LATER_SETTINGS = {"final_rollout": True}
#: per family: (max answer tokens, seconds per harness run, vLLM context): shell tasks take several
#: calls (hello-file: 5 calls, 241 sampled tokens per run, up to 53 calls in a looping run:
#: docs/tasks.md, so the demo's 16k context); a trivia answer is 2-3 tokens in one call (issue 26: 4096)
FAMILY_DEFAULTS = {"shell": (256, 150.0, 16384), "trivia": (32, 60.0, 4096)}


# ---------------------------------------------------------------------------------------------
# the task family


def manifest(family: str, root: Path = TASKS) -> dict[str, Any]:
    """The family's train and eval entries (id, operation, eval: kind) and where their tasks are."""
    fam = json.loads((root / "manifest.json").read_text())["families"][family]
    def rel(p: Path) -> str:  # relative to the checkout (polar loop runs there): a run dir moves with it
        return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)

    return {**fam, "train_source": rel(root / fam["train_dir"]), "eval_source": rel(root / fam["eval_dir"])}


def family_problems(fam: dict[str, Any], train_tasks: list[Any], eval_tasks: list[Any]) -> list[str]:
    """What makes the family unfit to measure transfer (empty: fit). ``*_tasks`` are the loaded task
    objects (``id``, ``instruction``) of the manifest's sets: every manifest entry must load, no eval
    task may repeat a train task's id or instruction, a ``new-operation`` eval task's operation must
    be absent from the train set and a ``same-operation`` one's present, at least half the eval tasks
    must be ``new-operation`` (trivia: all one operation, every eval task ``same-operation``)."""
    out = []
    for side, entries, loaded in (("train", fam["train"], train_tasks), ("eval", fam["eval"], eval_tasks)):
        ids = {t.id for t in loaded}
        out += [f"{side} task {e['id']} of the manifest does not load" for e in entries if e["id"] not in ids]
        out += [f"{side} task {i} is not in the manifest" for i in sorted(ids - {e["id"] for e in entries})]
    norm = lambda s: " ".join(str(s).split()).lower()  # noqa: E731
    train_ids, train_text = {t.id for t in train_tasks}, {norm(t.instruction): t.id for t in train_tasks}
    for t in eval_tasks:
        if t.id in train_ids:
            out.append(f"eval task {t.id} has a train task's id")
        if norm(t.instruction) in train_text:
            out.append(f"eval task {t.id} has the instruction of train task {train_text[norm(t.instruction)]}")
    train_ops = {e["operation"] for e in fam["train"]}
    for e in fam["eval"]:
        if e.get("kind") == "new-operation" and e["operation"] in train_ops:
            out.append(f"eval task {e['id']} is marked new-operation but train tasks ask {e['operation']!r}")
        elif e.get("kind") == "same-operation" and e["operation"] not in train_ops:
            out.append(f"eval task {e['id']} is marked same-operation but no train task asks {e['operation']!r}")
        elif e.get("kind") not in KINDS:
            out.append(f"eval task {e['id']} has no kind ({', '.join(KINDS)})")
    new = sum(1 for e in fam["eval"] if e.get("kind") == "new-operation")
    if len(train_ops) > 1 and 2 * new < len(fam["eval"]):
        out.append(f"only {new} of {len(fam['eval'])} eval tasks are new-operation (at least half must be)")
    return out


def load_family(fam: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    from polar_runtime.rollout import load_tasks

    return load_tasks(str(REPO / fam["train_source"])), load_tasks(str(REPO / fam["eval_source"]))


def pick(entries: list[dict[str, Any]], ids: list[str] | None, what: str) -> list[dict[str, Any]]:
    if not ids:
        return list(entries)
    known = {e["id"]: e for e in entries}
    missing = [i for i in ids if i not in known]
    if missing:
        raise SystemExit(f"no {what} task(s) {missing}; the family has {sorted(known)}")
    return [known[i] for i in ids]


def loop_toml(a: argparse.Namespace, fam: dict[str, Any], run: Path, train: list[dict], evals: list[dict]) -> str:
    """The loop configuration of this run: train on ``train``, evaluate on ``evals`` at step 0 and
    after the last update (``--base-rates``: iterations 0, both sets measured once under the base)."""
    base = a.mode == "base-rates"
    iterations = 0 if base else a.iterations
    samples = a.base_samples if base else a.samples
    eval_samples = a.base_samples if base else a.eval_samples
    q = lambda xs: "[" + ", ".join(json.dumps(x["id"]) for x in xs) + "]"  # noqa: E731
    lines = [f"out = {json.dumps(str(run))}", "notebooks = false",
             "[model]", f"name = {json.dumps(a.model)}", f"max_model_len = {a.max_model_len}",
             "[harness]", f"name = {json.dumps(a.harness)}", f"timeout_s = {a.timeout}", f"concurrency = {a.concurrency}",
             "[tasks]", f"source = {json.dumps(fam['train_source'])}", f"ids = {q(train)}", "limit = 0",
             "[rollout]", f"samples_per_group = {samples}", f"groups_per_step = {a.groups_per_step}",
             f"iterations = {iterations}",
             *([] if base or a.final_rollout else ["final_rollout = false"]),
             "[sampling]", "temperature = 1.0", f"seed = {a.seed}", f"max_tokens = {a.max_tokens}",
             "[trainer]", f"lr = {a.lr}", f"lora_rank = {a.lora_rank}"]
    if a.kl_coef is not None:
        lines.append(f"kl_coef = {a.kl_coef}")
    if a.smoke:
        lines.append('server_during_train = "keep"')
    lines += ["[eval]", f"every = {max(iterations, 1)}", f"samples = {eval_samples}",
              f"tasks = {json.dumps(fam['eval_source'])}", f"ids = {q(evals)}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# statistics (pure: tests/runtime/test_bench_transfer.py)


def resolvable(p: float | None, n: int) -> float | None:
    """The difference 2 standard errors make at base rate ``p`` with ``n`` samples a side (both
    sides' se taken at ``p``): what such an evaluation can tell from noise. None at a base rate of 0
    or 1 (its se is 0 there, and so would the figure be: the base rates are for choosing tasks away
    from both edges)."""
    if p is None or n < 2 or p in (0.0, 1.0):
        return None
    return 2 * math.sqrt(2 * p * (1 - p) / (n - 1))


def transfer_table(eval_rows: list[dict[str, Any]], pre_step: int, post_step: int,
                   kinds: dict[str, str]) -> dict[str, Any]:
    """bench_learning's evaluation table (per task, pooled) with each task's kind, and pooled per kind."""
    table = bl.evaluation_table(eval_rows, pre_step, post_step)
    by_kind: dict[str, Any] = {}
    for kind in KINDS:
        ids = [t for t in table["tasks"] if kinds.get(t) == kind]
        if not ids:
            continue
        pre = (sum(table["tasks"][t]["pre"]["passed"] for t in ids), sum(table["tasks"][t]["pre"]["graded"] for t in ids))
        post = (sum(table["tasks"][t]["post"]["passed"] for t in ids), sum(table["tasks"][t]["post"]["graded"] for t in ids))
        c = bl.compare(pre, post)
        by_kind[kind] = {"tasks": ids, "pooled": c | {"mde_2se": resolvable(c["pre"]["rate"], pre[1])}}
    for t, c in table["tasks"].items():
        c["kind"] = kinds.get(t)
    p = table["pooled"]
    p["mde_2se"] = resolvable(p["pre"]["rate"], p["pre"]["graded"])
    return table | {"by_kind": by_kind}


#: How a run that hit the harness time limit counts. ``graded`` (every table's convention, by
#: ``polar_runtime.evaluation.outcome``) leaves it out; the other two bound what that choice can do
#: to the verdict. In the full shell seed 0, 41 of 192 base and 81 of 192 trained runs timed out, so
#: the convention moves n by up to 40%.
TIMEOUT_CONVENTIONS = ("graded", "timeout_fails", "verifier_as_is")


def counted(rows: list[dict[str, Any]], convention: str) -> tuple[int, int]:
    """(passed, n) of rollouts rows under one of TIMEOUT_CONVENTIONS. Crashes and runs without a
    verdict stay out of n under all three: only the timeouts are counted differently."""
    from polar_runtime.evaluation import outcome

    passed = n = 0
    for r in rows:
        ok, cause = outcome(r)
        if cause == "timeout" and convention != "graded":  # outcome's own threshold (a reward of 1)
            ok = convention == "verifier_as_is" and (r.get("reward") or 0) >= 1.0
        if ok is not None:
            passed, n = passed + ok, n + 1
    return passed, n


def timeout_conventions(eval_rows: list[dict[str, Any]], pre_step: int, post_step: int) -> dict[str, Any]:
    """The pooled comparison over all held-out tasks under each of TIMEOUT_CONVENTIONS."""
    pre = [r for r in eval_rows if r["step"] == pre_step]
    post = [r for r in eval_rows if r["step"] == post_step]
    return {c: bl.compare(counted(pre, c), counted(post, c)) for c in TIMEOUT_CONVENTIONS}


def base_rates(rows: list[dict[str, Any]], strip: str = "") -> dict[str, Any]:
    """Per task: the base policy's success rate ± se and whether it lies in the band GRPO needs."""
    out = {}
    for t in sorted({str(r["task_id"]).removeprefix(strip) for r in rows}):
        c, n, infra = bl.graded([r for r in rows if str(r["task_id"]).removeprefix(strip) == t])
        p, se = bl.rate(c, n)
        out[t] = {"passed": c, "graded": n, "infra": infra, "rate": p, "se": se,
                  "in_band": p is not None and BAND[0] <= p <= BAND[1]}
    return out


def sample_behaviour(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One sample's behaviour from its capture records (call records, in order): model calls, tool
    calls and their names, tokens sampled in all and in the final answer (the last call's)."""
    calls = [r for r in records if r.get("record_type", "call") == "call" and r.get("status", "ok") == "ok"]
    tools: dict[str, int] = {}
    for r in calls:
        for tc in r.get("output_tool_calls") or []:
            name = str(tc.get("name") or "?")
            tools[name] = tools.get(name, 0) + 1
    return {"calls": len(calls), "tool_calls": sum(tools.values()), "tools": tools,
            "sampled_tokens": sum(int(r.get("completion_tokens") or 0) for r in calls),
            "answer_tokens": int(calls[-1].get("completion_tokens") or 0) if calls else 0}


def behaviour(rows: list[dict[str, Any]], per_session: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the samples of ``rows`` did, summed: samples with any tool call, calls and tool calls per
    sample, tools called, timeouts, mean sampled and final-answer tokens; passes among tool users."""
    n = len(rows)
    if not n:
        return {"samples": 0}
    bs = [per_session.get(r["session_id"]) or sample_behaviour([]) for r in rows]
    tools: dict[str, int] = {}
    for b in bs:
        for k, v in b["tools"].items():
            tools[k] = tools.get(k, 0) + v
    used = [r for r, b in zip(rows, bs) if b["tool_calls"] > 0]
    return {"samples": n, "tool_call_rate": sum(1 for b in bs if b["tool_calls"] > 0) / n,
            "calls_per_sample": sum(b["calls"] for b in bs) / n, "tool_calls_per_sample": sum(b["tool_calls"] for b in bs) / n,
            "tools": dict(sorted(tools.items())), "timeouts": sum(1 for r in rows if r.get("status") == "timeout"),
            "sampled_tokens_per_sample": sum(b["sampled_tokens"] for b in bs) / n,
            "answer_tokens_mean": sum(b["answer_tokens"] for b in bs) / n,
            "passed_with_tool_call": sum(1 for r in used if (r.get("reward") or 0) >= 1),
            "passed_without_tool_call": sum(1 for r, b in zip(rows, bs) if b["tool_calls"] == 0 and (r.get("reward") or 0) >= 1)}


def behaviour_table(eval_rows: list[dict[str, Any]], per_session: dict[str, dict[str, Any]], steps: dict[str, int],
                    kinds: dict[str, str]) -> dict[str, Any]:
    """Per side (``steps``: name -> rollout step), per eval task, per kind and over all tasks."""
    out: dict[str, Any] = {}
    tasks = sorted({str(r["task_id"]).removeprefix(bl.EVAL_PREFIX) for r in eval_rows})
    for side, step in steps.items():
        mine = [r for r in eval_rows if r["step"] == step]
        tid = lambda r: str(r["task_id"]).removeprefix(bl.EVAL_PREFIX)  # noqa: E731
        out[side] = {"all": behaviour(mine, per_session),
                     "kinds": {k: behaviour([r for r in mine if kinds.get(tid(r)) == k], per_session) for k in KINDS},
                     "tasks": {t: behaviour([r for r in mine if tid(r) == t], per_session) for t in tasks}}
    return out


def session_records(sessions_dir: Path, sids: set[str]) -> dict[str, dict[str, Any]]:
    """sample_behaviour of every session in ``sids``, from the proxy's captures."""
    from polar_core.schema import read_capture_lines

    recs: dict[str, list[dict[str, Any]]] = {}
    for f in sorted(sessions_dir.glob("*.jsonl")) if sessions_dir.is_dir() else []:
        for rec in read_capture_lines(f, expand=False):
            if rec.get("session_id") in sids and rec.get("record_type") == "call":
                recs.setdefault(rec["session_id"], []).append(rec)
    return {s: sample_behaviour(sorted(r, key=lambda x: x.get("call_index") or 0)) for s, r in recs.items()}


PHASE = re.compile(r"^(\w+(?: v?\d+)?) done in ([\d.]+) s")


def loop_phases(logs: list[Path]) -> dict[str, float]:
    """Seconds per loop phase (``serve``, ``rollout 0``, ``eval 0``, ``trajectories 0``, ``train 0``,
    ``push v1``, ...) from the loop's console logs; a phase run again after a resume is summed."""
    out: dict[str, float] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            m = PHASE.match(line.strip())
            if m:
                out[m[1]] = round(out.get(m[1], 0.0) + float(m[2]), 1)
    return out


def per_iteration(phases: dict[str, float], steps: list[dict[str, Any]], iterations: int) -> list[dict[str, Any]]:
    """Seconds per iteration and phase; the push from the loop's step record (its version is not the step's)."""
    push = {s["step"]: (s.get("push") or {}).get("reload_s") for s in steps}
    return [{"iteration": i, **{k: phases.get(f"{k} {i}") for k in ("rollout", "trajectories", "eval", "train")},
             "push": push.get(i)} for i in range(iterations + 1)]


def estimate(train_tasks: int, eval_tasks: int, samples: int, eval_samples: int, iterations: int, groups_per_step: int,
             samples_per_hour: float, train_s: float, start_s: float = 75.0, final_rollout: bool = True) -> dict[str, Any]:
    """Hours of one seed: rollouts ((iterations + 1) steps of the step's groups, ``iterations`` without
    the final rollout), two evaluations, ``iterations`` training steps of ``train_s`` and vLLM's start,
    at ``samples_per_hour``."""
    groups = train_tasks if groups_per_step <= 0 or groups_per_step >= train_tasks else groups_per_step
    roll = (iterations + int(final_rollout)) * groups * samples
    ev = 2 * eval_tasks * eval_samples
    hours = (roll + ev) / samples_per_hour + (iterations * train_s + start_s) / 3600
    return {"rollout_samples": roll, "eval_samples": ev, "samples_per_hour": samples_per_hour, "train_s_per_step": train_s,
            "hours": round(hours, 2)}


# ---------------------------------------------------------------------------------------------
# the run


def prepare(run: Path, settings: dict[str, Any]) -> str:
    """'done' (a finished run under these settings), 'resume' or 'new'; other settings are refused."""
    path = run / "bench-settings.json"
    if path.exists():
        before = {**LATER_SETTINGS, **json.loads(path.read_text())}
        if before != settings:
            diff = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
            raise SystemExit(f"{run} holds a run with other settings {diff} (was, now): use another --run-dir")
        report = run / "loop-report.json"
        return "done" if report.exists() and json.loads(report.read_text()).get("finished") else "resume"
    run.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2))
    return "new"


def analyse(run: Path, a: argparse.Namespace, settings: dict[str, Any], train: list[dict], evals: list[dict]) -> dict[str, Any]:
    import polars as pl

    kinds = {e["id"]: e.get("kind") for e in evals}
    eval_pq, roll_pq = run / "eval" / "rollouts.parquet", run / "captures" / "rollouts.parquet"
    eval_rows = pl.read_parquet(eval_pq).to_dicts() if eval_pq.exists() else []
    rows = pl.read_parquet(roll_pq).to_dicts() if roll_pq.exists() else []
    sessions = run / "captures" / "sessions"
    per_session = session_records(sessions, {r["session_id"] for r in eval_rows + rows})
    state = json.loads((run / "loop-state.json").read_text()) if (run / "loop-state.json").exists() else {}
    report = json.loads((run / "loop-report.json").read_text()) if (run / "loop-report.json").exists() else {}
    steps = sorted(state.get("steps") or [], key=lambda s: s["step"])
    iterations = 0 if a.mode == "base-rates" else a.iterations
    phases = loop_phases(sorted(run.glob("bench-loop-*.log")))
    roll_s = sum(v for k, v in phases.items() if k.split(" ")[0] in ("rollout", "eval"))
    all_rows = rows + eval_rows
    split = bl.time_split(all_rows, bl.call_times(sessions)) if all_rows else {}
    res: dict[str, Any] = {
        "settings": settings, "run_dir": str(run), "finished": bool(report.get("finished")),
        "command": " ".join(["benchmarks/bench_transfer.py", *sys.argv[1:]]),
        "family": a.family, "mode": a.mode,
        "train_tasks": [e | {} for e in train], "eval_tasks": [e | {} for e in evals],
        "evaluation": None, "reward_curve": bl.reward_curve(rows) if rows else [],
        "phases": phases, "per_iteration": per_iteration(phases, steps, iterations), "time_split": split,
        "throughput": {"samples": len(all_rows), "rollout_and_eval_s": round(roll_s, 1),
                       "samples_per_hour": round(len(all_rows) / roll_s * 3600, 1) if roll_s else None,
                       "sampled_tok_s": round(split.get("sampled_tokens", 0) / roll_s, 2) if roll_s else None},
        "training": [{"iteration": s["step"], "step": (s.get("train") or {}).get("policy_version"),
                      "skipped": not (s.get("train") or {}).get("updated"), "note": s.get("note"),
                      "groups_with_variance": s.get("groups_with_variance"),
                      "peak_rss_gib": ((s.get("train") or {}).get("metrics") or {}).get("peak_rss_gib"),
                      "loss": ((s.get("train") or {}).get("metrics") or {}).get("loss"),
                      "train_s": round(s["train"]["t_end"] - s["train"]["t_start"], 1) if (s.get("train") or {}).get("t_end") else None,
                      "push_s": (s.get("push") or {}).get("reload_s"), "wall_s": s.get("wall_s")}
                     for s in steps if s["step"] < iterations],
        "load_avg": os.getloadavg(),
    }
    if a.mode == "base-rates":
        res["base_rates"] = {"band": list(BAND), "train": base_rates([r for r in rows if r["step"] == 0]),
                             "eval": base_rates([r for r in eval_rows if r["step"] == 0], bl.EVAL_PREFIX)}
        res["behaviour"] = behaviour_table(eval_rows, per_session, {"base": 0}, kinds)
    elif eval_rows:
        res["evaluation"] = transfer_table(eval_rows, 0, iterations, kinds)
        # the versions the two sides were served under (equal: no update happened, nothing to compare)
        served = {s["step"]: (s.get("evaluation") or {}).get("policy_version") for s in steps}
        res["evaluation"]["policy_versions"] = {"base": served.get(0), "trained": served.get(iterations)}
        res["evaluation"]["timeout_conventions"] = timeout_conventions(eval_rows, 0, iterations)
        res["behaviour"] = behaviour_table(eval_rows, per_session, {"base": 0, "trained": iterations}, kinds)
    return res


def print_tables(res: dict[str, Any]) -> None:
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    if res.get("base_rates"):
        print(f"\nbase rates (band {BAND[0]}-{BAND[1]}: GRPO needs groups that score differently)")
        print("| set | task | kind | passed / graded | rate ± se | infra | in band |\n|---|---|---|---:|---:|---:|---|")
        kinds = {e["id"]: e.get("kind", "") for e in res["eval_tasks"]}
        for side in ("train", "eval"):
            for t, c in res["base_rates"][side].items():
                print(f"| {side} | {t} | {kinds.get(t, '') if side == 'eval' else ''} | {c['passed']}/{c['graded']} | "
                      f"{f(c['rate'])} ± {f(c['se'])} | {c['infra']} | {'yes' if c['in_band'] else 'no'} |")
    ev = res.get("evaluation")
    if ev:
        pv = ev.get("policy_versions") or {}
        print(f"\nheld-out tasks, base (step 0, v{pv.get('base')}) vs trained (last step, v{pv.get('trained')})"
              + ("  NOTE: the same policy on both sides (no update was made)" if pv.get("base") == pv.get("trained") else ""))
        print("| kind | task | base | trained | diff ± se | diff / se | z (pooled) | 2 se resolves |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|")
        rows = [(c.get("kind"), t, c) for t, c in ev["tasks"].items()]
        rows += [(k, "**pooled**", v["pooled"]) for k, v in ev["by_kind"].items()]
        rows += [("all", "**pooled**", ev["pooled"])]
        for kind, t, c in rows:
            pre, post = c["pre"], c["post"]
            print(f"| {kind} | {t} | {f(pre['rate'])} ± {f(pre['se'])} ({pre['passed']}/{pre['graded']}) | "
                  f"{f(post['rate'])} ± {f(post['se'])} ({post['passed']}/{post['graded']}) | {f(c['diff'])} ± {f(c['diff_se'])} | "
                  f"{f(c['diff_over_se'], 1)} | {f(c['z_pooled'], 1)} | {f(c.get('mde_2se'))} |")
        for conv, c in (ev.get("timeout_conventions") or {}).items():
            pre, post = c["pre"], c["post"]
            print(f"all tasks, timeouts {conv.replace('_', ' ')}: {pre['passed']}/{pre['graded']} -> "
                  f"{post['passed']}/{post['graded']}, {f(c['diff'])} ± {f(c['diff_se'])} ({f(c['diff_over_se'], 1)} se)")
    for side, b in (res.get("behaviour") or {}).items():
        a = b["all"]
        if a.get("samples"):
            print(f"behaviour, {side}: {a['samples']} samples, tool call in {a['tool_call_rate']:.0%}, "
                  f"{a['calls_per_sample']:.1f} calls and {a['tool_calls_per_sample']:.1f} tool calls per sample {a['tools']}, "
                  f"{a['timeouts']} timeouts, {a['sampled_tokens_per_sample']:.0f} sampled tokens per sample, "
                  f"final answer {a['answer_tokens_mean']:.0f} tokens")
    print("\nseconds per iteration (loop phases)")
    print("| iteration | rollout | trajectories | eval | train | push |\n|---:|---:|---:|---:|---:|---:|")
    for it in res["per_iteration"]:
        print(f"| {it['iteration']} | " + " | ".join(f(it[k], 1) for k in ("rollout", "trajectories", "eval", "train", "push")) + " |")
    t = res["throughput"]
    print(f"throughput: {t['samples_per_hour']} samples/hour over {t['samples']} samples ({t['rollout_and_eval_s']} s of rollout "
          f"and eval phases); time split {res['time_split']}")


def plot(res: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    curve = res["reward_curve"]
    if curve:
        ax1.errorbar([c["step"] for c in curve], [c["mean"] for c in curve], yerr=[c["se"] or 0 for c in curve],
                     marker="o", capsize=4, label="training rollouts (mean ± se)")
    ax1.set(xlabel="rollout step (policy version)", ylabel="reward", ylim=(-0.05, 1.05), title="training reward")
    last = max((c["step"] for c in curve), default=0)
    ax1.set_xticks(range(last + 1))  # steps, not fractions of one (a one-update run has one point)
    ax1.set_xlim(-0.5, last + 0.5)
    ax1.legend(fontsize=8)
    ev, nan = res.get("evaluation"), float("nan")
    if ev:
        # "same-op", not "same-operation": the two kinds' three-line labels overlapped at 30 degrees (seed 1)
        names = [*ev["tasks"], *(f"{k.replace('-operation', '-op')}\npooled" for k in ev["by_kind"]), "all\npooled"]
        cs = [*ev["tasks"].values(), *(v["pooled"] for v in ev["by_kind"].values()), ev["pooled"]]
        for off, side, color in ((-0.15, "pre", "tab:gray"), (0.15, "post", "tab:green")):
            ax2.errorbar([i + off for i in range(len(cs))], [nan if c[side]["rate"] is None else c[side]["rate"] for c in cs],
                         yerr=[c[side]["se"] or 0 for c in cs], fmt="o", capsize=4, color=color,
                         label={"pre": "base", "post": "trained"}[side] + " (rate ± se)")
        ax2.set_xticks(range(len(cs)), [n + ("" if c["diff_over_se"] is None else f"\n{c['diff_over_se']:+.1f} se")
                                         for n, c in zip(names, cs)], fontsize=7, rotation=30, ha="right")
    elif res.get("base_rates"):
        items = [(f"{side}:{t}", c) for side in ("train", "eval") for t, c in res["base_rates"][side].items()]
        ax2.errorbar(range(len(items)), [nan if c["rate"] is None else c["rate"] for _, c in items],
                     yerr=[c["se"] or 0 for _, c in items], fmt="o", capsize=4, label="base (rate ± se)")
        ax2.axhspan(*BAND, alpha=0.1, color="tab:green")
        ax2.set_xticks(range(len(items)), [n for n, _ in items], fontsize=6, rotation=60)
    ax2.set(ylabel="success rate", ylim=(-0.05, 1.05), title="held-out tasks: base vs trained" if ev else "base rates")
    ax2.legend(fontsize=8)
    s = res["settings"]
    fig.suptitle(f"transfer ({s['family']}): {s['harness']} + {s['model']} on vLLM, seed {s['seed']}, lr {s['lr']:g}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("shell", "trivia"), default="shell")
    ap.add_argument("--seed", type=int, default=0, help="a seed is an independent run: the base of every call's sampling seed")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8, help="samples per train task per step (one GRPO group)")
    ap.add_argument("--groups-per-step", type=int, default=0, help="train tasks per step, cycling (0: every train task)")
    ap.add_argument("--eval-samples", type=int, default=32, help="samples per eval task per side (base, trained)")
    ap.add_argument("--no-final-rollout", dest="final_rollout", action="store_false",
                    help="after the last update, evaluate only: no rollout of the train tasks (the loop's "
                         "rollout.final_rollout; saves one step of train samples, loses the trained train reward)")
    ap.add_argument("--base-rates", action="store_true", help="evaluate the base model only, --base-samples per task "
                    "of both sets (train and eval): to pick tasks in the band")
    ap.add_argument("--base-samples", type=int, default=4)
    ap.add_argument("--train-task", action="append", help="only these train tasks (repeatable)")
    ap.add_argument("--eval-task", action="append", help="only these eval tasks (repeatable)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--harness", default="pi-chat")
    ap.add_argument("--max-tokens", type=int, default=None, help="per answer (default: shell 256, trivia 32)")
    ap.add_argument("--timeout", type=float, default=None, help="per harness run, s (default: shell 150, trivia 60)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--kl-coef", type=float, default=None)
    ap.add_argument("--max-model-len", type=int, default=None, help="vLLM context (default: shell 16384, trivia 4096)")
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--name", default=None, help="results name (default <family>_<model>_<harness>)")
    ap.add_argument("--score-only", action="store_true", help="read back what the run directory holds; run nothing")
    ap.add_argument("--dry-run", action="store_true", help="print the loop's TOML, the command and the estimated cost; run nothing")
    ap.add_argument("--smoke", action="store_true", help="tiny-qwen, 1 iteration, 2 train and 2 eval tasks, 2 samples: "
                    "the pipeline end to end in minutes (results stay in the run directory)")
    ap.add_argument("--samples-per-hour", type=float, default=None, help="--dry-run's estimate (default: by family, "
                    "from the measured runs named in benchmarks/history/transfer.md)")
    a = ap.parse_args(argv)
    tok, to, ctx = FAMILY_DEFAULTS[a.family]
    a.max_tokens, a.timeout, a.max_model_len = a.max_tokens or tok, a.timeout or to, a.max_model_len or ctx
    if a.smoke:
        a.model, a.iterations, a.samples, a.eval_samples, a.base_samples = "tiny-qwen", 1, 2, 2, 2
        a.max_tokens, a.timeout, a.concurrency, a.lr = 16, 120.0, 2, 1e-5
        fam = manifest(a.family)
        a.train_task = a.train_task or [e["id"] for e in fam["train"][:2]]
        a.eval_task = a.eval_task or [next(e["id"] for e in fam["eval"] if e.get("kind") == k) for k in KINDS
                                      if any(e.get("kind") == k for e in fam["eval"])]
    a.mode = "base-rates" if a.base_rates else ("smoke" if a.smoke else "train")
    if a.iterations < 1 or a.eval_samples < 2 or a.base_samples < 1:
        ap.error("--iterations must be >= 1, --eval-samples >= 2, --base-samples >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    fam = manifest(a.family)
    problems = family_problems(fam, *load_family(fam))
    if problems:
        raise SystemExit(f"the {a.family} family cannot measure transfer:\n  " + "\n  ".join(problems))
    train, evals = pick(fam["train"], a.train_task, "train"), pick(fam["eval"], a.eval_task, "eval")
    tag = ("-base-rates" if a.mode == "base-rates" else "") + ("-smoke" if a.smoke else "")
    run = (a.run_dir or REPO / "runs" / f"transfer-{a.family}{tag}-{a.model}-{a.harness}-seed{a.seed}").resolve()
    name = a.name or f"{a.family}_{a.model}_{a.harness}"
    settings = {k: getattr(a, k) for k in SETTINGS}
    toml = loop_toml(a, fam, run, train, evals)
    if a.dry_run:
        sph = a.samples_per_hour or {"shell": 104.0, "trivia": 1200.0}[a.family]
        est = estimate(len(train), len(evals), a.samples, a.eval_samples, a.iterations, a.groups_per_step, sph,
                       train_s={"shell": 900.0, "trivia": 90.0}[a.family], final_rollout=a.final_rollout)
        print(f"# {run}/loop.toml\n{toml}\n# then: polar loop {run}/loop.toml\n# estimated per seed: {json.dumps(est)}")
        return 0
    rc = 0
    if not a.score_only:
        state = prepare(run, settings)
        print(f"run directory {run}: {state}")
        if state != "done":
            (run / "loop.toml").write_text(toml)
            n = len(list(run.glob("bench-loop-*.log")))
            t0 = time.monotonic()
            rc = bl.run_demo([str(REPO / ".venv" / "bin" / "polar"), "loop", str(run / "loop.toml")],
                             run / f"bench-loop-{n}.log")
            print(f"polar loop exited {rc} after {time.monotonic() - t0:.0f} s")
    res = analyse(run, a, settings, train, evals)
    res["demo_exit"] = rc  # the loop's exit code (the key learning_*.json has for its demo)
    if a.smoke:  # the pipeline, not a measurement: its results stay in the run directory
        out = run / f"transfer_{'base_rates_' if a.mode == 'base-rates' else ''}{name}_smoke_seed{a.seed}.json"
    elif a.mode == "base-rates":
        out = RESULTS / f"transfer_base_rates_{name}_seed{a.seed}.json"
    else:
        out = RESULTS / f"transfer_{name}_seed{a.seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    plot(res, out.with_suffix(".png"))
    print_tables(res)
    print(f"\nwrote {out} and {out.with_suffix('.png')}" + ("" if res["finished"] else
          " (a partial run: the same command resumes it)"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
