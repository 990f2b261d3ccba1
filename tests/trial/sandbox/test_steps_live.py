"""A multi-step task in one live environment (``steprun.py`` over ``sandbox/trial.py``) on the
session's private dockerd, the oracle playing the sample: what a step leaves outside the work dir
(a running server, a file under /srv) is there for the next step and for its tests; each step's
tests are its own (/tests holds only them, as Harbor empties it between steps). Watched failing
with /tests merged across steps (step one's files seen by step two's tests). ~25 s, the daemon up."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from polar_runtime.harnesses import Endpoint, get_preset

pytestmark = pytest.mark.docker


def test_what_a_step_leaves_running_is_there_for_the_next_step_and_its_tests(dockerd, tmp_path):
    from polar_runtime import rollout as r
    from polar_trial.tasks import load_tasks

    d = tmp_path / "steps"
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
    (d / "task.toml").write_text('version = "1.0"\n[[steps]]\nname = "serve"\nmin_reward = 1\n[[steps]]\nname = "use"\n'
                                 '[verifier]\ntimeout_sec = 60\n[agent]\ntimeout_sec = 60\n')
    for name, solve, test in (
        ("serve", """
            mkdir -p /srv/www && echo served > /srv/www/marker
            setsid python3 -m http.server 8000 --directory /srv/www >/dev/null 2>&1 < /dev/null &
            for i in $(seq 50); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/marker')" 2>/dev/null && break; sleep 0.1; done
            """, """
            test -f /tests/only-serve && test ! -f /tests/only-use \\
              && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
            """),
        ("use", """
            python3 -c "import urllib.request as u; open('/app/got', 'wb').write(u.urlopen('http://127.0.0.1:8000/marker').read())"
            """, """
            test -f /tests/only-use && test ! -f /tests/only-serve && [ "$(cat /app/got)" = served ] \\
              && python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/marker')" \\
              && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
            """)):
        s = d / "steps" / name
        (s / "solution").mkdir(parents=True)
        (s / "tests").mkdir()
        (s / "instruction.md").write_text(f"Step {name}.\n")
        (s / "solution" / "solve.sh").write_text("#!/bin/bash\n" + textwrap.dedent(solve))
        (s / "tests" / "test.sh").write_text("#!/bin/bash\nset -x\n" + textwrap.dedent(test))
        (s / "tests" / f"only-{name}").write_text("x\n")
    cfg = r.RolloutConfig(tasks=load_tasks(d, container="docker"), preset=get_preset("oracle"),
                          endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
                          capture_dir=tmp_path / "cap", model="-", samples=1, timeout=60, settle_s=0.0,
                          sandbox="docker", work_root=tmp_path / "work")
    (row,) = r.run_rollout(cfg).iter_rows(named=True)
    steps = json.loads(row["step_rewards"] or "[]")
    outputs = {str(p): p.read_text(errors="replace")[-400:] for p in Path(row["verifier_dir"]).rglob("*")
               if p.is_file() and "verifier" in p.parts}
    assert [(s["name"], s["reward"]) for s in steps] == [("serve", 1.0), ("use", 1.0)], \
        (row["error"], steps, outputs, row["sandbox_notes"][-1500:])
    assert row["reward"] == 1.0 and "live trial" in row["sandbox_notes"]
