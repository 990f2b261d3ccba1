"""Issue 53 on a real daemon (the session's private dockerd): a request above the host's runs,
clamped, where docker refuses the request as asked; a phase the OOM killer hit says so; a pull
with no registry fails at once; a task.toml docker_image no registry gives is built from its
Dockerfile, said in the check row; an oracle OOM-killed in a live trial at a limit clamped to the
host is reported as such. The image is the host's static busybox imported (~1 s), so no stand-in
is bootstrapped. Measured on the 2-core CI machine kind, shared with other test runs: 25-35 s with
the session's daemon up (the check of a built docker_image task 10-14 s, the live-trial OOM 7 s).
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

from polar_runtime.sandbox import SandboxSpec
from polar_runtime.sandbox.docker import DockerSandbox
from polar_runtime.tasks.model import Task, host_cpus

pytestmark = pytest.mark.docker
IMAGE = "polar-test/busybox:1"


@pytest.fixture(scope="module")
def daemon(request, tmp_path_factory):
    """The session's private dockerd (tests/runtime/sandbox/conftest.py) and a busybox image on it."""
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

        from polar_runtime.sandbox.dockerd import PrivateDockerd

        own = PrivateDockerd(Path(tempfile.mkdtemp(prefix="pd-", dir="/tmp")))
        own.start(timeout_s=120)
        old, os.environ["DOCKER_HOST"] = os.environ.get("DOCKER_HOST"), own.host
    root = tmp_path_factory.mktemp("bb")
    tar = root / "bb.tar"
    with tarfile.open(tar, "w") as tf:
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
    from polar_runtime.tasks import imagebuild

    monkeypatch.setattr(imagebuild, "_UNREACHABLE", {})
    t0 = time.monotonic()
    ok, why = imagebuild.pull_image("ghcr.io/polar-test/none:1")
    assert not ok and "ghcr.io" in why and time.monotonic() - t0 < 10, why


def test_a_docker_image_no_registry_answers_is_built_from_its_dockerfile_and_the_row_says_so(daemon, tmp_path,
                                                                                          monkeypatch):
    """``polar tasks check --sandbox docker`` on a task whose task.toml names a prebuilt image on an
    unreachable registry: the Dockerfile is built, the oracle passes, and the row's notes say why the
    image was built, also when the built image is found again (its label)."""
    from polar_runtime.task_commands import check_tasks
    from polar_runtime.tasks import imagebuild, load_tasks
    from polar_runtime.tasks.environment import apply_steps

    monkeypatch.setattr(imagebuild, "_UNREACHABLE", {})
    d = tmp_path / "ds" / "prebuilt"
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text('version = "1.0"\n[environment]\ndocker_image = "ghcr.io/polar-test/none:1"\n')
    (d / "instruction.md").write_text("do it\n")
    (d / "environment" / "Dockerfile").write_text(f"FROM {IMAGE}\nWORKDIR /app\nCOPY a.txt a.txt\n")
    (d / "environment" / "a.txt").write_text("a\n")
    (d / "solution" / "solve.sh").write_text("touch /app/done\n")
    (d / "tests" / "test.sh").write_text("test -f /app/done && test -f /app/a.txt && echo 1 > /logs/verifier/reward.txt"
                                         " || echo 0 > /logs/verifier/reward.txt\n")
    (task,) = load_tasks(d, "docker")
    (row,) = check_tasks([task], work=tmp_path / "work", sandbox="docker")
    assert row["status"] == "passed", row
    said = [n for n in row["notes"] if n.startswith("[environment] docker_image ghcr.io/polar-test/none:1 not pulled (")]
    assert len(said) == 1 and "ghcr.io" in said[0] and said[0].endswith("environment/Dockerfile built instead"), row
    tag, notes = imagebuild.build_task_image(task, DockerSandbox(), tmp_path / "logs", apply_steps)
    assert said[0] in notes and any("reused" in n for n in notes), notes


def test_an_oracle_out_of_memory_at_the_clamped_limit_in_a_live_trial_is_reported_as_such(daemon, tmp_path,
                                                                                          monkeypatch):
    """The task asks for 4 GiB; this "host" has 128 MiB (patched): clamped, and the oracle, run by
    ``docker exec`` in the trial's live container, eats memory until the OOM killer ends it. The
    daemon's OOMKilled stays false for an exec; the container's cgroup counts the kill, and the
    row says "out of memory at the clamped limit", not "oracle failed"."""
    from polar_runtime.task_commands import check_tasks
    from polar_runtime.tasks import load_tasks, model

    monkeypatch.setattr(model, "host_memory_mb", lambda: 128)
    d = tmp_path / "ds" / "hungry"
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text('version = "1.0"\n[environment]\nmemory_mb = 4096\n')
    (d / "instruction.md").write_text("do it\n")
    (d / "environment" / "Dockerfile").write_text(f"FROM {IMAGE}\nWORKDIR /app\n")
    (d / "solution" / "solve.sh").write_text("sh -c 'x=a; while true; do x=$x$x; done' && touch /app/done\n")
    (d / "tests" / "test.sh").write_text("test -f /app/done && echo 1 > /logs/verifier/reward.txt"
                                         " || echo 0 > /logs/verifier/reward.txt\n")
    (task,) = load_tasks(d, "docker")
    assert task.clamped == {"memory_mb": 4096}
    (row,) = check_tasks([task], work=tmp_path / "work", sandbox="docker")
    assert (row["status"], row["verdict"]) == ("refused", "out of memory at the clamped limit: the oracle was "
                                               "OOM-killed at 128 MiB, this host's memory; the task asks for 4096 MiB"), row
