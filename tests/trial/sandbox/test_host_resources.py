"""What a sample can make the *host* spend or do after its phase (red-team findings against the
hardened sandbox, as root): its output, the copy of its disk image back to the host (hard links,
sparse files, a 3,000-level tree), the build's COPY over a link a RUN step planted, kernel counts
charged to the host's root, connections through the model relay. Each test fails on the code
before its fix."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from polar_trial.sandbox import SandboxSpec
from polar_trial.sandbox.base import OUTPUT_HEAD, OUTPUT_TAIL
from polar_trial.sandbox.relay import MAX_CONNECTIONS

HOST_HOME = Path(os.path.expanduser("~"))
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the root caller's attacks need root (CI runs as root)")


def phase(sb, tmp_path, script: str, **kw):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    spec = SandboxSpec(work, home_host=home, env={"PATH": "/usr/bin:/bin", "HOME": str(home)},
                       timeout_s=kw.pop("timeout_s", 60), **kw)
    out = tmp_path / "out.log"
    with open(out, "wb") as fh:
        res = sb.run(spec, ["bash", "-c", textwrap.dedent(script)], stdout=fh, stderr=fh)
    return res, work, out


def test_a_phases_output_is_bounded_on_the_host(sandbox, tmp_path):
    """200 MiB printed: the host keeps the head and the tail and says what it dropped."""
    res, _, out = phase(sandbox, tmp_path, "head -c 200M /dev/zero | tr '\\0' x; echo; echo THE-END")
    size = out.stat().st_size
    assert size <= OUTPUT_HEAD + OUTPUT_TAIL + 200, f"{size / 2**20:.0f} MiB of output on the host"
    tail = out.read_bytes()[-100:]
    assert b"THE-END" in tail and b"bytes of output dropped" in out.read_bytes()[OUTPUT_HEAD:OUTPUT_HEAD + 100]


def _unique_bytes(root: Path) -> int:
    seen, total = set(), 0
    for p in root.rglob("*"):
        st = p.lstat()
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def test_hard_links_and_sparse_files_do_not_multiply_the_cap_on_the_host(sandbox, tmp_path):
    res, work, _ = phase(sandbox, tmp_path, """
        head -c 30M /dev/urandom > big
        i=0; while [ $i -lt 20 ]; do ln big l$i; i=$((i+1)); done
        truncate -s 60M sparse
    """, disk_mb=64)
    assert (work / "l7").stat().st_ino == (work / "big").stat().st_ino, "hard links must stay links"
    assert (work / "sparse").stat().st_size == 60 * 2**20
    used = _unique_bytes(work)
    assert used <= 66 * 2**20, f"the phase's 64 MiB came back as {used / 2**20:.0f} MiB on the host"


def test_a_very_deep_tree_is_no_crash_for_the_host(sandbox, tmp_path):
    """3,000 levels: copied back as far as MAX_DEPTH (the rest counted), then cleared by the next
    phase's staging, without a RecursionError or an fd per level."""
    script = "python3 -c \"import os\nfor _ in range(3000):\n    os.mkdir('d'); os.chdir('d')\nopen('x', 'w').write('x')\""
    res, work, _ = phase(sandbox, tmp_path, script, disk_mb=64)
    assert res.returncode == 0, res.notes
    assert (work / "d").is_dir()
    res2, work, _ = phase(sandbox, tmp_path, "rm -rf d; echo again > again.txt", disk_mb=64)
    assert (work / "again.txt").read_text() == "again\n", res2.notes


def test_the_builds_copy_never_writes_through_a_link_a_run_step_planted(sandbox, tmp_path):
    from polar_trial.tasks import load_tasks
    from polar_trial.tasks.environment import BuildError, prepare_workdir

    victim_dir = HOST_HOME / f".polar-victim-{uuid.uuid4().hex[:8]}"
    victim_dir.mkdir(mode=0o700)
    victim = victim_dir / "config.py"
    victim.write_text("HOST\n")
    victim.chmod(0o600)
    try:
        d = tmp_path / "ds" / "t"
        for sub in ("environment/src", "tests", "solution"):
            (d / sub).mkdir(parents=True)
        (d / "task.toml").write_text('version = "1.0"\n')
        (d / "instruction.md").write_text("t\n")
        (d / "environment" / "src" / "config.py").write_text("OVERWRITTEN\n")
        (d / "environment" / "Dockerfile").write_text(
            f"FROM python:3.11-slim\nWORKDIR /app\nRUN mkdir pkg && ln -s {victim} pkg/config.py\nCOPY src/ /app/pkg/\n")
        (d / "tests" / "test.sh").write_text("#!/usr/bin/env bash\necho 1 > /logs/verifier/reward.txt\n")
        (d / "solution" / "solve.sh").write_text("#!/usr/bin/env bash\ntrue\n")
        [task] = load_tasks(d)
        work = tmp_path / "work"
        try:
            prepare_workdir(task, work, sandbox, tmp_path / "builds")
        except BuildError:
            pass  # refused: fine, as long as nothing went through the link
        assert victim.read_text() == "HOST\n", "the build's COPY wrote through a planted link"
        assert oct(victim.stat().st_mode & 0o777) == "0o600"
        if (work / "pkg" / "config.py").exists():
            assert not (work / "pkg" / "config.py").is_symlink()
    finally:
        shutil.rmtree(victim_dir, ignore_errors=True)


def test_kernel_counts_are_charged_to_the_sandbox_not_to_the_hosts_root(sandbox, tmp_path):
    """The phase takes every inotify instance its uid may have and holds them; the host's root
    can still make one (the user namespace is the sandbox uid's, so the kernel charges it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    script = textwrap.dedent("""
        python3 -c "
        import ctypes, time
        libc = ctypes.CDLL(None)
        n = 0
        while libc.inotify_init() >= 0:
            n += 1
        open('held', 'w').write(str(n))
        time.sleep(6)"
    """)
    t = threading.Thread(target=phase, args=(sandbox, tmp_path, script), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    held = tmp_path / "work" / "held"
    while not held.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert held.exists() and int(held.read_text() or 0) > 0, "the phase made no inotify instance"
        fd = libc.inotify_init()
        assert fd >= 0, f"the host's root could not make an inotify instance (errno {ctypes.get_errno()})"
        os.close(fd)
    finally:
        t.join(30)


def test_a_connection_flood_is_capped_per_relay(sandbox, tmp_path):
    """160 connections held open through the model relay: at most MAX_CONNECTIONS reach the
    host at once (the rest wait), so the host neither spawns hundreds of threads nor starves the
    shared proxy."""
    server = socket.create_server(("127.0.0.1", 0), backlog=512)
    port, conns, peak = server.getsockname()[1], [], [0]

    def accept() -> None:
        while True:
            try:
                c, _ = server.accept()
            except OSError:
                return
            conns.append(c)
            peak[0] = max(peak[0], sum(1 for x in conns if x.fileno() != -1))

    threading.Thread(target=accept, daemon=True).start()
    script = f"""
        python3 -c "
        import socket, time
        held = []
        for _ in range(160):
            try:
                s = socket.create_connection(('127.0.0.1', {port}), timeout=1)
                s.sendall(b'x')
                held.append(s)
            except OSError:
                pass
        time.sleep(2)"
    """
    try:
        phase(sandbox, tmp_path, script, proxy_port=port, timeout_s=30)
    finally:
        server.close()
        for c in conns:
            c.close()
    assert 0 < peak[0] <= MAX_CONNECTIONS, f"{peak[0]} connections reached the host at once"
