"""A Harbor trial as Harbor runs it, live on the session's private dockerd (``conftest.dockerd``:
``--userns-remap``, no container log): one environment per trial (``sandbox/trial.py``), the
oracle playing the sample. Each attack here is what a real task or sample does; each test was
watched failing with its defence taken away (the per-phase model of before, or the verifier's
namespaces removed): see the report in the commit that added it.

Tests that build the same image and whose attacks do not interfere share one trial (a rollout of
two samples where the samples differ). Times (2-core machine, load 4-7, stand-ins cached, the
session's daemon already up, 2026-12-07): the bootstrap's pytest 26-31 s, the oracle's leftovers
(healthcheck + server + apt/ssh-keygen) 25 s, the separate verifier 24 s, two trials + leftovers
22 s, the agent user 13 s, storage cap + full disk 12 s, the build step 10 s, the agent's own pids
limit 5-10 s, the others under 5 s; the module 132-145 s (the 13 tests before the merges: 177 s
in the same hour).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from polar_runtime.harnesses import Endpoint, get_preset
from polar_testing.harbortask import harbor_task as _task
from polar_testing.harbortask import why as _why

pytestmark = pytest.mark.docker


def _oracle(tmp_path: Path, task_dir: Path, samples: int = 1, **kw) -> list[dict]:
    from polar_runtime import rollout as r
    from polar_trial.tasks import load_tasks

    tasks = load_tasks(task_dir, container="docker")
    cfg = r.RolloutConfig(tasks=tasks, preset=get_preset("oracle"), endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
                          capture_dir=tmp_path / "cap", model="-", samples=samples, concurrency=samples, timeout=120,
                          settle_s=0.0, sandbox="docker", work_root=tmp_path / "work", **kw)
    df = r.run_rollout(cfg)
    return list(df.iter_rows(named=True))


def test_what_the_oracle_leaves_is_there_for_the_verifier(dockerd, tmp_path):
    """One trial, three things Harbor's model gives that per-phase containers lost (each scored 0
    there where Harbor scores 1):

    - ``[environment.healthcheck]`` is waited on before the agent: it fails twice, starting a server
      on :8001 the second time, then passes; the oracle finds that server up at once;
    - a server the oracle leaves running (``setsid python3 -m http.server``) is reached by the tests;
    - an apt install by the oracle (openssh-client, from the Debian registry through the egress
      filter, with the package manager's capabilities) and ``ssh-keygen -f ~/.ssh/id_rsa``, which
      makes ~/.ssh only where HOME is the passwd home (/root), are there for the tests."""
    d = _task(tmp_path, "leaves", solve="""
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8001/')" && echo up > /app/seen
        set -e
        apt-get update -qq && apt-get install -y -qq --no-install-recommends openssh-client >/dev/null
        ssh-keygen -q -t ed25519 -N '' -f ~/.ssh/id_rsa
        mkdir -p /srv/www && echo served > /srv/www/marker
        setsid python3 -m http.server 8000 --directory /srv/www >/dev/null 2>&1 < /dev/null &
        for i in $(seq 50); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/marker')" 2>/dev/null && break; sleep 0.1; done
        """, test="""
        ok=1
        [ -f /app/seen ] || { echo "FAILED: the healthcheck's server was not up for the oracle"; ok=0; }
        python3 -c "import urllib.request as u; assert u.urlopen('http://127.0.0.1:8000/marker').read() == b'served\\n'" \\
          || { echo "FAILED: the oracle's server is not reached"; ok=0; }
        ssh-keygen -l -f /root/.ssh/id_rsa || { echo "FAILED: no ssh-keygen or no /root/.ssh/id_rsa"; ok=0; }
        echo $ok > /logs/verifier/reward.txt
        """, base="python:3.11-slim")
    check = ('n=$(cat /tmp/n 2>/dev/null || echo 0); echo $((n+1)) > /tmp/n; [ $n -ge 1 ] && '
             '(setsid python3 -m http.server 8001 -d /tmp >/dev/null 2>&1 < /dev/null &); sleep 0.3; '
             'python3 -c "import urllib.request as u; u.urlopen(\\"http://127.0.0.1:8001/\\")"')
    (d / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n[agent]\ntimeout_sec = 120\n'
                                 f"[environment.healthcheck]\ncommand = '{check}'\ninterval_sec = 0.5\n"
                                 'start_period_sec = 5\nstart_interval_sec = 0.5\nretries = 5\n')
    rows = _oracle(tmp_path, d)
    assert rows[0]["reward"] == 1.0, _why(rows)
    assert "live trial" in rows[0]["sandbox_notes"] and "healthcheck passed" in rows[0]["sandbox_notes"]


def test_two_trials_at_once_share_nothing_and_their_leftovers_cannot_touch_the_verdict(dockerd, tmp_path):
    """Two samples at once, each writing a token of its own at /flag (refusing to run where one is
    already there), each leaving a process behind:

    - sample 0 answers right and leaves one that SIGKILLs every process it can (``kill -9 -1``):
      the verifier, in a PID namespace of its own, is neither seen nor killed: 1;
    - sample 1 answers wrong and leaves one that writes 1 into /logs/verifier/reward.txt in a loop
      (and into every /proc/*/root/logs/verifier and /run/polar-trial/x/* it finds) while test.sh
      writes 0: the verifier's /logs/verifier is a bind in its own mount namespace, the host's side
      of it covered in the environment's: 0."""
    d = _task(tmp_path, "leftovers", solve="""
        [ -e /flag ] && exit 3
        od -An -N8 -tx1 /dev/urandom | tr -d ' \\n' > /flag
        cp /flag /app/token
        case "$POLAR_SESSION" in
          *.s0) echo 42 > /app/answer
                setsid bash -c 'while :; do kill -9 -1; sleep 0.02; done' >/dev/null 2>&1 < /dev/null & ;;
          *) echo 41 > /app/answer; mkdir -p /logs/verifier
             setsid bash -c 'while :; do echo 1 > /logs/verifier/reward.txt; for f in /proc/[0-9]*/root/logs/verifier \\
               /run/polar-trial/x/*; do echo 1 > $f/reward.txt; done 2>/dev/null; sleep 0.02; done' >/dev/null 2>&1 < /dev/null & ;;
        esac
        """, test="""
        echo 0 > /logs/verifier/reward.txt
        sleep 2
        cmp -s /flag /app/token && grep -qx 42 /app/answer && echo 1 > /logs/verifier/reward.txt
        sleep 1
        """)
    rows = sorted(_oracle(tmp_path, d, samples=2), key=lambda r: r["sample_index"])
    assert [r["reward"] for r in rows] == [1.0, 0.0] and rows[1]["evaluator_status"] == "fail", _why(rows)
    assert "the agent phase's own pids limit: 4096" in rows[0]["sandbox_notes"]  # the rollout's default
    tokens = [(Path(r["workdir"]) / "token").read_text() for r in rows]  # neither found the other's /flag
    assert len(set(tokens)) == 2, tokens


def test_the_agents_capabilities_and_uid_seen_from_the_host(dockerd, tmp_path):
    """From the host's /proc: the agent phase's process holds the package manager's set (Docker's
    default, no SYS_ADMIN) in its bounding and effective sets, none with ``agent_privileged``
    False, and its root is the remapped uid, not the host's root."""
    from polar_trial.sandbox import SandboxSpec
    from polar_trial.sandbox.docker import DockerSandbox
    from polar_trial.sandbox.remap import remapped_root
    from polar_trial.sandbox.trial import PACKAGE_CAPS, LiveTrial, TrialConfig

    want = {True: sum(1 << c for c in PACKAGE_CAPS.values()), False: 0}
    assert remapped_root() is not None
    for privileged in (True, False):
        work = tmp_path / f"w{privileged}"
        with LiveTrial(DockerSandbox(), TrialConfig(image="debian:bookworm", workdir_host=work,
                                                    agent_privileged=privileged)) as trial:
            spec = SandboxSpec(workdir_host=work, env={"PATH": "/usr/bin:/bin"}, timeout_s=30)
            res = trial.view("agent").run(spec, ["bash", "-c", "setsid sleep 4242 >/dev/null 2>&1 < /dev/null &"])
            assert res.returncode == 0, res
            status = _host_status_of("sleep\x004242")
            assert int(status["CapEff"], 16) == want[privileged] and int(status["CapBnd"], 16) == want[privileged]
            assert status["Uid"].split()[0] == str(remapped_root())
            assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"


def test_an_agent_phase_is_held_to_its_own_pids_limit_under_the_trials(dockerd, tmp_path):
    """The trial's ``--pids-limit`` 120, the agent phase's own 24 (``phase_pids``: a sub-cgroup made
    from the host). The agent forks 100 ``sleep 300`` it leaves behind (dash stops at the first
    fork that fails), and once more in a later turn; then the verifier forks 60. With the trial's limit alone the agent's 100
    leftovers left the verifier too few pids; held to its own, the agent starts at most 24 and the
    verifier all of its 60."""
    from polar_trial.sandbox import SandboxSpec
    from polar_trial.sandbox.docker import DockerSandbox
    from polar_trial.sandbox.trial import LiveTrial, TrialConfig

    work = tmp_path / "w"
    with LiveTrial(DockerSandbox(), TrialConfig(image="debian:bookworm", workdir_host=work, pids=120,
                                                phase_pids={"agent": 24})) as trial:
        spec = SandboxSpec(workdir_host=work, env={"PATH": "/usr/bin:/bin"}, timeout_s=60)
        bomb = "i=0; while [ $i -lt 100 ]; do setsid sleep 300 </dev/null >/dev/null 2>&1 & i=$((i+1)); done"
        agent = trial.view("agent").run(spec, ["sh", "-c", bomb])
        again = trial.view("agent").run(spec, ["sh", "-c", bomb])  # a later turn shares the first's limit
        left = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p) == b"sleep\x00300\x00")
        assert agent.returncode != 0 and again.returncode != 0 and left <= 24, (agent, again, left)
        forks = "i=0; while [ $i -lt 60 ]; do sleep 2 & i=$((i+1)); done; wait"
        verifier = trial.view("verifier").run(spec, ["sh", "-c", forks])
        assert verifier.returncode == 0, verifier
        assert any("own pids limit: 24" in n for n in agent.notes), agent.notes


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def _host_status_of(cmdline: str) -> dict[str, str]:
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and cmdline in (p / "cmdline").read_bytes().decode(errors="replace"):
                return dict(line.split(":\t", 1) for line in (p / "status").read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
    raise AssertionError(f"no process {cmdline!r} on the host")


def test_the_daemon_keeps_no_container_log_and_remaps_root(dockerd):
    r = subprocess.run(["docker", "info", "--format", "{{.LoggingDriver}} {{json .SecurityOptions}}"],
                       capture_output=True, text=True, env=dict(os.environ), check=True)
    assert r.stdout.startswith("none ") and "name=userns" in r.stdout


def test_a_replaced_pytest_does_not_reach_a_separate_verifier(dockerd, tmp_path):
    """``[verifier] environment_mode = "separate"`` with ``artifacts``: the verifier runs in a fresh
    environment from the task's image with only the artifacts copied in. Sample 1 swaps the
    image's pytest for a script that always passes and writes a wrong answer (in the shared
    environment that scores 1); sample 0 writes the right answer. The image's ``pytest`` is a small
    runner of test functions (``RUN pip install pytest`` cost ~40 s of PyPI build here): what
    counts is that test.sh calls a tool of the image's, which the agent can replace."""
    d = _task(tmp_path, "sep", solve="""
        case "$POLAR_SESSION" in
          *.s0) echo 42 > /app/answer ;;
          *) echo 41 > /app/answer; printf '#!/bin/sh\\nexit 0\\n' > "$(command -v pytest)" ;;
        esac
        """, test="""
        pytest -q /tests/test_answer.py && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
        """, base="python:3.11-slim")
    (d / "task.toml").write_text('version = "1.0"\nartifacts = ["/app/answer"]\n[verifier]\ntimeout_sec = 60\n'
                                 'environment_mode = "separate"\n[agent]\ntimeout_sec = 120\n')
    (d / "environment" / "pytest").write_text(
        "#!/usr/bin/env python3\nimport runpy, sys\n\nfor name, f in runpy.run_path(sys.argv[-1]).items():\n"
        "    if name.startswith('test_'):\n        f()\n")
    (d / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nCOPY pytest /usr/local/bin/pytest\nRUN chmod 755 /usr/local/bin/pytest\nWORKDIR /app\n")
    (d / "tests" / "test_answer.py").write_text("def test_answer():\n    assert open('/app/answer').read().strip() == '42'\n")
    rows = sorted(_oracle(tmp_path, d, samples=2), key=lambda r: r["sample_index"])
    assert [r["reward"] for r in rows] == [1.0, 0.0], _why(rows)
    assert "an environment of its own" in rows[1]["sandbox_notes"]


def test_the_agent_user_runs_the_agent_with_its_passwd_home(dockerd, tmp_path):
    """``[agent] user = "agent"`` (refused before): the oracle runs as that user of the image, with
    its HOME from the image's /etc/passwd and the work dir its own; the verifier runs as root."""
    d = _task(tmp_path, "user", solve="""
        id -un > /app/who && echo "$HOME" >> /app/who && touch ~/made
        """, test="""
        [ "$(cat /app/who)" = "$(printf 'agent\\n/home/agent')" ] && [ -f /home/agent/made ] && [ "$(id -u)" = 0 ] \\
          && echo 1 > /logs/verifier/reward.txt || { cat /app/who; echo 0 > /logs/verifier/reward.txt; }
        """)
    (d / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n[agent]\ntimeout_sec = 120\n'
                                 'user = "agent"\n')
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nRUN useradd -m -u 1000 agent\nWORKDIR /app\n")
    rows = _oracle(tmp_path, d)
    assert rows[0]["reward"] == 1.0, _why(rows)


def test_the_storage_cap_covers_a_trials_writes_and_a_full_disk_still_gets_its_verdict(dockerd, tmp_path):
    """``storage_mb = 64``. The oracle writes 200 MiB of real data to /var (the container's own file
    system), then to the work dir (a disk image of the trial's): on the host's disk that was
    uncapped (300 MiB went through); on the daemon's btrfs data root (``quotaroot.py``: a quota
    group per container) each write fails at the cap. It leaves /var full and removes /logs.
    Uploading /tests and making /logs/verifier on that disk then fail with EDQUOT, and the verdict
    was None (no signal: a zero advantage the sample bought by filling the disk); the verifier's
    /logs and, when the upload fails, its /tests are tmpfs mounts of its own, so test.sh runs and
    says 0."""
    d = _task(tmp_path, "fill", solve="""
        dd if=/dev/zero of=/var/big bs=1M count=200 2>/dev/null; echo $? > /tmp/dd_rc
        du -sm /var/big | cut -f1 > /tmp/size_mb
        dd if=/dev/zero of=/app/big bs=1M count=200 2>/dev/null; echo $? > /tmp/app_rc
        rm -f /app/big; cp /tmp/dd_rc /tmp/size_mb /tmp/app_rc /app/
        rm -rf /logs; true
        """, test="""
        [ -f /app/answer ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
        """)
    (d / "task.toml").write_text('version = "1.0"\n[environment]\nstorage_mb = 64\n[verifier]\ntimeout_sec = 60\n'
                                 '[agent]\ntimeout_sec = 120\n')
    rows = _oracle(tmp_path, d)
    work = Path(rows[0]["workdir"])
    assert (work / "dd_rc").read_text().strip() != "0", _why(rows)
    assert int((work / "size_mb").read_text()) <= 64, _why(rows)
    assert (work / "app_rc").read_text().strip() != "0", _why(rows)  # the work dir: its disk image
    assert "btrfs quota group" in rows[0]["sandbox_notes"]
    assert rows[0]["reward"] == 0.0 and rows[0]["evaluator_status"] == "fail", _why(rows)


def test_a_build_step_cannot_commit_past_the_storage_cap(dockerd, tmp_path):
    """A RUN step writing 200 MiB outside the work dir under ``storage_mb = 64``: the step fails at
    the cap (its writable layer is quota'd), so nothing of it is committed."""
    from polar_runtime.task_commands import check_tasks, load_for_check

    d = _task(tmp_path / "set", "bigstep", solve="true\n", test="echo 1 > /logs/verifier/reward.txt\n")
    (d / "task.toml").write_text('version = "1.0"\n[environment]\nstorage_mb = 64\n')
    (d / "environment" / "Dockerfile").write_text(
        "FROM debian:bookworm\nRUN dd if=/dev/zero of=/opt/big bs=1M count=200\nWORKDIR /app\n")
    tasks, refused = load_for_check(str(d), container="docker")
    rows = check_tasks(tasks, work=tmp_path / "check", sandbox="docker", concurrency=1)
    assert rows[0]["status"] != "passed" and "dd if=/dev/zero" in rows[0]["verdict"], rows


#: the sample's library, named in the image's /etc/ld.so.preload: it marks every process it is
#: loaded into that holds CAP_SYS_ADMIN (only our init does) in the work dir
_PRELOAD_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    char line[256]; unsigned long long eff = 0; FILE *f = fopen("/proc/self/status", "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) if (!strncmp(line, "CapEff:", 7)) eff = strtoull(line + 7, 0, 16);
    fclose(f);
    if (eff & (1ULL << 21)) {
        int fd = open("/app/pwned", O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) { (void)!write(fd, "init\n", 5); close(fd); }
    }
}
"""


def test_the_bootstrap_pytest_ignores_what_the_sample_changed_in_the_images_python(dockerd, tmp_path):
    """TB2's test.sh form (``curl astral.sh/uv/.../install.sh | sh``, ``uvx -p 3.11 -w pytest==8.4.1
    -w pytest-json-ctrf==0.3.5 pytest ...``) in the live trial. Sample 0 answers right: 1 (the
    bootstrap's pytest and its ctrf plugin work). Sample 1 answers wrong and, as root in the
    environment, drops a ``sitecustomize.py`` into the image Python's standard library (at exit
    once pytest is imported: ``os._exit(0)``), a ``.pth`` into its site-packages and a
    ``usercustomize.py`` into root's user site (the same), and names a library of its own in
    /etc/ld.so.preload. On the image's Python (uvx's venv) the sitecustomize made pytest exit 0:
    reward 1; on ours (``pytestboot.py``: read-only, ``-I -S``) the verdict stays 0, and no
    program of ours (the init, with SYS_ADMIN) loads the sample's library."""
    d = _task(tmp_path, "site", solve="""
        case "$POLAR_SESSION" in
          *.s0) echo 42 > /app/answer; exit 0 ;;
        esac
        echo 41 > /app/answer
        hook='import atexit, os, sys
        atexit.register(lambda: "pytest" in sys.modules and os._exit(0))'
        std=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
        pure=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        user=$(python3 -c 'import site; print(site.getusersitepackages())')
        mkdir -p "$pure" "$user"
        rm -f "$std/sitecustomize.py"; printf '%s\\n' "$hook" > "$std/sitecustomize.py"
        printf '%s\\n' "$hook" > "$user/usercustomize.py"
        echo 'import atexit, os, sys; atexit.register(lambda: "pytest" in sys.modules and os._exit(0))' > "$pure/zz.pth"
        echo /opt/pre.so > /etc/ld.so.preload
        """, test="""
        curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
        source $HOME/.local/bin/env
        uvx -p 3.11 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json \\
          /tests/test_outputs.py -rA
        if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
        """, base="python:3.11-slim")
    subprocess.run(["cc", "-shared", "-fPIC", "-O", "-o", str(d / "environment" / "pre.so"), "-x", "c", "-"],
                   input=_PRELOAD_C, text=True, check=True)
    (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nCOPY pre.so /opt/pre.so\nWORKDIR /app\n")
    (d / "tests" / "test_outputs.py").write_text(
        "def test_answer():\n    assert open('/app/answer').read().strip() == '42'\n")
    rows = sorted(_oracle(tmp_path, d, samples=2), key=lambda r: r["sample_index"])
    assert [r["reward"] for r in rows] == [1.0, 0.0], _why(rows)
    vdirs = [Path(r["workdir"]).parent / "verifier" for r in rows]
    assert all("polar: BOOTSTRAP PYTEST" in (v / "test-output.txt").read_text() for v in vdirs), _why(rows)
    assert '"passed": 1' in (vdirs[0] / "ctrf.json").read_text()
    assert not (Path(rows[1]["workdir"]) / "pwned").exists(), "the sample's preload library ran in our init"
