"""A multi-container task live on the session's private dockerd (``conftest.dockerd``): its
services started by Polar (``sandbox/services.py``) in the main container's network namespace,
the oracle playing the sample. Each test was watched failing with its part taken away (see the
commit that added it).

Times (2-core machine, warm stand-ins, the daemon up): ~10-20 s each."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from polar_runtime.harnesses import Endpoint, get_preset

pytestmark = pytest.mark.docker

SERVER = ("mkdir -p /tmp/w && cat /srv/origin > /tmp/w/origin && echo up > /tmp/w/ping && cd /tmp/w && sleep 1 && "
          "exec python3 -m http.server 8080 --bind 127.0.0.1")


def _task(root: Path, compose: str, solve: str, test: str, files: dict[str, str] | None = None) -> Path:
    d = root / "multi"
    (d / "environment").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "tests").mkdir()
    (d / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n[agent]\ntimeout_sec = 60\n')
    (d / "instruction.md").write_text("Fetch the service's answer.\n")
    (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
    (d / "environment" / "docker-compose.yaml").write_text(textwrap.dedent(compose))
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\n" + textwrap.dedent(solve))
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + textwrap.dedent(test))
    for rel, text in (files or {}).items():
        (d / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "environment" / rel).write_text(textwrap.dedent(text))
    return d


def _oracle(tmp_path: Path, task_dir: Path) -> dict:
    from polar_runtime import rollout as r
    from polar_trial.tasks import load_tasks

    cfg = r.RolloutConfig(tasks=load_tasks(task_dir, container="docker"), preset=get_preset("oracle"),
                          endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
                          capture_dir=tmp_path / "cap", model="-", samples=1, timeout=60, settle_s=0.0,
                          sandbox="docker", work_root=tmp_path / "work")
    (row,) = r.run_rollout(cfg).iter_rows(named=True)
    return row


def test_a_service_is_reached_by_its_name_after_its_healthcheck_and_runs_hardened(dockerd, tmp_path, monkeypatch):
    """``web`` (built from ``environment/web/Dockerfile``) serves on 127.0.0.1:8080 in the main
    container's network namespace (a server bound to loopback: only a shared namespace reaches it);
    main depends on it being healthy; the oracle and the verifier reach it as http://web:8080.
    From the host, before it is removed: no network of its own, every capability dropped but the
    package set, no new privileges, no log kept."""
    from polar_trial.sandbox.services import Services

    seen: list[dict] = []
    real_stop = Services.stop

    def inspect_then_stop(self):
        for c in self.containers.values():
            r = subprocess.run(["docker", "inspect", c], capture_output=True, text=True)
            seen.append(json.loads(r.stdout)[0] if r.returncode == 0 else {})
        real_stop(self)

    monkeypatch.setattr(Services, "stop", inspect_then_stop)
    d = _task(tmp_path, f"""
        services:
          main:
            depends_on:
              web: {{condition: service_healthy}}
          web:
            build: ./web
            command: ["sh", "-c", "{SERVER}"]
            healthcheck:
              test: ["CMD", "python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/ping')"]
              interval: 1s
              retries: 30
        """, solve="""
        getent hosts web > /app/hosts
        python3 -c "import urllib.request as u; open('/app/origin', 'wb').write(u.urlopen('http://web:8080/origin').read())"
        python3 -c "import urllib.request as u; open('/app/got', 'wb').write(u.urlopen('http://web:8080/ping').read())"
        """, test="""
        grep -q '^127.0.0.1' /app/hosts && [ "$(cat /app/got)" = up ] && [ "$(cat /app/origin)" = built ] \\
          && python3 -c "import urllib.request as u; assert u.urlopen('http://web:8080/ping').read() == b'up\\\\n'" \\
          && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
        """, files={"web/Dockerfile": """
            FROM python:3.11-slim
            WORKDIR /srv
            RUN echo built > /srv/origin
            """})
    t0 = time.monotonic()
    row = _oracle(tmp_path, d)
    assert row["reward"] == 1.0, (row["error"], row["evaluator_output"][-600:], row["sandbox_notes"])
    assert "service web healthy after" in row["sandbox_notes"], row["sandbox_notes"]
    (info,) = seen
    hc = info["HostConfig"]
    assert hc["NetworkMode"].startswith("container:") and hc["CapDrop"] == ["ALL"], hc
    assert "SYS_ADMIN" not in (hc["CapAdd"] or []) and hc["LogConfig"]["Type"] == "none"
    assert "no-new-privileges" in hc["SecurityOpt"] and not hc["Privileged"]
    from polar_trial.sandbox.quotaroot import storage_opt_supported

    if storage_opt_supported():  # the session daemon's writable layers are capped (btrfs quotas)
        assert (hc.get("StorageOpt") or {}).get("size"), hc.get("StorageOpt")
    print(f"multi-container oracle trial: {time.monotonic() - t0:.1f} s")


def test_an_image_that_cannot_be_had_fails_fast_naming_it(dockerd, tmp_path):
    """A service image no registry gives and no stand-in covers: the sample fails within seconds,
    naming the image (a registry on this host's closed port 1: nothing leaves the machine)."""
    d = _task(tmp_path, """
        services:
          side:
            image: localhost:1/acme/sidecar:3
        """, solve="true\n", test="echo 1 > /logs/verifier/reward.txt\n")
    t0 = time.monotonic()
    row = _oracle(tmp_path, d)
    took = time.monotonic() - t0
    assert row["reward"] is None and "localhost:1/acme/sidecar:3" in (row["error"] or ""), row
    assert "unreachable here" in row["error"] and took < 60, (took, row["error"])
