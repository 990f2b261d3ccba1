"""How many public Harbor tasks load, and how many the local mode (bubblewrap, the host's toolchain)
runs: `polar tasks check` on each dataset, with the refusal causes counted.

    python benchmarks/bench_harbor_tasks.py NAME=DATASET_DIR [NAME=DIR ...] \
        [--old-loader DIR] [--out benchmarks/results/harbor_tasks.json]

``--old-loader DIR`` is a tree holding an older ``polar_runtime`` (``git archive REV polar_runtime |
tar -x -C DIR``): each task is also loaded with it, in a subprocess, for the before/after figure.
Task directories are read from wherever they are; nothing of them is copied into the results but
ids, statuses and reasons.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

#: refusal / failure reason -> cause (first match wins)
CAUSES = [
    ("base image the host cannot stand in for", r"cannot stand in for image"),
    ("writes outside the work dir (build RUN on the read-only system)", r"could not build.*Read-only file system"),
    ("COPY destination outside the work dir", r"destination \S+ is outside the work dir"),
    ("build step failed", r"could not build the environment"),
    ("needs the network (build, verifier or oracle)", r"needs the network"),
    ("apt packages the host lacks", r"apt packages this host lacks"),
    ("COPY --from an image", r"COPY --from"),
    ("multi-stage build", r"multi-stage"),
    ("task.toml key refused", r"task\.toml: "),
    ("link leaving the task directory", r"outside the task directory"),
    ("not a task directory", r"not a Harbor task directory"),
    ("no solution", r"no solution/solve.sh"),
    ("oracle failed", r"^oracle failed"),
    ("tests test nothing", r"tests test nothing"),
]


def cause(reason: str) -> str:
    for name, pat in CAUSES:
        if re.search(pat, reason, re.S):
            return name
    return "other"


OLD = """
import json, sys
from pathlib import Path
from polar_trial.tasks import load_tasks
out = {}
for d in sys.argv[1:]:
    try:
        load_tasks(d); out[Path(d).name] = "loads"
    except Exception as e:
        out[Path(d).name] = f"{type(e).__name__}: {str(e)[-300:]}"
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("datasets", nargs="+", help="NAME=DIR")
    ap.add_argument("--old-loader", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "harbor_tasks.json")
    ap.add_argument("--note", default="", help="what the datasets are (kept in the results)")
    args = ap.parse_args()

    from polar_runtime.task_commands import check_tasks, load_for_check

    report: dict = {"what": "polar tasks check per dataset: loads, passes in the local mode (bubblewrap), causes",
                    "note": args.note, "datasets": {}}
    for spec in args.datasets:
        name, _, path = spec.partition("=")
        root = Path(path)
        t0 = time.monotonic()
        tasks, refused = load_for_check(str(root))
        with tempfile.TemporaryDirectory(prefix="bench-harbor-") as tmp:
            rows = check_tasks(tasks, work=Path(tmp), sandbox="auto") if tasks else []
        rows += refused
        old = {}
        if args.old_loader is not None:
            dirs = [str(root / r["task"]) for r in rows]
            proc = subprocess.run([sys.executable, "-c", OLD, *dirs], capture_output=True, text=True,
                                  env={"PYTHONPATH": str(args.old_loader), "PATH": "/usr/bin:/bin"})
            old = json.loads(proc.stdout or "{}")
        base = str(root.resolve()) + "/"
        per_task = [{"task": r["task"], "status": r["status"], "cause": None if r["status"] == "passed" else cause(r["verdict"]),
                     "reason": r["verdict"].replace(base, ""), "old_loader": old.get(r["task"], "").replace(base, "") or None}
                    for r in rows]
        loads = len(tasks)
        report["datasets"][name] = {
            "tasks": len(rows), "load": loads, "passed": sum(r["status"] == "passed" for r in rows),
            "failed": sum(r["status"] == "failed" for r in rows), "refused": sum(r["status"] == "refused" for r in rows),
            "old_loader_loads": sum(v == "loads" for v in old.values()) if old else None,
            "causes": dict(Counter(r["cause"] for r in per_task if r["cause"]).most_common()),
            "wall_s": round(time.monotonic() - t0, 1), "rows": per_task}
        d = report["datasets"][name]
        print(f"{name}: {d['tasks']} tasks, {d['load']} load (old loader: {d['old_loader_loads']}), "
              f"{d['passed']} pass, {d['failed']} fail, {d['refused']} refused; causes {d['causes']}")
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
