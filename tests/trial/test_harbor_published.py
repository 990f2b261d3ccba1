"""Harbor tasks in the shapes published task sets use (Harbor's examples, Terminal-Bench 2 and its
contributions), one fixture per construct and task.toml key: each loads (or is refused, by name,
for that task only) where the loader before issue 37 refused, misread, ignored or crashed.

Loading is pure parsing (milliseconds); the few tests that build and check a task run the oracle
and nop in bubblewrap (a second or two each) and are skipped without it.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_trial.sandbox import available
from polar_trial.tasks import dockerfile as D
from polar_trial.tasks import load_tasks
from polar_trial.tasks.environment import build_env, local_mode_refusal
from polar_trial.tasks.harbor import load_dataset_report

needs_bwrap = pytest.mark.skipif(available().get("bubblewrap") is not None,
                                 reason=f"bubblewrap unavailable: {available().get('bubblewrap')}")

REWARD_IF = 'if {cond}; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n'


def task(root: Path, name: str = "t", *, toml: str = "", dockerfile: str = "FROM ubuntu:24.04\nWORKDIR /app\n",
         files: dict[str, str] | None = None, test_sh: str = REWARD_IF.format(cond="test -f /app/done"),
         solve_sh: str | None = "touch /app/done\n") -> Path:
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "task.toml").write_text('version = "1.0"\n' + textwrap.dedent(toml)
                                 + '\n[metadata]\nauthor_name = "x"\ndifficulty = "easy"\n')
    (d / "instruction.md").write_text("Do the thing.\n")
    (d / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    for rel, text in (files or {}).items():
        (d / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "environment" / rel).write_text(text)
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    if solve_sh is not None:
        (d / "solution").mkdir()
        (d / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve_sh)
    return d


def one(d: Path):
    (t,) = load_tasks(d)
    return t


# --- 1. what real Dockerfiles contain ------------------------------------------------------------

def test_copy_from_the_uv_image_uses_the_hosts_uv_or_is_refused_naming_it(tmp_path, monkeypatch):
    d = task(tmp_path, dockerfile="""\
        FROM python:3.13-slim-bookworm
        COPY --from=ghcr.io/astral-sh/uv:latest /uv /uvx /bin/
        WORKDIR /app
        """)
    monkeypatch.setattr(D, "_host_has", lambda p: f"/usr/bin/{p}")
    t = one(d)
    assert any("COPY --from=ghcr.io/astral-sh/uv:latest: the host's /usr/bin/uv, /usr/bin/uvx stand in" in n
               for n in t.environment.notes)
    monkeypatch.setattr(D, "_host_has", lambda p: None if p == "uvx" else f"/usr/bin/{p}")
    with pytest.raises(ValueError, match=r"Dockerfile:2: .*no image to copy from, and the host has no uvx"):
        load_tasks(d)


def test_copy_before_workdir_is_judged_where_docker_is_and_against_the_last_workdir(tmp_path):
    t = one(task(tmp_path, dockerfile="""\
        FROM ubuntu:24.04
        COPY app.py /srv/app/app.py
        COPY data/ /srv/app/data/
        WORKDIR /srv/app
        COPY requirements.txt .
        """, files={"app.py": "print(1)\n", "data/x.csv": "a\n", "requirements.txt": ""}))
    assert t.workdir == "/srv/app"
    assert [(s.src, s.dest) for s in t.environment.steps if s.kind == "copy"] == \
        [("app.py", "app.py"), ("data", "data/"), ("requirements.txt", "./")]
    with pytest.raises(ValueError, match=r"Dockerfile:2: .*destination /x.py is outside the work dir /app"):
        load_tasks(task(tmp_path, "rel-before-workdir", dockerfile="FROM ubuntu:24.04\nCOPY x.py x.py\nWORKDIR /app\n",
                        files={"x.py": ""}))


def test_heredoc_run_and_copy_are_documents_not_instructions(tmp_path):
    t = one(task(tmp_path, dockerfile="""\
        FROM python:3.12-slim
        WORKDIR /app
        RUN <<EOF
        set -e
        mkdir -p data
        # a comment of the script, not of the Dockerfile
        echo "COPY is a word here" > data/a.txt
        EOF
        RUN python3 - <<'PY'
        open("b.txt", "w").write("ENV X=1\\n")
        PY
        COPY <<EOF /app/config.ini
        [section]
        key = value
        EOF
        ENV AFTER=1
        """))
    runs = [s for s in t.environment.steps if s.kind == "run"]
    assert len(runs) == 2 and "# a comment of the script" in runs[0].text and "mkdir -p data" in runs[0].text
    assert runs[1].text.startswith("python3 - <<'PY'\nopen(") and runs[1].text.endswith("\nPY")
    (w,) = [s for s in t.environment.steps if s.kind == "write"]
    assert (w.dest, w.text) == ("config.ini", "[section]\nkey = value\n")
    assert t.environment.env == {"AFTER": "1"}
    with pytest.raises(ValueError, match=r"Dockerfile:3: .*here-document EOF is never closed"):
        load_tasks(task(tmp_path, "unclosed", dockerfile="FROM ubuntu:24.04\nWORKDIR /app\nRUN <<EOF\necho hi\n"))


def test_shell_form_run_starting_with_a_test_bracket_is_shell_form(tmp_path):
    t = one(task(tmp_path, dockerfile="""\
        FROM ubuntu:24.04
        WORKDIR /app
        RUN [ ! -e /app/marker ] && touch /app/marker || true
        RUN ["bash", "-c", "echo exec form"]
        """))
    runs = [s.text for s in t.environment.steps if s.kind == "run"]
    assert runs == ["[ ! -e /app/marker ] && touch /app/marker || true", "bash -c 'echo exec form'"]


def test_copy_dot_copies_the_build_context_and_never_crashes(tmp_path):
    t = one(task(tmp_path, dockerfile="FROM python:3.12\nWORKDIR /app\nCOPY . /app\nCOPY . .\n",
                 files={"src/main.py": "x\n", ".dockerignore": "*.log\n"}))
    assert [(s.src, s.dest) for s in t.environment.steps if s.kind == "copy"] == [(".", "./"), (".", "./")]


def test_other_published_dockerfile_habits_load(tmp_path):
    t = one(task(tmp_path, dockerfile="""\
        # syntax=docker/dockerfile:1
        ARG BASE=ubuntu:24.04
        FROM --platform=linux/amd64 ${BASE} AS base
        ARG DEBIAN_FRONTEND
        ARG TARGETARCH
        SHELL ["/bin/bash", "-o", "pipefail", "-c"]
        WORKDIR /app
        RUN --mount=type=cache,target=/root/.cache echo "$TARGETARCH" | tee arch.txt
        VOLUME /data
        USER root
        CMD ["bash"]
        """))
    run = next(s for s in t.environment.steps if s.kind == "run")
    assert run.shell == "-o pipefail" and t.environment.base_image == "ubuntu:24.04"
    assert any("ARG DEBIAN_FRONTEND has no default" in n for n in t.environment.notes)


@pytest.mark.parametrize("dockerfile", [
    "", "\x00\x01binary", "FROM", "COPY a", "WORKDIR", "FROM ubuntu:24.04\nENV \"unbalanced\n",
    "FROM ubuntu:24.04\nCOPY [\"a\",\n", "FROM ubuntu:24.04\nRUN\n", "FROM ubuntu:24.04\nARG 1bad=2\n",
    "FROM ubuntu:24.04\nWORKDIR /\n", "FROM ubuntu:24.04\nCOPY ../../etc/passwd /app/\n",
    "FROM ubuntu:24.04\nCOPY --from=0 /x /app/x\n", "FROM ubuntu:24.04\nRUN <<A <<B\na\nA\n",
])
def test_no_dockerfile_crashes_the_loader(tmp_path, dockerfile):
    d = task(tmp_path, dockerfile=dockerfile)
    tasks, refused = load_dataset_report(d)
    assert len(tasks) + len(refused) == 1
    for r in refused:
        assert "Dockerfile" in r.reason and "Traceback" not in r.reason


# --- 2. Harbor's task.toml keys -------------------------------------------------------------------

def test_environment_workdir_overrides_the_dockerfile(tmp_path):
    t = one(task(tmp_path, toml='[environment]\nworkdir = "/srv/task"\n',
                 dockerfile="FROM ubuntu:24.04\nWORKDIR /app\nCOPY x /srv/task/x\n", files={"x": ""}))
    assert t.workdir == "/srv/task"


@pytest.mark.parametrize("toml,internet", [
    ('[environment]\nnetwork_mode = "public"\n', True),
    ('[environment]\nnetwork_mode = "no-network"\n', False),
    ('[environment]\nallow_internet = true\nnetwork_mode = "public"\n', True),
])
def test_network_mode_is_honoured(tmp_path, toml, internet):
    assert one(task(tmp_path, toml=toml)).allow_internet is internet


@pytest.mark.parametrize("toml,why", [
    ('[environment]\nnetwork_mode = "allowlist"\n', 'network_mode = "allowlist" is not supported'),
    ('[environment]\nnetwork_mode = "no-network"\n[verifier]\nnetwork_mode = "public"\n',
     "[verifier] network_mode = 'public': a per-phase network mode"),
    ('[environment]\nnetwork_mode = "sometimes"\n', "network_mode must be public, no-network or allowlist"),
    ('artifacts = ["/tmp/answer.json"]\n', "artifacts: '/tmp/answer.json' is outside the work dir /app"),
    ('[verifier]\nenvironment_mode = "separate"\n', "a separate verifier environment"),
    ('[verifier.environment]\ncpus = 2\n', "a separate verifier environment"),
    ('[[steps]]\nname = "first"\nhealthcheck = { command = "true" }\n', "healthcheck is not supported by Polar's multi-step"),
    ('[agent]\nuser = "agent"\n', "[agent] user = 'agent': running a phase as another user"),
    ('[verifier]\nuser = "tester"\n', "[verifier] user = 'tester'"),
    ('[environment]\ngpus = 1\n', "gpus = 1"),
    ('[environment]\nos = "windows"\n', "os = 'windows'"),
])
def test_keys_the_local_mode_cannot_honour_are_refused_by_name(tmp_path, toml, why):
    with pytest.raises(ValueError) as err:
        load_tasks(task(tmp_path, toml=toml))
    assert why in str(err.value) and "task.toml" in str(err.value)


def test_environment_env_and_artifacts_in_the_work_dir_are_honoured(tmp_path):
    t = one(task(tmp_path, toml='artifacts = ["/app/out.json", "logs/"]\n\n[environment]\nmemory_mb = 2048\n\n'
                                '[environment.env]\nMODE = "strict"\n\n[agent]\nuser = "root"\n'))
    assert build_env(t)["MODE"] == "strict" and t.environment.env["MODE"] == "strict"
    assert "artifact /app/out.json: in the work dir, which the verifier shares" in t.notes


def test_a_steps_dir_without_steps_in_task_toml_is_a_single_step_task(tmp_path):
    """As in Harbor, only task.toml's [[steps]] make a multi-step task (tasks/steps.py)."""
    d = task(tmp_path)
    (d / "steps" / "one").mkdir(parents=True)
    assert one(d).steps == []


def test_docker_compose_environment_is_refused_by_name(tmp_path):
    d = task(tmp_path, files={"docker-compose.yaml": "services: {}\n"})
    with pytest.raises(ValueError, match="docker-compose.yaml: a multi-container task"):
        load_tasks(d)


# --- links that leave the task directory (issue 34) -----------------------------------------------

@pytest.fixture()
def secret(tmp_path) -> Path:
    s = tmp_path / "outside" / "secret.txt"
    s.parent.mkdir()
    s.write_text("HOST SECRET\n")
    return s


@pytest.mark.parametrize("where", ["instruction.md", "task.toml", "tests/helper.py", "tests",
                                   "solution/solve.sh", "environment/Dockerfile"])
def test_links_leaving_the_task_are_refused_naming_the_file(tmp_path, secret, where):
    d = task(tmp_path / "ds")
    p = d / where
    if p.is_dir():
        os.rename(p, d / "moved")
        os.symlink(secret.parent, p)
    else:
        p.unlink(missing_ok=True)
        os.symlink(secret, p)
    tasks, refused = load_dataset_report(tmp_path / "ds")
    assert not tasks and len(refused) == 1, refused
    assert str(p) in refused[0].reason and "outside the task directory" in refused[0].reason
    assert "HOST SECRET" not in refused[0].reason


@pytest.mark.parametrize("dockerfile,link", [
    ("FROM ubuntu:24.04\nWORKDIR /app\nCOPY data/ /app/data/\n", "data"),
    ("FROM ubuntu:24.04\nWORKDIR /app\nCOPY . .\n", "src/leak"),
    ("FROM ubuntu:24.04\nWORKDIR /app\nCOPY src /app/src\n", "src/leak"),
    ("FROM ubuntu:24.04\nWORKDIR /app\nCOPY *.txt /app/\n", "key.txt"),
])
def test_copy_sources_that_link_out_of_the_task_are_refused(tmp_path, secret, dockerfile, link):
    d = task(tmp_path / "ds", dockerfile=dockerfile, files={"src/main.py": "x\n"})
    target = secret.parent if link in ("data", "src/leak") else secret
    os.symlink(target, d / "environment" / link)
    with pytest.raises(ValueError) as err:
        load_tasks(d)
    assert f"environment/{link} is a link to {target}" in str(err.value) and "Dockerfile:3" in str(err.value)


def test_links_inside_the_task_are_fine(tmp_path):
    d = task(tmp_path, dockerfile="FROM ubuntu:24.04\nWORKDIR /app\nCOPY . .\n", files={"a.txt": "a"})
    os.symlink("a.txt", d / "environment" / "b.txt")
    os.symlink("../environment/a.txt", d / "tests" / "a.txt")
    assert one(d).environment.digest()


# --- 4. what the local mode cannot run, said before running it -----------------------------------

@pytest.mark.parametrize("dockerfile,test_sh,toml,why", [
    ("FROM python:3.12\nWORKDIR /app\nRUN curl -fsSL https://example.com/tool.tgz | tar xz\n", "true\n", "",
     "Dockerfile:3: `curl -fsSL https://example.com` fetches from example.com, not a package registry"),
    ("FROM ubuntu:24.04\nWORKDIR /app\n", "apt-get update\napt-get install -y curl\n"
     "curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh\n", "", "tests/test.sh:4: the verifier runs `curl"),
    ("FROM ubuntu:24.04\nWORKDIR /app\nRUN git clone --depth 1 https://github.com/x/y.git src\n", "true\n", "",
     "Dockerfile:3: `git clone --depth 1 https://github.com` fetches from github.com, not a package registry"),
    ("FROM ubuntu:24.04\nWORKDIR /app\nRUN apt-get update && apt-get install -y no-such-pkg-polar37\n", "true\n", "",
     "installs apt packages this host lacks (no-such-pkg-polar37)"),
])
def test_local_mode_refusals_name_the_file_and_line(tmp_path, monkeypatch, dockerfile, test_sh, toml, why):
    monkeypatch.setenv("POLAR_BUILD_NETWORK", "registries")  # builds restricted to the registries
    t = one(task(tmp_path, dockerfile=dockerfile, test_sh=test_sh, toml=toml))
    assert why in (local_mode_refusal(t) or "")


@pytest.mark.parametrize("backend", [False, "docker"])
def test_no_build_is_refused_by_a_network_rule(tmp_path, backend):
    """Build steps reach public hosts through the egress proxy (sandbox/egress.py), as Harbor's
    builds have the network: a fetch from GitHub or get.sdkman.io is not refused by reading."""
    t = one(task(tmp_path, dockerfile="FROM ubuntu:24.04\nWORKDIR /app\nRUN git clone https://github.com/x/y.git src"
                 " && curl -s https://get.sdkman.io | bash && cargo install ripgrep\n"))
    assert local_mode_refusal(t, builds_image=backend) is None


def test_registry_installs_are_fine_in_build_steps_and_the_verifier_but_not_the_oracle(tmp_path):
    """Build steps and the verifier reach the package registries (sandbox/egress.py); the oracle
    runs as the agent does, with nothing but the model."""
    t = one(task(tmp_path / "a", dockerfile="FROM python:3.12\nWORKDIR /app\nRUN pip install numpy==2.0\n",
                 test_sh="pip install pytest==8.4.1\nnpm install left-pad\n"))
    assert local_mode_refusal(t) is None
    t = one(task(tmp_path / "b", solve_sh="pip install requests\n"))
    assert "the oracle runs `pip install`" in (local_mode_refusal(t) or "")


def test_requests_to_the_sandbox_itself_are_not_downloads(tmp_path):
    t = one(task(tmp_path, test_sh='curl -s http://localhost:8080/health && curl -fsS "http://127.0.0.1:5000/api"\n'
                                   'wget -qO- http://0.0.0.0:3000/ ; curl "http://$HOST/x"\ncurl http://localhost\n'
                                   'git clone /app/repo /tmp/copy\n'))
    assert local_mode_refusal(t) is None


def test_with_the_network_downloads_are_not_refused(tmp_path):
    t = one(task(tmp_path, dockerfile="FROM python:3.12\nWORKDIR /app\nRUN pip install numpy\n",
                 toml='[environment]\nnetwork_mode = "public"\n'))
    assert local_mode_refusal(t) is None


# --- 3. `polar tasks check DATASET`: every task, one row each ------------------------------------

@needs_bwrap
def test_check_reports_every_task_of_a_dataset(tmp_path):
    ds = tmp_path / "ds"
    # passes: heredoc RUN, COPY before WORKDIR, COPY ., [environment.env], workdir key all built and used
    task(ds, "published-shapes", toml='[environment]\nworkdir = "/app"\n[environment.env]\nGREETING = "hi"\n',
         dockerfile="""\
            FROM python:3.12-slim
            COPY seed.txt /app/seed.txt
            WORKDIR /app
            COPY . ./ctx/
            RUN <<EOF
            set -e
            [ -f seed.txt ] && cp seed.txt built.txt
            EOF
            """, files={"seed.txt": "seed\n", "notes.log": "x\n", ".dockerignore": "*.log\n"},
         solve_sh='test "$GREETING" = hi && test -f built.txt && test -f ctx/seed.txt && test ! -e ctx/notes.log '
                  '&& touch /app/done\n')
    task(ds, "oracle-fails", solve_sh="exit 0\n")
    task(ds, "tests-nothing", test_sh="echo 1 > /logs/verifier/reward.txt\n")
    task(ds, "alpine", dockerfile="FROM alpine:3.20\nWORKDIR /app\n")
    task(ds, "copy-dot-missing", dockerfile="FROM ubuntu:24.04\nWORKDIR /app\nCOPY missing/ .\n")
    task(ds, "downloads", test_sh="curl -LsSf https://astral.sh/uv/install.sh | sh\n")
    task(ds, "build-fails", dockerfile="FROM ubuntu:24.04\nWORKDIR /app\nRUN mkdir -p /opt/tool\n")
    (ds / "no-instruction").mkdir()
    (ds / "no-instruction" / "task.toml").write_text("[agent]\ntimeout_sec = 1\n")
    (ds / "not-a-task").mkdir()  # neither file: not counted
    from polar_runtime.cli import app

    res = CliRunner().invoke(app, ["tasks", "check", str(ds), "--json", str(tmp_path / "rows.json")],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 1, res.output
    import json

    rows = {r["task"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert sorted(rows) == sorted(["published-shapes", "oracle-fails", "tests-nothing", "alpine", "copy-dot-missing",
                                   "downloads", "build-fails", "no-instruction"])
    status = {k: r["status"] for k, r in rows.items()}
    assert status == {"published-shapes": "passed", "oracle-fails": "failed", "tests-nothing": "failed",
                      "alpine": "refused", "copy-dot-missing": "refused", "downloads": "refused",
                      "build-fails": "refused", "no-instruction": "refused"}, rows
    assert rows["oracle-fails"]["verdict"] == "oracle failed: scored 0"
    assert rows["tests-nothing"]["verdict"].startswith("tests test nothing: nop scored 1")
    assert "cannot stand in for image 'alpine:3.20'" in rows["alpine"]["verdict"]
    assert rows["alpine"]["verdict"].startswith("alpine/environment/Dockerfile:1:")
    assert "source 'missing/' not found" in rows["copy-dot-missing"]["verdict"]
    assert "tests/test.sh:2: the verifier runs `curl" in rows["downloads"]["verdict"]
    assert "could not build the environment" in rows["build-fails"]["verdict"] and "line 3" in rows["build-fails"]["verdict"]
    assert "needs task.toml and instruction.md" in rows["no-instruction"]["verdict"]
    assert "1 passed, 2 failed, 5 refused of 8 tasks" in res.output and "Traceback" not in res.output
    assert "published-shapes: note: FROM python:3.12-slim" in res.output


def test_a_dataset_of_broken_directories_gives_one_refused_row_each_and_exit_1(tmp_path):
    """No directory stops the check: a broken dataset.toml, a task.toml that is a folder, a
    non-UTF-8 instruction, keys of the wrong type, no tests/test.sh: one row each, reasons kept
    verbatim (``[environment]`` is not swallowed as markup), exit 1, no traceback."""
    ds = tmp_path / "ds"
    (ds / "toml-is-a-dir" / "task.toml").mkdir(parents=True)
    task(ds, "bad-utf8")
    (ds / "bad-utf8" / "instruction.md").write_bytes(b"\xff\xfe")
    task(ds, "workdir-int", toml="[environment]\nworkdir = 5\n")
    task(ds, "agent-not-table", toml="agent = 3\n")
    task(ds, "no-tests")
    (ds / "no-tests" / "tests" / "test.sh").unlink()
    (ds / "dataset.toml").write_text("tasks = [\n")
    from polar_runtime.cli import app

    res = CliRunner().invoke(app, ["tasks", "check", str(ds), "--json", str(tmp_path / "rows.json")],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 1, res.output
    import json

    rows = {r["task"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert {k: r["status"] for k, r in rows.items()} == dict.fromkeys(
        ["dataset.toml", "toml-is-a-dir", "bad-utf8", "workdir-int", "agent-not-table", "no-tests"], "refused")
    assert "workdir-int/task.toml: [environment] workdir must be an absolute path below /, not 5" in res.output
    assert "agent-not-table/task.toml: [agent] must be a table" in res.output
    assert "cannot read instruction.md" in rows["bad-utf8"]["verdict"] and "no tests/test.sh" in rows["no-tests"]["verdict"]
    assert "0 passed, 0 failed, 6 refused of 6 tasks" in res.output and "Traceback" not in res.output
