"""Harbor task directories: loading (task.toml fields), the local mode's Dockerfile subset and its
refusals, the verifier (reward.txt / reward.json, hidden tests), oracle and nop, `polar tasks check`.

Everything runs in the real sandbox (bubblewrap) with the oracle, nop or a shell-command harness:
no model, a few seconds.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_runtime import rollout as r
from polar_runtime.harnesses import Endpoint, get_preset
from polar_trial.sandbox import available
from polar_trial.tasks import load_tasks, write_harbor_dir
from polar_trial.tasks.dockerfile import DockerfileError
from polar_runtime.task_commands import check_tasks

pytestmark = pytest.mark.skipif(available().get("bubblewrap") is not None,
                                reason=f"bubblewrap unavailable: {available().get('bubblewrap')}")

def make_task(root: Path, name: str = "t", *, toml: str = "", dockerfile: str = "FROM python:3.11-slim\nWORKDIR /app\n",
              test_sh: str = "echo 1 > /logs/verifier/reward.txt\n", solve_sh: str | None = "true\n",
              files: dict[str, str] | None = None, instruction: str = "do it") -> Path:
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "task.toml").write_text('version = "1.0"\n' + textwrap.dedent(toml))
    (d / "instruction.md").write_text(instruction + "\n")
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    for rel, text in (files or {}).items():
        (d / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "environment" / rel).write_text(text)
    (d / "tests" / "test.sh").write_text("#!/usr/bin/env bash\n" + test_sh)
    if solve_sh is not None:
        (d / "solution").mkdir()
        (d / "solution" / "solve.sh").write_text("#!/usr/bin/env bash\n" + solve_sh)
    return d


def rollout(tmp_path: Path, tasks: list[r.Task], harness: str = "oracle", command: str = "", **kw) -> list[dict]:
    cfg = r.RolloutConfig(tasks=tasks, preset=get_preset(harness, command), capture_dir=tmp_path / "cap",
                          endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"), model="m",
                          settle_s=0.0, **{"timeout": 30.0, "samples": 1, **kw})
    return sorted(r.run_rollout(cfg).to_dicts(), key=lambda row: row["task_id"])


def test_task_toml_fields_reach_the_task(tmp_path):
    d = make_task(tmp_path, toml="""
        [agent]
        timeout_sec = 42.0
        [verifier]
        timeout_sec = 7
        env = { LEVEL = "3" }
        [solution]
        env = { HINT = "x" }
        [environment]
        cpus = 2
        memory = "1G"
        storage_mb = 512
        allow_internet = true
        gpus = 0
        weird_key = 1
        [polar]
        followups = ["and then?"]
    """)
    (t,) = load_tasks(d)
    assert (t.id, t.timeout, t.verifier_timeout, t.cpus, t.memory_mb, t.storage_mb, t.allow_internet) == \
        ("t", 42.0, 7.0, 2.0, 1024, 512, True)
    assert t.verifier_env == {"LEVEL": "3"} and t.solution_env == {"HINT": "x"} and t.followups == ["and then?"]
    assert t.notes == ["task.toml [environment] weird_key ignored"] and t.workdir == "/app"
    (d / "task.toml").write_text('[agent]\ntimeout_sec = "soon"\n')
    with pytest.raises(ValueError, match=r"task.toml: \[agent\] timeout_sec"):
        load_tasks(d)


def test_dataset_order_and_builtin_names(tmp_path):
    for n in ("b", "a", "c"):
        make_task(tmp_path, n)
    assert [t.id for t in load_tasks(tmp_path)] == ["a", "b", "c"]
    (tmp_path / "dataset.toml").write_text('tasks = ["c", "a"]\n')
    assert [t.id for t in load_tasks(tmp_path)] == ["c", "a", "b"]
    assert [t.id for t in load_tasks("followups")] == ["notes-file", "dir-then-file"]
    with pytest.raises(FileNotFoundError, match="built-in: coding, followups"):
        load_tasks("no-such-set")


@pytest.mark.parametrize("dockerfile,line,why", [
    ("FROM alpine:3.19\nWORKDIR /app\n", 1, "cannot stand in for image 'alpine:3.19'"),
    ("FROM python:3.12\nFROM debian:12\n", 2, "multi-stage"),
    ("FROM python:3.12\nCOPY --from=build /x /app/x\n", 2, "COPY --from"),
    ("FROM python:3.12\nWORKDIR /app\nCOPY a.txt /etc/a.txt\n", 3, "outside the work dir"),
    ("FROM python:3.12\nADD https://example.com/x.tgz /app/\n", 2, "URL"),
    ("FROM python:3.12\nUSER nobody\n", 2, "USER other than root"),
    ("FROM python:3.12\nWORKDIR /app\nCOPY a.txt b.txt\nWORKDIR /srv\n", 3, "outside the work dir /srv"),
    ("FROM ubuntu:24.04\n# comment\nRUN apt-get update && \\\n  true\nSHELL [\"/bin/sh\"]\n", 5, "SHELL other than bash or sh with -c is not supported"),
])
def test_unsupported_dockerfile_lines_are_refused_by_line(tmp_path, dockerfile, line, why):
    d = make_task(tmp_path, dockerfile=dockerfile, files={"a.txt": "a"})
    with pytest.raises(DockerfileError) as err:
        load_tasks(d)
    assert f"Dockerfile:{line}:" in str(err.value) and why in str(err.value)


def test_local_mode_builds_workdir_copy_env_run_and_hides_the_tests(tmp_path):
    """WORKDIR, COPY of the build context, ENV and RUN (in the sandbox at build time) make the work
    dir; the agent sees ENV and the work dir, never tests/ (placed at /tests only afterwards), nor
    the task directory; the verifier sees both and its env from task.toml."""
    d = make_task(
        tmp_path / "ds", "build",
        toml="[verifier]\nenv = { WANT = \"built\" }\n",
        dockerfile=textwrap.dedent("""\
            FROM python:3.11-slim
            ARG GREETING=hello
            WORKDIR /srv/proj
            ENV MODE=built PATH=/srv/proj/bin:$PATH
            COPY src/ ./src/
            COPY data.txt .
            RUN mkdir -p bin && printf '#!/bin/sh\\necho tool-ran\\n' > bin/tool && chmod +x bin/tool \\
                && echo "$GREETING $MODE" > made-by-run.txt
            CMD ["python3"]
        """),
        files={"src/main.py": "print('main')\n", "data.txt": "data\n"},
        test_sh=textwrap.dedent("""\
            cd /srv/proj
            test "$(cat agent-saw.txt)" = "built|tool-ran|no-tests|no-task-dir" && test "$WANT" = built \\
              && test -f /tests/test.sh && echo 0.75 > /logs/verifier/reward.txt
            echo verifier-output
        """))
    (t,) = load_tasks(d)
    assert t.workdir == "/srv/proj" and any("CMD ignored" in n for n in t.environment.notes)
    agent = ('printf "%s|%s|%s|%s" "$MODE" "$(tool)" "$(test -e /tests && echo tests || echo no-tests)" '
             f'"$(test -e {d} && echo task-dir || echo no-task-dir)" > agent-saw.txt; '
             'test "$PWD" = /srv/proj && test -f src/main.py && grep -q "hello built" made-by-run.txt')
    (row,) = rollout(tmp_path, [t], "generic", agent)
    assert row["status"] == "ok", row["error"]
    assert (row["reward"], row["evaluator_status"]) == (0.75, "pass"), row["evaluator_output"]
    assert "verifier-output" in row["evaluator_output"]
    vdir = Path(row["verifier_dir"])
    assert (vdir / "reward.txt").read_text().strip() == "0.75" and "verifier-output" in (vdir / "test-output.txt").read_text()
    assert row["sandbox"] == "bubblewrap"


def test_failed_build_fails_every_sample_with_the_line(tmp_path):
    d = make_task(tmp_path / "ds", "broken", dockerfile="FROM debian:12\nWORKDIR /app\nRUN echo building; exit 3\n")
    rows = rollout(tmp_path, load_tasks(d) * 1, samples=2)
    assert [row["status"] for row in rows] == ["failed", "failed"]
    assert all("line 3" in row["error"] and "exited 3" in row["error"] and "building" in row["error"] for row in rows)


@pytest.mark.parametrize("test_sh,want", [
    ('echo \'{"reward": 0.5, "other": 2}\' > /logs/verifier/reward.json', (0.5, "pass")),
    ('echo \'{"score": 0}\' > /logs/verifier/reward.json', (0.0, "fail")),
    ('echo \'{"a": 1, "b": 2}\' > /logs/verifier/reward.json', (None, "error")),
    ("echo yes > /logs/verifier/reward.txt", (None, "error")),
    ("exit 0", (None, "error")),
    ("exit 3", (None, "error")),
    # a hung verifier is the sample's failure (its work is what the tests run): 0, not "no signal"
    ("sleep 30", (0.0, "timeout")),
    # a tampered verdict scores 0 (issue 50): a link, a FIFO, a directory, an oversize file where
    # the reward should be, or the test runner killed by a signal that was not our timeout
    ("ln -s /etc/hostname /logs/verifier/reward.txt", (0.0, "fail", "tampered")),
    ("mkfifo /logs/verifier/reward.txt", (0.0, "fail", "tampered")),
    ("mkdir /logs/verifier/reward.txt", (0.0, "fail", "tampered")),
    ("head -c 70000 /dev/zero | tr '\\0' 1 > /logs/verifier/reward.txt", (0.0, "fail", "tampered")),
    ("ln -s /etc/hostname /logs/verifier/reward.json", (0.0, "fail", "tampered")),
    ("kill -9 $$", (0.0, "fail", "tampered")),
])
def test_reward_files(tmp_path, test_sh, want):
    d = make_task(tmp_path / "ds", toml="[verifier]\ntimeout_sec = 2\n", test_sh=test_sh + "\n")
    (row,) = rollout(tmp_path, load_tasks(d), "nop")
    assert (row["reward"], row["evaluator_status"]) == want[:2], row["evaluator_output"]
    if want[2:] == ("tampered",):
        assert "verdict tampered" in row["evaluator_output"] and "verdict tampered" in row["sandbox_notes"]


def test_allow_internet_never_opens_the_hosts_network(tmp_path):
    """With or without allow_internet the agent phase has its own network namespace with only a
    loopback; the verifier reaches the package registries through the filtering proxy only."""
    probe = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort > ifaces.txt"
    write = ('test "$(cat ifaces.txt)" = lo && case "$HTTPS_PROXY" in http://127.0.0.1:*) true ;; *) false ;; esac'
             ' && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n')
    make_task(tmp_path / "ds", "closed", test_sh=write)
    make_task(tmp_path / "ds", "opened", toml="[environment]\nallow_internet = true\n", test_sh=write)
    rows = {row["task_id"]: row for row in rollout(tmp_path, load_tasks(tmp_path / "ds"), "generic", probe)}
    for name in ("closed", "opened"):
        assert rows[name]["reward"] == 1.0, (Path(rows[name]["workdir"]) / "ifaces.txt").read_text()


def test_oracle_runs_the_solution_with_its_env_in_the_agent_sandbox(tmp_path):
    d = make_task(tmp_path / "ds", toml='[solution]\nenv = { ANSWER = "42" }\n',
                  solve_sh='test "$PWD" = /app && test ! -e /tests && echo "$ANSWER" > answer.txt\n',
                  test_sh='test "$(cat /app/answer.txt)" = 42 && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n')
    (row,) = rollout(tmp_path, load_tasks(d))
    assert row["status"] == "ok" and row["reward"] == 1.0, (row["error"], row["evaluator_output"])
    (nop,) = rollout(tmp_path / "n", load_tasks(d), "nop")
    assert nop["reward"] == 0.0 and not (Path(nop["workdir"]) / "answer.txt").exists()


def test_tasks_check_command_flags_broken_tasks(tmp_path):
    make_task(tmp_path, "good", solve_sh="touch done\n",
              test_sh="test -f /app/done && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    make_task(tmp_path, "always-passes", solve_sh="true\n")
    make_task(tmp_path, "bad-oracle", solve_sh="exit 1\n", test_sh="echo 0 > /logs/verifier/reward.txt\n")
    make_task(tmp_path, "no-solution", solve_sh=None)
    rows = {row["task"]: row for row in check_tasks(load_tasks(tmp_path), work=tmp_path / "w")}
    assert rows["good"]["verdict"] == "ok" and (rows["good"]["oracle"], rows["good"]["nop"]) == (1.0, 0.0)
    assert "tests test nothing: nop scored 1, as high as the oracle's 1" in rows["always-passes"]["verdict"]
    assert rows["bad-oracle"]["verdict"].startswith("oracle failed: scored 0") and rows["bad-oracle"]["status"] == "failed"
    assert "test nothing" not in rows["bad-oracle"]["verdict"]
    assert "no solution/solve.sh" in rows["no-solution"]["verdict"]
    from polar_runtime.cli import app

    res = CliRunner().invoke(app, ["tasks", "check", str(tmp_path / "good")])
    assert res.exit_code == 0 and "all 1 tasks pass" in res.output, res.output
    res = CliRunner().invoke(app, ["tasks", "check", str(tmp_path / "always-passes")])
    assert res.exit_code == 1 and "0 passed, 1 failed, 0 refused of 1 tasks" in res.output, res.output
    assert "tests test nothing" in res.output, res.output


def test_jsonl_shorthand_is_the_same_task_and_converts_to_a_harbor_dir(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"id": "sh", "instruction": "fix", "files": {"calc.py": "x = 1\n"}, "setup": "cp calc.py orig.py",
                             "evaluator": "grep -q 'x = 2' calc.py && test -f orig.py",
                             "reference": "sed -i 's/1/2/' calc.py", "followups": ["more"]}) + "\n")
    (t,) = load_tasks(p)
    assert [s.kind for s in t.environment.steps] == ["write", "run"] and t.has_solution and t.has_tests
    rows = check_tasks([t], work=tmp_path / "w1")
    assert (rows[0]["oracle"], rows[0]["nop"], rows[0]["verdict"]) == (1.0, 0.0, "ok")
    d = write_harbor_dir(t, tmp_path / "ds")
    (h,) = load_tasks(d)
    assert (h.id, h.instruction, h.followups, h.root) == ("sh", "fix", ["more"], d.resolve())
    assert [s.kind for s in h.environment.steps] == ["copy", "run"]
    rows = check_tasks([h], work=tmp_path / "w2")
    assert (rows[0]["oracle"], rows[0]["nop"], rows[0]["verdict"]) == (1.0, 0.0, "ok")


def test_apt_steps_are_satisfied_by_the_host_or_refused_by_line(tmp_path):
    """RUN apt-get install cannot write the read-only host system: such a step is skipped when the
    host has every package (noted), refused with the line and the missing packages otherwise."""
    ok = make_task(tmp_path / "ds", "has-bash", dockerfile="FROM debian:12\nWORKDIR /app\n"
                   "RUN apt-get update && apt-get install -y --no-install-recommends bash coreutils \\\n"
                   "  && rm -rf /var/lib/apt/lists/*\nRUN apt-get update\n",
                   test_sh="echo 1 > /logs/verifier/reward.txt\n")
    missing = make_task(tmp_path / "ds", "needs-pkg", dockerfile="FROM debian:12\nWORKDIR /app\n"
                        "RUN apt-get install -y bash no-such-package-polar\n")
    rows = {row["task_id"]: row for row in rollout(tmp_path, load_tasks(ok.parent), "nop")}
    assert rows["has-bash"]["reward"] == 1.0, rows["has-bash"]["error"]
    assert "line 3: apt step skipped, its packages are on the host: bash coreutils" in rows["has-bash"]["sandbox_notes"]
    assert "line 3" in rows["needs-pkg"]["error"] and "not on this host: no-such-package-polar" in rows["needs-pkg"]["error"]
    assert missing.exists()

