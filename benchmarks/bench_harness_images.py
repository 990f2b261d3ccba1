"""Each harness, unmodified, in the task's own image through docker (issue 52's measure).

Per harness and task: the model calls, the exact-merge rate with every non-exact merge's cause
named, the reward from the task's own verifier, the wall time, and where the time goes
(environment start, harness start-up, model, the rest of the agent phase: tools and the
harness's own work, verifier). The 0.5B rarely solves anything: this measures the path, not the
model. Writes ``results/harness_images.json``; ``benchmarks/history/harness-images.md`` holds the table.

Tasks (Harbor format, public sources, all in the repository or generated): the swe-mini examples
(``FROM python:3.11-slim``: the image where Pi ended with ``env: 'node': No such file or
directory``), Harbor's hello-world (tests/fixtures/harbor-no-python) on Debian with its own Node 18
(where Pi failed on that Node), on ``ubuntu:24.04`` (``--tasks ubuntu``), and on an image with no
libc at all (busybox-static, built here)::

    python benchmarks/bench_harness_images.py                       # all six harnesses, all tasks
    python benchmarks/bench_harness_images.py --harnesses pi-chat,codex --tasks nolibc --upstream URL
    python benchmarks/bench_harness_images.py table results/harness_images.json   # the markdown table

A private dockerd is started unless ``DOCKER_HOST`` names one; the 0.5B is served by a vLLM this
script starts unless ``--upstream`` names one. Start-up and model time come from the capture
records' timestamps; environment start is timed around the live trial's ``start``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from polar_core.schema import SESSIONS_SUBDIR, read_capture_lines  # noqa: E402
from polar_runtime import harnesses as h  # noqa: E402
from polar_runtime import rollout as r  # noqa: E402
from polar_trial.tasks import load_tasks  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "harness_images.json"
ALL = ["pi-chat", "codex", "claude-code", "opencode", "qwen-code", "gemini"]
NOLIBC = "polar-test/nolibc:1"


def build_nolibc_image() -> None:
    """busybox-static alone (no loader, no libc, no Node); ``bash`` a busybox sh script."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    root = Path(tempfile.mkdtemp(prefix="polar-nolibc-"))
    try:
        for d in ("bin", "etc", "tmp", "root", "app", "usr/bin"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(busybox, root / "bin" / "busybox")
        for a in subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split():
            if a != "busybox":
                os.symlink("busybox", root / "bin" / a)
        os.symlink("/bin/env", root / "usr" / "bin" / "env")
        (root / "bin" / "bash").write_text('#!/bin/sh\nexec /bin/sh "$@"\n')
        os.chmod(root / "bin" / "bash", 0o755)
        os.chmod(root / "tmp", 0o1777)
        os.chmod(root, 0o755)  # mkdtemp's 0700 would be the image's /: a remapped root could not enter it
        (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-c", "ENV PATH=/usr/local/bin:/usr/bin:/bin", "-", NOLIBC],
                       stdin=tar.stdout, check=True, capture_output=True)
        tar.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def nolibc_task(root: Path) -> Path:
    """Harbor's hello-world (tests/fixtures/harbor-no-python) on the no-libc image."""
    src = REPO / "tests" / "fixtures" / "harbor-no-python" / "hello-no-python"
    t = root / "hello-nolibc"
    shutil.copytree(src, t)
    (t / "environment" / "Dockerfile").write_text(f"FROM {NOLIBC}\nWORKDIR /app\n")
    (t / "tests" / "test.sh").write_text(textwrap.dedent("""\
        #!/bin/bash
        mkdir -p /logs/verifier
        if [ "$(cat /app/hello.txt 2>/dev/null)" = "Hello, world!" ]; then echo 1 > /logs/verifier/reward.txt
        else echo 0 > /logs/verifier/reward.txt; fi
        """))
    return t


def node18_task(root: Path) -> Path:
    """Harbor's hello-world on Debian with Debian's own Node 18 on PATH (Pi failed on it with
    ``SyntaxError: Invalid regular expression flags`` when it ran on the image's node)."""
    src = REPO / "tests" / "fixtures" / "harbor-no-python" / "hello-no-python"
    t = root / "hello-node18"
    shutil.copytree(src, t)
    (t / "environment" / "Dockerfile").write_text(
        "FROM debian:bookworm\nRUN apt-get update && apt-get install -y --no-install-recommends nodejs "
        "&& node --version\nWORKDIR /app\n")
    return t


def task_sets(names: list[str], tmp: Path) -> list:
    out = []
    for name in names:
        if name == "nolibc":
            out += load_tasks(nolibc_task(tmp), container=True)
        elif name == "node18":
            out += load_tasks(node18_task(tmp), container=True)
        elif name == "ubuntu":
            out += load_tasks(REPO / "tests" / "fixtures" / "harbor-no-python" / "hello-no-python", container=True)
        elif name == "swe-mini":
            out += load_tasks(REPO / "examples" / "swe-mini" / "inflection-ordinal-hundreds", container=True)
        else:
            out += load_tasks(name, container=True)
    return out


def merges(calls: list[dict]) -> dict:
    """Every call that continues an earlier one is a merge: its predecessor is the latest earlier
    call whose prompt prefixes its prompt (a session can hold several chains: OpenCode's title call
    runs beside its first turn). Exact when its history is the model's own ids (the proxy's
    ``history``) and, by ids, the predecessor's prompt + sampled ids prefix its prompt; otherwise
    the cause is named (``history_cause``, or the ids' first difference). A call that continues no
    earlier one starts a chain (``chains``), and a known side call (``side_call_of``: titles, token
    counts) is counted apart (``auxiliary``), as the drift report and ``polar certify`` count them."""
    from polar_core.compaction import side_call_of

    out = {"merges": 0, "exact": 0, "causes": {}, "chains": 0, "auxiliary": 0}
    earlier: list[dict] = []
    for b in calls:
        if side_call_of(((b.get("normalized_request") or {}).get("messages"))):
            out["auxiliary"] += 1
            continue
        prompt = b.get("prompt_token_ids") or []
        a = next((c for c in reversed(earlier)
                  if c.get("prompt_token_ids") and prompt[: len(c["prompt_token_ids"])] == c["prompt_token_ids"]), None)
        earlier.append(b)
        if a is None:
            out["chains"] += 1
            continue
        out["merges"] += 1
        head = a["prompt_token_ids"] + (a.get("sampled_token_ids") or [])
        by_ids = prompt[: len(head)] == head
        if b.get("history") == "exact" and by_ids:
            out["exact"] += 1
            continue
        if b.get("history") not in (None, "exact"):
            cause = f"{b.get('history')}: {b.get('history_cause')}"
        elif not by_ids:
            cause = "answer re-rendered (prompt kept, sampled ids differ)"
        else:
            cause = "history not marked exact by the proxy, ids spliced"
        out["causes"][cause] = out["causes"].get(cause, 0) + 1
    out["rate"] = round(out["exact"] / out["merges"], 3) if out["merges"] else None
    return out


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the spans (calls in flight at once count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def time_split(row: dict, calls: list[dict], env_start_s: float, agent_t0: float | None) -> dict:
    """Seconds: environment start, harness start-up (agent phase start -> first call), model (the
    time some call was upstream: concurrent calls count once), the rest of the agent phase (tools,
    the harness's own work), verifier."""
    model = _union_s([(c["t_upstream_sent"], c["t_upstream_end"]) for c in calls
                      if c.get("t_upstream_sent") and c.get("t_upstream_end")])
    first = min((c["t_request_in"] for c in calls if c.get("t_request_in")), default=None)
    startup = (first - agent_t0) if first and agent_t0 else None
    agent = row["wall_s"] - env_start_s
    rest = agent - model - (startup or 0)
    return {"environment_start": round(env_start_s, 1), "harness_startup": round(startup, 1) if startup else None,
            "model": round(model, 1), "tools_and_harness": round(rest, 1), "verifier": round(row["eval_s"], 1)}


def table(results: list[Path]) -> str:
    """The markdown table of benchmarks/history/harness-images.md, from one or more result files."""
    rows = [row for p in results for row in json.loads(p.read_text())["rows"]]
    out = ["| harness | task (image) | calls (ok) | exact merges | non-exact causes | reward | wall s "
           "| env start | start-up | model | tools+harness | verifier | status |", "|" + "---|" * 13]
    for x in rows:
        if "task" not in x:
            out.append(f"| {x['harness']} | - | - | - | - | - | - | - | - | - | - | - | {x.get('error')} |")
            continue
        m, t = x["merge"], x["time"]
        causes = "; ".join(f"{k} x{v}" for k, v in m["causes"].items()) or "-"
        failed = ", ".join(f"{k} x{v}" for k, v in x["failed_calls"].items())
        out.append(f"| {x['harness']} | {x['task']} (`{x['image']}`) | {x['calls']} ({x['calls_ok']}) "
                   f"| {m['exact']}/{m['merges']} | {causes} | {x['reward']} ({x['evaluator_status']}) | {x['wall_s']} "
                   f"| {t['environment_start']} | {t['harness_startup']} | {t['model']} | {t['tools_and_harness']} "
                   f"| {t['verifier']} | {x['status']}{' (' + failed + ')' if failed else ''} |")
    return "\n".join(out)


def main() -> None:
    if sys.argv[1:2] == ["table"]:
        print(table([Path(p) for p in sys.argv[2:]] or [RESULTS]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--harnesses", default=",".join(ALL))
    ap.add_argument("--tasks", default="swe-mini,node18,nolibc")
    ap.add_argument("--upstream", default="", help="a running vLLM serving the 0.5B (else one is started)")
    ap.add_argument("--timeout", type=float, default=420.0, help="agent phase limit per sample (s)")
    ap.add_argument("--max-tokens", type=int, default=384, help="polar_max_tokens_cap per call")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--first-step", type=int, default=0, help="step of the first harness's sessions (ids)")
    args = ap.parse_args()

    from polar_proxy.process import ProxyProcess
    from polar_runtime import models
    from polar_trial.sandbox import trial as trial_mod
    from polar_trial.sandbox.dockerd import PrivateDockerd
    from polar_runtime.serve import VLLMServer

    stack = contextlib.ExitStack()
    tmp = Path(tempfile.mkdtemp(prefix="bench-harness-images-"))
    with stack:
        if not os.environ.get("DOCKER_HOST"):
            d = PrivateDockerd(Path(tempfile.mkdtemp(prefix="pd-", dir="/tmp")))
            d.start(timeout_s=120)
            stack.callback(d.stop)
            os.environ["DOCKER_HOST"] = d.host
        build_nolibc_image()
        if args.upstream:
            server = VLLMServer.attach(args.upstream, models.ensure_model(models.QWEN05), served_model_name=models.QWEN05)
        else:
            server = VLLMServer(models.QWEN05, served_model_name=models.QWEN05, max_model_len=32768)
            server.start(wait=True)
            stack.callback(server.stop)
        px = ProxyProcess(server.base_url, tmp / "captures", confdir=tmp / "mitmproxy", served_model=models.QWEN05,
                          log_file=tmp / "proxy.log",
                          options={"polar_exact_history": True, "polar_max_tokens_cap": args.max_tokens}).start()
        stack.callback(px.stop)
        # environment start: timed around the live trial's start; the agent phase starts after it
        timing: dict[str, float] = {}
        real_start = trial_mod.LiveTrial.start

        def timed_start(self, *a, **kw):
            t0 = time.monotonic()
            try:
                return real_start(self, *a, **kw)
            finally:
                if "agent_t0" not in timing:  # the sample's environment (a later start is not the agent's)
                    timing["env"] = time.monotonic() - t0
                    timing["agent_t0"] = time.time()

        trial_mod.LiveTrial.start = timed_start
        tasks = task_sets(args.tasks.split(","), tmp)
        rows = []
        for step, name in enumerate(args.harnesses.split(",")):
            preset = h.get_preset(name)
            if not preset.installed():
                rows.append({"harness": name, "error": "not installed"})
                continue
            for task in tasks:
                # one limit for every task: the hello tasks' 60 s is no time for a 0.5B on 2 CPU cores
                task.timeout = args.timeout
                timing.clear()
                cfg = r.RolloutConfig(tasks=[task], preset=preset, endpoint=h.Endpoint("base_url", base_url=px.url),
                                      capture_dir=tmp / "captures", model=models.QWEN05, samples=1, timeout=args.timeout,
                                      eval_timeout=120, sandbox="docker", work_root=tmp / "work" / name,
                                      step=args.first_step + step)  # a session (and result) of its own per harness
                t0 = time.monotonic()
                df = r.run_rollout(cfg, control=px.control)  # every row of the capture dir: this sample's
                row = df.filter((df["task_id"] == task.id) & (df["step"] == cfg.step)).row(0, named=True)
                wall = time.monotonic() - t0
                path = tmp / "captures" / SESSIONS_SUBDIR / f"{row['session_id']}.jsonl"
                calls = sorted(read_capture_lines(path), key=lambda c: c["call_index"]) if path.exists() else []
                ok = [c for c in calls if c["status"] == "ok"]
                res = {"harness": name, "task": task.id, "image": task.image, "status": row["status"],
                       "error": (row["error"] or "")[-300:], "calls": len(calls), "calls_ok": len(ok),
                       "failed_calls": {k: sum(1 for c in calls if c["status"] != "ok" and c.get("error_kind") == k)
                                        for k in {c.get("error_kind") for c in calls if c["status"] != "ok"}},
                       "merge": merges(ok), "reward": row["reward"], "evaluator_status": row["evaluator_status"],
                       "wall_s": round(wall, 1), "time": time_split(row, calls, timing.get("env", 0.0), timing.get("agent_t0")),
                       "runtime_note": next((n for n in row["sandbox_notes"].splitlines() if "harness runtime" in n), None)}
                print(json.dumps(res), flush=True)
                rows.append(res)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"model": models.QWEN05, "max_tokens_cap": args.max_tokens,
                                                "timeout_s": args.timeout, "rows": rows}, indent=1) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
