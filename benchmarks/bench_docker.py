"""Issue #38's figures: a private dockerd, stand-in images cold and warm, and `polar tasks check`
through docker (pass counts), written as JSON to benchmarks/results/docker_tasks.json.

    .venv/bin/python benchmarks/bench_docker.py [--cold]

``--cold`` removes the cached stand-in root file systems first (each then takes a debootstrap:
about a minute or more). A fresh private daemon is started in a temporary dir and stopped at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    from polar_trial.sandbox import standin
    from polar_trial.sandbox.dockerd import PrivateDockerd
    from polar_runtime.task_commands import check_tasks, load_for_check

    cold = "--cold" in sys.argv
    if cold:
        for f in standin.cache_dir().glob("*.tar"):
            f.unlink()
    out: dict = {"machine": f"{os.cpu_count()} cores", "cold": cold, "images": {}, "tasks_check": {}}
    root = Path(tempfile.mkdtemp(prefix="pdb-", dir="/tmp"))
    d = PrivateDockerd(root)
    t0 = time.monotonic()
    d.start()
    out["dockerd_start_s"] = round(time.monotonic() - t0, 2)
    os.environ["DOCKER_HOST"] = d.host
    try:
        for image in ("ubuntu:24.04", "python:3.11-slim"):
            r = standin.ensure_image(image)
            out["images"][image] = {"stand_in": r["stand_in"], "rootfs_build_s": r["build_s"], "import_s": r["import_s"]}
        for ds in ("polar_trial/tasks/coding", "tests/fixtures/harbor-no-python"):
            tasks, refused = load_for_check(str(REPO / ds))
            t0 = time.monotonic()
            with tempfile.TemporaryDirectory() as tmp:
                rows = check_tasks(tasks, work=Path(tmp), sandbox="docker", concurrency=2)
            out["tasks_check"][ds] = {"tasks": len(rows) + len(refused),
                                      "passed": sum(r["status"] == "passed" for r in rows),
                                      "wall_s": round(time.monotonic() - t0, 2)}
    finally:
        t0 = time.monotonic()
        d.stop()
        out["dockerd_stop_s"] = round(time.monotonic() - t0, 2)
        shutil.rmtree(root, ignore_errors=True)
    dest = REPO / "benchmarks" / "results" / "docker_tasks.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(dest.read_text()) if dest.exists() else {}
    prev["cold" if cold else "warm"] = out
    dest.write_text(json.dumps(prev, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
