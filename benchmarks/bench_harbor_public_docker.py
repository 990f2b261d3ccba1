"""Public Harbor task sets through ``polar tasks check --sandbox docker`` (issue 38's acceptance
measure): per set, the tasks sampled, those excluded and why, passed, failed by cause; image build
times cold and warm. Writes ``results/harbor_public_docker.json``.

The task sets are not in the repository (never commit them): fetch them yourself and lay each set
out as a directory of task directories, then name it with its source::

    polar docker start && eval "$(polar docker env)"
    python benchmarks/bench_harbor_public_docker.py run --label after \\
        --set gordonyang=/work/public-tasks/sample/gordonyang \\
        --out /work/public-tasks/runs            # one `polar tasks check` per task, with a timeout
    python benchmarks/bench_harbor_public_docker.py summarize --runs /work/public-tasks/runs \\
        --labels before,after --sources sources.json   # -> results/harbor_public_docker.json

``run`` checks one task at a time (``timeout`` per task, under ``nice``) and keeps, per task, the
``--json`` row and the console log in ``<out>/<label>/<set>.<task>.{json,log}`` and a line in
``summary.txt`` with the seconds it took; a task already done is skipped, so a run resumes.
``summarize`` counts each label's rows by cause (``CAUSES``: the first pattern that matches the
verdict). ``build`` times a task image's build cold (its tag removed, the stand-in base already
imported) and warm (found by its content tag).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "harbor_public_docker.json"

#: verdict pattern -> cause (first match wins)
CAUSES = [
    (r"cannot stand in for image '[^']*(golang|node|dotnet|temurin|openjdk|gcc|rust)[^']*'",
     "FROM a toolchain image: refused by the local-mode Dockerfile planner"),
    (r"multi-step task", "multi-step task ([[steps]]): not supported"),
    (r"not found in the build context", "Dockerfile COPYs a file outside its build context (Harbor's build fails too)"),
    (r"no stand-in for it", "FROM an image with no Debian stand-in (e.g. .NET SDK)"),
    (r"fetches from (go\.dev|github\.com|dl\.google\.com|[\w.-]+)", "build downloads from outside the package registries"),
    (r"go\.mod requires go >=", "module needs a newer Go than the stand-in's (GOTOOLCHAIN=local)"),
    (r"tunnel error", "uv downloads a Python from GitHub (none in the image, or not the version asked)"),
    (r"Permission denied: '/tmp/", "program built into /tmp not executable (tmpfs noexec)"),
    (r"timed out|rc=124|per-task timeout", "per-task timeout"),
    (r"tests test nothing", "nop scored as high as the oracle"),
    (r"no tests/test\.sh", "the task ships no tests/test.sh"),
    (r"the verifier wrote no reward", "verifier wrote no reward"),
    (r"could not be built", "image build failed"),
    (r"oracle failed", "oracle scored below 1 (task-specific)"),
]


def cause(verdict: str) -> str:
    for pat, name in CAUSES:
        if re.search(pat, verdict):
            return name
    return "other: " + verdict[:120]


def run(args: argparse.Namespace) -> None:
    root = Path(__file__).resolve().parents[1]
    polar = str(root / ".venv" / "bin" / "polar")
    for spec in args.set:
        name, _, path = spec.partition("=")
        out = Path(args.out) / args.label
        out.mkdir(parents=True, exist_ok=True)
        for t in sorted(p for p in Path(path).iterdir() if (p / "task.toml").is_file()):
            js = out / f"{name}.{t.name}.json"
            if js.exists():
                continue
            t0 = time.monotonic()
            with open(out / f"{name}.{t.name}.log", "w") as log:
                rc = subprocess.call(["nice", "-n", "10", "timeout", "-k", "30", str(args.timeout), polar, "tasks",
                                      "check", str(t), "--sandbox", "docker", "--json", str(js)],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=root)
            with open(out / "summary.txt", "a") as s:
                s.write(f"{name} {t.name} rc={rc} {time.monotonic() - t0:.0f}s\n")


def rows_of(run_dir: Path, set_name: str) -> dict[str, dict]:
    """task -> {status, verdict, cause, seconds} of one label's run of one set."""
    secs = {}
    summary = run_dir / "summary.txt"
    for line in summary.read_text().splitlines() if summary.exists() else []:
        m = re.match(r"(\S+) (\S+) rc=(\d+) (\d+)s", line)
        if m and m[1] == set_name:
            secs[m[2]] = (int(m[4]), int(m[3]))
    out = {}
    for task, (s, rc) in secs.items():
        js = run_dir / f"{set_name}.{task}.json"
        row = json.loads(js.read_text())[0] if js.exists() else None
        if row is None:  # killed by the per-task timeout before writing its row
            out[task] = {"status": "failed", "verdict": f"per-task timeout (rc={rc})", "seconds": s}
        else:
            out[task] = {"status": row["status"], "verdict": row["verdict"], "seconds": s,
                         "stand_ins": [n for n in row.get("notes", []) if "STAND-IN" in n]}
        if out[task]["status"] != "passed":
            out[task]["cause"] = cause(out[task]["verdict"])
    return out


def summarize(args: argparse.Namespace) -> None:
    sources = json.loads(Path(args.sources).read_text())
    labels = args.labels.split(",")
    result = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    result.update({"date": time.strftime("%Y-%m-%d"), "command": "polar tasks check TASK --sandbox docker",
                   "machine": "2 shared cores, 24 GiB, private dockerd (polar docker start), no image registry",
                   "sets": result.get("sets", {})})
    for name, src in sources.items():
        entry = {**result["sets"].get(name, {}), **src}  # earlier labels kept (their runs may be gone)
        for label in labels:
            rows = rows_of(Path(args.runs) / label, name)
            if not rows:
                continue
            by: dict[str, int] = {}
            for r in rows.values():
                if r["status"] != "passed":
                    by[r["cause"]] = by.get(r["cause"], 0) + 1
            passed = sum(r["status"] == "passed" for r in rows.values())
            entry[label] = {"checked": len(rows), "passed": passed, "failed": len(rows) - passed,
                            "pass_rate": round(passed / len(rows), 3) if rows else None,
                            "failed_by_cause": dict(sorted(by.items(), key=lambda kv: -kv[1])), "tasks": rows}
        result["sets"][name] = entry
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({n: {lb: {k: v for k, v in e[lb].items() if k != "tasks"} for lb in labels if lb in e}
                      for n, e in result["sets"].items()}, indent=1))


def build(args: argparse.Namespace) -> None:
    """Cold (tag removed; the stand-in base already on the daemon) and warm image builds."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tempfile

    from polar_trial.sandbox import get_sandbox
    from polar_trial.tasks import imagebuild
    from polar_trial.tasks.environment import apply_steps
    from polar_trial.tasks.harbor import load_task_dir

    sb = get_sandbox("docker")
    out = []
    for d in args.tasks:
        task = load_task_dir(Path(d), container=True)
        sb.image_ready(task.image)
        tag = imagebuild.image_tag(task)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
        times = []
        for _ in range(2):
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.monotonic()
                imagebuild.build_task_image(task, sb, Path(tmp), apply_steps)
                times.append(round(time.monotonic() - t0, 1))
        out.append({"task": Path(d).name, "from": task.image,
                    "run_steps": sum(s.kind == "run" for s in task.environment.steps),
                    "cold_s": times[0], "warm_s": times[1]})
        print(out[-1], flush=True)
    result = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    result["image_build"] = out
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--label", required=True)
    r.add_argument("--set", action="append", required=True, help="NAME=DIR (a directory of task dirs)")
    r.add_argument("--out", required=True)
    r.add_argument("--timeout", type=int, default=900, help="seconds per task (default 900)")
    s = sub.add_parser("summarize")
    s.add_argument("--runs", required=True)
    s.add_argument("--labels", default="before,after")
    s.add_argument("--sources", required=True, help="JSON: {set: {repo, commit, path, sampled, excluded}}")
    b = sub.add_parser("build")
    b.add_argument("tasks", nargs="+")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    {"run": run, "summarize": summarize, "build": build}[args.cmd](args)


if __name__ == "__main__":
    main()
