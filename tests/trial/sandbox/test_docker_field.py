"""Issue 53 on a real daemon (the session's private dockerd): a request above the host's runs,
clamped, where docker refuses the request as asked; a phase the OOM killer hit says so; a pull
with no registry fails at once; a task.toml docker_image no registry gives is built from its
Dockerfile, said in the check row; an oracle OOM-killed in a live trial at a limit clamped to the
host is reported as such. The image is the host's static busybox imported (~1 s), so no stand-in
is bootstrapped. Measured on the 2-core CI machine kind, shared with other test runs: 30-35 s with
the session's daemon up (the one check of both tasks, side by side, ~20 s of it).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from polar_trial.sandbox import SandboxSpec
from polar_trial.sandbox.docker import DockerSandbox
from polar_trial.tasks.model import Task, host_cpus

pytestmark = pytest.mark.docker
IMAGE = "polar-test/busybox:1"


@pytest.fixture(scope="module")
def daemon(request, tmp_path_factory):
    """The session's private dockerd (tests/trial/sandbox/conftest.py) and a busybox image on it."""
    busybox = shutil.which("busybox")
    if os.getuid() != 0 or busybox is None:
        pytest.skip("needs root (a private dockerd) and the host's busybox")
    try:
        d = request.getfixturevalue("dockerd")
    except pytest.FixtureLookupError:  # no session daemon in this checkout: one of this module's own
        d = None
    own = None
    if d is None:
        import tempfile

        from polar_trial.sandbox.dockerd import PrivateDockerd

        own = PrivateDockerd(Path(tempfile.mkdtemp(prefix="pd-", dir="/tmp")))
        own.start(timeout_s=120)
        old, os.environ["DOCKER_HOST"] = os.environ.get("DOCKER_HOST"), own.host
    root = tmp_path_factory.mktemp("bb")
    tar = root / "bb.tar"
    with tarfile.open(tar, "w") as tf:
        # every directory an entry of its own, 0755: one the daemon makes for a missing parent is
        # 0700, which a phase under the remapped root cannot enter ("Permission denied: /bin/sh")
        info = tarfile.TarInfo("bin")
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tf.addfile(info)
        tf.add(busybox, arcname="bin/busybox")
        for applet in ("sh", "echo", "true", "sleep", "test", "[", "cat", "touch", "mkdir"):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tf.addfile(info)
        bash = b'#!/bin/sh\nexec /bin/sh "$@"\n'  # the phases run `bash script`
        info = tarfile.TarInfo("bin/bash")
        info.size, info.mode = len(bash), 0o755
        tf.addfile(info, io.BytesIO(bash))
        for empty in ("tmp", "app", "proc", "dev", "etc"):
            info = tarfile.TarInfo(empty)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(info)
    subprocess.run(["docker", "import", str(tar), IMAGE], check=True, capture_output=True)
    try:
        yield d or own
    finally:
        if own is not None:
            own.stop()
            shutil.rmtree(own.root, ignore_errors=True)
            if old is None:
                os.environ.pop("DOCKER_HOST", None)
            else:
                os.environ["DOCKER_HOST"] = old


def _spec(tmp_path: Path, **limits) -> SandboxSpec:
    return SandboxSpec(workdir_host=tmp_path / "work", workdir="/app", image=IMAGE, timeout_s=60, **limits)


def test_a_cpu_request_above_the_hosts_runs_clamped_where_docker_refuses_it_as_asked(daemon, tmp_path):
    task = Task(id="t", instruction="x", cpus=float(host_cpus() * 32))
    task.fit_to_host()
    sb = DockerSandbox()
    res = sb.run(_spec(tmp_path, **task.limits()), ["sh", "-c", "echo ran"])
    assert res.returncode == 0 and f"cpus = {host_cpus() * 32:g} clamped" in task.notes[0], res
    # as asked, the daemon refuses it ("Range of CPUs is from 0.01 to 2.00"): the build that failed
    asked = SandboxSpec(workdir_host=tmp_path / "w2", workdir="/app", image=IMAGE, timeout_s=60, cpus=host_cpus() * 32.0)
    with open(tmp_path / "out", "wb") as out:
        res = sb.run(asked, ["sh", "-c", "echo ran"], stdout=out, stderr=out)
    assert res.returncode != 0 and "Range of CPUs" in (tmp_path / "out").read_text()


def test_a_phase_the_oom_killer_hit_says_so(daemon, tmp_path):
    """A grandchild eats memory past the container's 64 MiB; the phase's own shell survives and
    exits 3: the daemon's OOMKilled still says what happened, and the note names the limit."""
    hog = "sh -c 'x=a; while true; do x=\"$x$x\"; done'; echo child $?; exit 3"
    res = DockerSandbox().run(_spec(tmp_path, memory_mb=64), ["sh", "-c", hog])
    assert res.returncode == 3
    assert "memory limit hit: the OOM killer ended a process of the phase at 64 MiB (docker says OOMKilled)" \
        in res.notes, res.notes
    ok = DockerSandbox().run(_spec(tmp_path, memory_mb=64), ["sh", "-c", "true"])
    assert not any("memory limit hit" in n for n in ok.notes)


def test_a_pull_with_no_registry_fails_at_once_naming_it(daemon, monkeypatch):
    from polar_trial.tasks import imagebuild

    monkeypatch.setattr(imagebuild, "_UNREACHABLE", {})
    t0 = time.monotonic()
    ok, why = imagebuild.pull_image("ghcr.io/polar-test/none:1")
    assert not ok and "ghcr.io" in why and time.monotonic() - t0 < 10, why


def _task(root: Path, name: str, toml: str, dockerfile: str, solve: str, test: str, files=()) -> Path:
    d = root / name
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text('version = "1.0"\n' + toml)
    (d / "instruction.md").write_text("do it\n")
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    for rel, text in files:
        (d / "environment" / rel).write_text(text)
    (d / "solution" / "solve.sh").write_text(solve)
    (d / "tests" / "test.sh").write_text(test + " && echo 1 > /logs/verifier/reward.txt || echo 0 > "
                                         "/logs/verifier/reward.txt\n")
    return d


@pytest.fixture(scope="module")
def checked(daemon, tmp_path_factory):
    """One ``polar tasks check --sandbox docker`` of two tasks, side by side (one check: ~10 s less
    than two) on a "host" of 128 MiB (patched): ``prebuilt`` names a task.toml docker_image no
    registry gives; ``hungry`` asks for 4 GiB (clamped) and its oracle eats memory until the OOM
    killer ends it."""
    from polar_runtime.task_commands import check_tasks
    from polar_trial.tasks import imagebuild, load_tasks, model

    root = tmp_path_factory.mktemp("checked")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(imagebuild, "_UNREACHABLE", {})
        mp.setattr(model, "host_memory_mb", lambda: 128)
        _task(root / "ds", "prebuilt", '[environment]\ndocker_image = "ghcr.io/polar-test/none:1"\n',
              f"FROM {IMAGE}\nWORKDIR /app\nCOPY a.txt a.txt\n", "touch /app/done\n",
              "test -f /app/done && test -f /app/a.txt", files=[("a.txt", "a\n")])
        _task(root / "ds", "hungry", "[environment]\nmemory_mb = 4096\n", f"FROM {IMAGE}\nWORKDIR /app\n",
              "sh -c 'x=a; while true; do x=$x$x; done' && touch /app/done\n", "test -f /app/done")
        tasks = load_tasks(root / "ds", "docker")
        rows = check_tasks(tasks, work=root / "work", sandbox="docker")
        yield {t.id: t for t in tasks}, {r["task"]: r for r in rows}, root


def test_a_docker_image_no_registry_answers_is_built_from_its_dockerfile_and_the_row_says_so(checked):
    """The Dockerfile is built, the oracle passes, and the row's notes say why the image was built,
    also when the built image is found again (its label)."""
    from polar_trial.tasks import imagebuild
    from polar_trial.tasks.environment import apply_steps

    tasks, rows, root = checked
    row = rows["prebuilt"]
    assert row["status"] == "passed", row
    said = [n for n in row["notes"] if n.startswith("[environment] docker_image ghcr.io/polar-test/none:1 not pulled (")]
    assert len(said) == 1 and "ghcr.io" in said[0] and said[0].endswith("environment/Dockerfile built instead"), row
    tag, notes = imagebuild.build_task_image(tasks["prebuilt"], DockerSandbox(), root / "logs", apply_steps)
    assert said[0] in notes and any("reused" in n for n in notes), notes


def test_an_oracle_out_of_memory_at_the_clamped_limit_in_a_live_trial_is_reported_as_such(checked):
    """The oracle runs by ``docker exec`` in the trial's live container: the daemon's OOMKilled
    stays false for an exec, the container's cgroup counts the kill, and the row says "out of
    memory at the clamped limit", not "oracle failed"."""
    tasks, rows, _ = checked
    assert tasks["hungry"].clamped == {"memory_mb": 4096}
    row = rows["hungry"]
    assert (row["status"], row["verdict"]) == ("refused", "out of memory at the clamped limit: the oracle was "
                                               "OOM-killed at 128 MiB, this host's memory; the task asks for 4096 MiB"), row
