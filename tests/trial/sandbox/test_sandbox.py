"""The sandbox interface and its backends: what a phase sees, the limits it gets, and the notes."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from polar_testing.listeners import CountingListener
from polar_trial.sandbox import (
    SandboxError,
    SandboxSpec,
    SandboxUnavailable,
    backend_class,
    get_sandbox,
)
from polar_trial.sandbox.apptainer import ApptainerSandbox
from polar_trial.sandbox.docker import DockerSandbox
from polar_trial.sandbox.podman import PodmanSandbox

PATH = "/usr/local/bin:/usr/bin:/bin"


def test_spec_maps_host_paths_inside(tmp_path):
    spec = SandboxSpec(tmp_path / "w", home_host=tmp_path / "h",
                       ro_binds=[(tmp_path / "tools", ""), (tmp_path / "ca.pem", "/etc/polar/ca.pem")])
    assert spec.inside(tmp_path / "w" / "src" / "a.py") == "/app/src/a.py"
    assert spec.inside(tmp_path / "w") == "/app"
    assert spec.inside(tmp_path / "h" / ".codex") == str(tmp_path / "h" / ".codex")  # HOME: same path
    assert spec.inside(tmp_path / "tools" / "bin") == str(tmp_path / "tools" / "bin")
    assert spec.inside(tmp_path / "ca.pem") == "/etc/polar/ca.pem"
    with pytest.raises(SandboxError, match="absolute"):
        SandboxSpec(tmp_path, workdir="app")


def test_auto_never_falls_back_to_the_unsafe_host_backend(monkeypatch):
    with pytest.raises(SandboxError, match="unknown sandbox"):
        get_sandbox("chroot")
    for name in ("bubblewrap", "docker", "podman", "apptainer"):
        monkeypatch.setattr(backend_class(name), "unavailable_reason", classmethod(lambda cls: "not here"))
    with pytest.raises(SandboxUnavailable, match="bubblewrap: not here; docker: not here; podman: not here; apptainer: not here"):
        get_sandbox("auto")
    assert get_sandbox("host").isolates is False


@pytest.fixture(scope="module")
def bwrap():
    try:
        return get_sandbox("bubblewrap")
    except SandboxUnavailable as e:
        pytest.skip(str(e))


def _run(sb, spec, script):
    log = spec.workdir_host.parent / "out.log"
    with open(log, "wb") as out:
        res = sb.run(spec, ["/bin/sh", "-c", script], stdout=out, stderr=subprocess.STDOUT)
    return res, log.read_text()


def test_what_a_phase_sees(bwrap, tmp_path, monkeypatch):
    monkeypatch.setenv("POLAR_LEAK_CHECK", "host-secret")
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "tool.txt").write_text("tool\n")
    spec = SandboxSpec(tmp_path / "w", home_host=tmp_path / "h", ro_binds=[(tools, "/tools")],
                       env={"PATH": PATH, "HOME": str(tmp_path / "h"), "ONLY": "this"}, timeout_s=20)
    res, log = _run(bwrap, spec, """
        echo "cwd=$(pwd) only=$ONLY leak=${POLAR_LEAK_CHECK:-none}"
        echo home > "$HOME/h.txt" && echo homeok
        cat /tools/tool.txt; echo x > /tools/new.txt 2>/dev/null || echo tools-ro
        echo work > w.txt
        cat /proc/1/cmdline | tr '\\0' ' ' | cut -c1-20; echo
        ls /sys/class/net 2>/dev/null | tr '\\n' ' '; echo
    """)
    assert res.returncode == 0, log
    assert "cwd=/app only=this leak=none" in log  # only spec.env, nothing inherited
    assert "homeok" in log and (tmp_path / "h" / "h.txt").read_text() == "home\n"
    assert "tool\n" in log and "tools-ro" in log and not (tools / "new.txt").exists()
    assert (tmp_path / "w" / "w.txt").read_text() == "work\n"
    assert "bwrap" in log  # PID 1 is bubblewrap's reaper: its own PID namespace
    assert "no network" in res.notes
    with pytest.raises(SandboxError, match="read-only"):  # no mount point under the host's /usr
        bwrap.run(SandboxSpec(tmp_path / "w", ro_binds=[(tools, "/usr/polar-tools")]), ["true"])


def test_timeout_kills_the_whole_sandbox(bwrap, tmp_path):
    spec = SandboxSpec(tmp_path / "w", env={"PATH": PATH}, timeout_s=1.0)
    t0 = time.monotonic()
    res, _ = _run(bwrap, spec, "sleep 30 & sleep 30; echo never > never.txt")
    assert res.timed_out and res.returncode < 0 and time.monotonic() - t0 < 5
    assert any("timed out after 1 s" in n for n in res.notes)
    time.sleep(0.2)
    assert not (tmp_path / "w" / "never.txt").exists()


def test_memory_limit_ends_the_phase_and_says_so(bwrap, tmp_path):
    spec = SandboxSpec(tmp_path / "w", env={"PATH": PATH}, memory_mb=64, timeout_s=20)
    res, log = _run(bwrap, spec, "/usr/bin/python3 -c \"b = bytearray(300 * 2**20); print('allocated')\"")
    if not any("memory limit enforced" in n for n in res.notes):
        pytest.skip("no memory cgroup here: " + "; ".join(res.notes))
    assert "allocated" not in log and res.returncode != 0
    assert any("memory limit hit" in n for n in res.notes), res.notes


PROBE = ("import socket,sys\ntry:\n s=socket.create_connection(('127.0.0.1',int(sys.argv[1])),timeout=3)\n"
         " print(s.recv(10).decode())\nexcept OSError as e: print('refused', e.errno)\n")


@pytest.mark.parametrize("network", [False, True])
def test_allow_internet_opens_the_network(bwrap, tmp_path, network):
    svc = CountingListener(b"HELLO", read_first=False)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "probe.py").write_text(PROBE)
    spec = SandboxSpec(tmp_path / "w", env={"PATH": PATH}, network=network, timeout_s=20)
    res, log = _run(bwrap, spec, f"/usr/bin/python3 probe.py {svc.port}")
    svc.sock.close()
    assert ("HELLO" in log) is network, log


def test_docker_command_line(tmp_path):
    spec = SandboxSpec(tmp_path / "w", home_host=tmp_path / "h", env={"A": "1"}, pids=64, memory_mb=512,
                       cpus=1.5, disk_mb=100, image="python:3.12-slim")
    (tmp_path / "w").mkdir()
    (tmp_path / "h").mkdir()
    a = DockerSandbox().argv(spec, tmp_path, "polar-x", ["python3", "/run/polar-sandbox/init.py"])
    line = " ".join(a)
    for part in ("--network none", "--pids-limit 64", "--memory 512m", "--cpus 1.5", "--cap-drop ALL",
                 f"-v {tmp_path / 'w'}:/app", "--workdir /app", "-e A=1", "/tmp:size=100m",
                 "--entrypoint python3 python:3.12-slim /run/polar-sandbox/init.py"):
        assert part in line, part
    with pytest.raises(SandboxError, match="needs an image"):
        DockerSandbox().argv(SandboxSpec(tmp_path / "w"), tmp_path, "polar-x", ["true"])


def test_podman_takes_dockers_command_line_keeping_the_callers_uid_when_rootless(tmp_path, monkeypatch):
    spec = SandboxSpec(tmp_path / "w", pids=64, memory_mb=512, image="python:3.12-slim")
    (tmp_path / "w").mkdir()
    line = " ".join(PodmanSandbox().argv(spec, tmp_path, "polar-x", ["python3", "init.py"]))
    assert line.startswith("podman run --rm") and "--network none" in line and "--pids-limit 64" in line
    assert "--userns" not in line or os.getuid() != 0
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    line = " ".join(PodmanSandbox().argv(spec, tmp_path, "polar-x", ["python3", "init.py"]))
    assert line.startswith("podman run --userns keep-id --rm")


def test_apptainer_command_line(tmp_path):
    spec = SandboxSpec(tmp_path / "w", home_host=tmp_path / "h", env={"A": "1"}, pids=64, memory_mb=512,
                       cpus=1.5, image="python:3.12-slim", ro_binds=[(tmp_path / "tools", "/opt/tools")])
    for d in ("w", "h", "tools"):
        (tmp_path / d).mkdir()
    a = ApptainerSandbox().argv(spec, tmp_path / "priv", "x", ["python3", "/run/polar-sandbox/init.py", "{}"])
    line = " ".join(a)
    for part in ("apptainer exec --containall --cleanenv --no-home", "--net --network none", "--pids-limit 64",
                 "--memory 512M", "--cpus 1.5", f"--bind {tmp_path / 'priv'}:/run/polar-sandbox:ro",
                 f"--bind {tmp_path / 'tools'}:/opt/tools:ro", f"--bind {tmp_path / 'w'}:/app:rw",
                 f"--bind {tmp_path / 'h'}:{tmp_path / 'h'}:rw", "--env A=1",
                 "--pwd /app docker://python:3.12-slim python3 /run/polar-sandbox/init.py {}"):
        assert part in line, part
    open_net = SandboxSpec(tmp_path / "w", network=True, image=str(tmp_path / "env.sif"))
    line = " ".join(ApptainerSandbox().argv(open_net, tmp_path, "x", ["true"]))
    assert "--network" not in line and f"--pwd /app {tmp_path / 'env.sif'} true" in line
    with pytest.raises(SandboxError, match="needs an image"):
        ApptainerSandbox().argv(SandboxSpec(tmp_path / "w"), tmp_path, "x", ["true"])


@pytest.mark.parametrize("backend", ["podman", "apptainer"])
def test_other_container_backends_run_a_phase(tmp_path, backend, request):
    if backend == "podman" and os.getuid() == 0 and shutil.which("podman"):
        request.getfixturevalue("podman_store")  # as root: the session's own store, never $POLAR_HOME's
    why = backend_class(backend).unavailable_reason()
    if why is not None:
        pytest.skip(f"{backend} sandbox not tested here: {why}")
    spec = SandboxSpec(tmp_path / "w", env={"PATH": PATH}, image="python:3.12-slim", timeout_s=300)
    res, log = _run(get_sandbox(backend), spec, "echo inside > f.txt")
    assert res.returncode == 0, log
    assert (tmp_path / "w" / "f.txt").read_text() == "inside\n"


def test_docker_runs_a_phase(tmp_path):
    why = DockerSandbox.unavailable_reason()
    if why is not None:
        pytest.skip(f"docker sandbox not tested here: {why}")
    spec = SandboxSpec(tmp_path / "w", env={"PATH": PATH}, image="python:3.12-slim", timeout_s=120)
    res, log = _run(get_sandbox("docker"), spec, "echo inside > f.txt; cat /etc/os-release | head -1")
    assert res.returncode == 0, log
    assert (tmp_path / "w" / "f.txt").read_text() == "inside\n"


@pytest.mark.parametrize("backend", [DockerSandbox, PodmanSandbox])
def test_container_backends_drop_every_capability_but_what_the_verifier_needs(tmp_path, backend):
    """Command line only (no daemon here): no capability, no new privileges, /tmp nosuid; the
    verifier and build steps (``userns_caps``) get back only changing uid and owning files."""
    (tmp_path / "w").mkdir()
    agent = " ".join(backend().argv(SandboxSpec(tmp_path / "w", image="x"), tmp_path, "n", ["true"]))
    assert "--cap-drop ALL" in agent and "--security-opt no-new-privileges" in agent and "--cap-add" not in agent
    # exec: a test may build a program into /tmp and run it (docker's tmpfs default is noexec)
    assert "exec,nosuid,nodev" in agent and "seccomp=unconfined" not in agent and "--privileged" not in agent
    verifier = " ".join(backend().argv(SandboxSpec(tmp_path / "w", image="x", userns_caps=True), tmp_path, "n", ["true"]))
    assert "--cap-add SETUID" in verifier and "--cap-add SYS_ADMIN" not in verifier


def test_apptainer_drops_roots_privileges_outside_the_verifier(tmp_path):
    (tmp_path / "w").mkdir()
    agent = " ".join(ApptainerSandbox().argv(SandboxSpec(tmp_path / "w", image="x"), tmp_path, "n", ["true"]))
    assert "--no-privs" in agent
    verifier = ApptainerSandbox().argv(SandboxSpec(tmp_path / "w", image="x", userns_caps=True), tmp_path, "n", ["true"])
    assert "--no-privs" not in verifier
