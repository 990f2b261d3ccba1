"""Issue #54's service stand-ins, for real: redis, postgres and nginx built from Debian packages
(``polar_trial/sandbox/servicestandin.py``), then one multi-container task with all three run by
the oracle through the live trial (``sandbox/services.py``): redis answers PING, postgres accepts
the task's POSTGRES_USER/PASSWORD/DB over TCP, nginx serves its default page, each reached by its
service name from the main container. Written as JSON to benchmarks/results/service_standins.json.

    .venv/bin/python benchmarks/bench_service_standins.py [--cold]

``--cold`` removes the three cached root file systems first (each is then a debootstrap plus its
packages). A fresh private daemon is started in a temporary dir and stopped at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

IMAGES = ("redis:7", "postgres:16", "nginx:1.27")
COMPOSE = """
services:
  main:
    depends_on:
      cache: {condition: service_healthy}
      db: {condition: service_healthy}
      web: {condition: service_healthy}
  cache:
    image: redis:7
    healthcheck: {test: ["CMD", "redis-cli", "ping"], interval: 1s, retries: 30}
  db:
    image: postgres:16
    environment: {POSTGRES_USER: app, POSTGRES_PASSWORD: s3cret, POSTGRES_DB: appdb}
    healthcheck:
      test: ["CMD-SHELL", "PGPASSWORD=s3cret psql -h 127.0.0.1 -U app -d appdb -c 'select 1'"]
      interval: 1s
      retries: 60
  web:
    image: nginx:1.27
    healthcheck: {test: ["CMD", "bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/80"], interval: 1s, retries: 30}
"""
SOLVE = r"""
python3 - <<'EOF'
import socket, urllib.request
s = socket.create_connection(("cache", 6379)); s.sendall(b"PING\r\n"); pong = s.recv(64)
db = socket.create_connection(("db", 5432)); db.close()
page = urllib.request.urlopen("http://web/").read()
open("/app/out", "w").write(f"{pong!r} {b'nginx' in page}\n")
EOF
"""
TEST = r"""
grep -q "b'+PONG\\\\r\\\\n' True" /app/out && echo 1 > /logs/verifier/reward.txt || { cat /app/out; echo 0 > /logs/verifier/reward.txt; }
"""


def task_dir(root: Path) -> Path:
    d = root / "three-services"
    for sub in ("environment", "solution", "tests"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 120\n[agent]\ntimeout_sec = 120\n')
    (d / "instruction.md").write_text("Talk to the cache, the database and the web server.\n")
    (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
    (d / "environment" / "docker-compose.yaml").write_text(textwrap.dedent(COMPOSE))
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\n" + SOLVE)
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + TEST)
    return d


def main() -> None:
    from polar_runtime import rollout as r
    from polar_runtime.harnesses import Endpoint, get_preset
    from polar_trial.sandbox import standin
    from polar_trial.sandbox.dockerd import PrivateDockerd
    from polar_trial.sandbox.servicestandin import ensure_service_image, service_plan
    from polar_trial.tasks import load_tasks

    cold = "--cold" in sys.argv
    if cold:
        for image in IMAGES:
            for f in standin.cache_dir().glob(f"{service_plan(image)[0].flavour}-*.tar"):
                f.unlink()
    out: dict = {"machine": f"{os.cpu_count()} cores", "cold": cold, "images": {}}
    root = Path(tempfile.mkdtemp(prefix="pdb-", dir="/tmp"))
    d = PrivateDockerd(root)
    d.start(timeout_s=120)
    os.environ["DOCKER_HOST"] = d.host
    try:
        for image in IMAGES:
            t0 = time.monotonic()
            said = ensure_service_image(image)
            out["images"][image] = {"stand_in": said, "seconds": round(time.monotonic() - t0, 1)}
            print(image, out["images"][image], flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-svc-") as tmp:
            cfg = r.RolloutConfig(tasks=load_tasks(task_dir(Path(tmp)), container="docker"),
                                  preset=get_preset("oracle"), endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
                                  capture_dir=Path(tmp) / "cap", model="-", samples=1, timeout=120, settle_s=0.0,
                                  sandbox="docker", work_root=Path(tmp) / "work")
            t0 = time.monotonic()
            (row,) = r.run_rollout(cfg).iter_rows(named=True)
            out["trial"] = {"reward": row["reward"], "error": row["error"], "wall_s": round(time.monotonic() - t0, 1),
                            "notes": [n for n in (row["sandbox_notes"] or "").splitlines() if "service" in n]}
            print(json.dumps(out["trial"], indent=1), flush=True)
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    dest = REPO / "benchmarks" / "results" / "service_standins.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(dest.read_text()) if dest.exists() else {}
    prev["cold" if cold else "warm"] = out
    dest.write_text(json.dumps(prev, indent=1) + "\n")


if __name__ == "__main__":
    main()
