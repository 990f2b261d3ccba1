"""Escape attempts by a sample's "solution" (a shell script, as a half-trained policy might write),
run through the real bubblewrap sandbox: each one is contained, the host is unchanged, the run
returns, and the result's notes say what happened.

Run against the unsafe pass-through backend to see what the sandbox prevents (these then fail, as
they did on the code before the sandbox):

    POLAR_SANDBOX_UNDER_TEST=host .venv/bin/python -m pytest tests/trial/sandbox/test_adversarial.py

(the real fork bomb and ``kill -9 -1`` never run outside a PID namespace of their own, nor the bomb
without an enforced pids cap: they would take the shared machine down; the bounded spawner next to
it shows a missing process cap instead).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from polar_testing.listeners import CountingListener
from polar_trial.sandbox import SandboxSpec

BACKEND = os.environ.get("POLAR_SANDBOX_UNDER_TEST", "bubblewrap")
REPO = Path(__file__).resolve().parents[3]
HOST_HOME = Path(os.path.expanduser("~"))
HOST_PID_NS = os.readlink("/proc/self/ns/pid")


@pytest.fixture
def sample(tmp_path):
    """A sample's work dir and isolated HOME, a sibling sample's dir holding a secret."""
    work, home, other = tmp_path / "work", tmp_path / "home", tmp_path / "other-sample"
    for d in (work, home, other):
        d.mkdir()
    (other / "answer.txt").write_text("OTHER-SAMPLE-SECRET\n")
    return work, home, other


@pytest.fixture
def host_marker():
    """A path in the host user's HOME (removed afterwards), for a planted key or an escape write."""
    made: list[Path] = []

    def make(kind: str) -> Path:
        p = HOST_HOME / f".polar-sandbox-test-{kind}-{uuid.uuid4().hex[:8]}"
        made.append(p)
        return p

    yield make
    for p in made:
        if p.is_dir():
            for f in p.iterdir():
                f.unlink()
            p.rmdir()
        elif p.exists():
            p.unlink()


def run(sandbox, work: Path, home: Path, script: str, **kw):
    spec = SandboxSpec(work, home_host=home, env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
                                                   **kw.pop("env", {})}, timeout_s=kw.pop("timeout_s", 20), **kw)
    t0 = time.monotonic()
    with open(work.parent / "out.log", "wb") as out:
        res = sandbox.run(spec, ["/bin/sh", "-c", textwrap.dedent(script)], stdout=out, stderr=subprocess.STDOUT)
    return res, time.monotonic() - t0, (work.parent / "out.log").read_text(errors="replace")


def test_reads_host_keys_repository_and_other_samples(sandbox, sample, host_marker):
    work, home, other = sample
    keydir = host_marker("ssh")
    keydir.mkdir()
    (keydir / "id_rsa").write_text("-----BEGIN FAKE PRIVATE KEY-----\nHOSTKEY-SECRET\n")
    res, _, log = run(sandbox, work, home, f"""
        cat {keydir}/id_rsa {HOST_HOME}/.ssh/id_rsa {other}/answer.txt {REPO}/pyproject.toml > stolen.txt 2>/dev/null
        ls {HOST_HOME} {REPO} /tmp >> stolen.txt 2>/dev/null
        exit 0
    """)
    stolen = (work / "stolen.txt").read_text()
    assert "HOSTKEY-SECRET" not in stolen, "the planted key in the host's HOME was readable"
    assert "OTHER-SAMPLE-SECRET" not in stolen, "another sample's work dir was readable"
    assert "[project]" not in stolen and "pyproject.toml" not in stolen, "the repository was visible"
    assert keydir.name not in stolen and other.name not in stolen, "host HOME or /tmp was listable"
    assert res.returncode == 0


def test_writes_outside_its_work_dir(sandbox, sample, host_marker):
    work, home, _ = sample
    in_home, in_tmp = host_marker("write"), Path("/tmp") / f"polar-sandbox-test-{uuid.uuid4().hex[:8]}"
    try:
        res, _, log = run(sandbox, work, home, f"""
            echo pwned > {in_home}; echo pwned > {in_tmp}; echo pwned > ../escaped.txt
            echo pwned > {work.parent}/escaped2.txt; echo pwned > {REPO}/escaped.txt
            echo pwned > /usr/escaped.txt; echo pwned > /etc/escaped.txt
            echo inside > ok.txt
        """)
        assert not in_home.exists(), "wrote into the host user's HOME"
        assert not in_tmp.exists(), "wrote into the host's /tmp"
        assert not (work.parent / "escaped.txt").exists() and not (work.parent / "escaped2.txt").exists()
        assert not (REPO / "escaped.txt").exists(), "wrote into the repository"
        assert not Path("/usr/escaped.txt").exists() and not Path("/etc/escaped.txt").exists()
        assert (work / "ok.txt").read_text() == "inside\n", "its own work dir must stay writable"
    finally:
        for p in (in_tmp, REPO / "escaped.txt", Path("/usr/escaped.txt"), Path("/etc/escaped.txt")):
            p.unlink(missing_ok=True)


PROBE = r"""
import json, socket, sys
proxy, secret, key = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def probe(port):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=3)
        s.sendall(b"hello\n")
        return s.recv(100).decode() or "empty"
    except OSError as e:
        return f"refused:{e.errno}"
def http(head, body=b""):
    try:
        s = socket.create_connection(("127.0.0.1", proxy), timeout=10)
        extra = f"content-length: {len(body)}\r\n" if body else ""
        s.sendall(head.encode() + extra.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return int(data.split(b" ", 2)[1]) if data else 0
    except OSError as e:
        return f"refused:{e.errno}"
host = f"host: 127.0.0.1:{proxy}\r\ncontent-type: application/json\r\n"
out = {"secret": probe(secret)}
for name, body in (("status", b""), ("pause", b"{}"), ("policy_version", b'{"policy_version": 998}'),
                   ("resume", b'{"policy_version": 998}'),
                   ("sessions", b'{"session_id": "intruder", "group_id": "g-other"}')):
    out[name] = http(f"{'POST' if body else 'GET'} /_polar/{name} HTTP/1.1\r\n{host}", body)
out["connect"] = http(f"CONNECT 127.0.0.1:{secret} HTTP/1.1\r\nhost: 127.0.0.1:{secret}\r\n")
out["connect_pypi"] = http("CONNECT pypi.org:443 HTTP/1.1\r\nhost: pypi.org:443\r\n")
out["absolute"] = http(f"GET http://127.0.0.1:{secret}/ HTTP/1.1\r\nhost: 127.0.0.1:{secret}\r\n")
call = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi #scenario:text"}]}).encode()
out["model_call"] = http(f"POST /v1/chat/completions HTTP/1.1\r\n{host}authorization: Bearer {key}\r\n", call)
print(json.dumps(out))
"""


def test_connects_to_host_loopback_but_only_reaches_the_proxy(sandbox, sample, tmp_path):
    """The real proxy as ``polar rollout`` runs it (regular mode, no passthrough, session keys): from
    inside, the sample reaches only its port; there the control API answers 401 and changes
    nothing, CONNECT and absolute-form requests to a host service are refused, and its own model
    call (with the key the runner registered) is served."""
    import json

    from polar_proxy.process import ProxyProcess
    from polar_testing.scripted_upstream import ServerThread

    work, home, _ = sample
    secret = CountingListener(b"SECRET-SERVICE")
    (work / "probe.py").write_text(PROBE)
    try:
        with ServerThread(served_model="scripted") as up, \
                ProxyProcess(up.url, tmp_path / "captures", mode="regular", confdir=tmp_path / "mitm",
                             served_model="scripted", passthrough=False,
                             options={"polar_require_session_key": True}) as proxy:
            proxy.control.set_policy_version(5)
            key = proxy.control.register_sessions([{"session_id": "probe", "task_id": "t"}])["keys"]["probe"]
            before = proxy.control.status()
            res, _, log = run(sandbox, work, home,
                              f"/usr/bin/python3 probe.py {proxy.port} {secret.port} {key} > probe.txt",
                              proxy_port=proxy.port)
            after = proxy.control.status()
            sessions = proxy.control.sessions()["sessions"]
    finally:
        secret.close()
    got = json.loads((work / "probe.txt").read_text())
    assert secret.accepted == 0 and "SECRET-SERVICE" not in json.dumps(got), "reached a host service other than the proxy"
    assert got["model_call"] == 200, f"the proxy must stay reachable: {got} {log}"
    assert all(got[n] == 401 for n in ("status", "pause", "policy_version", "resume", "sessions")), got
    assert got["connect"] == 403 and got["connect_pypi"] == 403 and got["absolute"] == 403, got
    assert after["paused"] is False and after["policy_version"] == 5 and "intruder" not in sessions
    assert after["control_refused"] == before["control_refused"] + 5 and after["refused"] == before["refused"] + 3
    assert any("127.0.0.1:%d" % proxy.port in n for n in res.notes), res.notes


PROXY_SCRIPT = "import socket,time\ns=socket.create_server(('127.0.0.1',0));print(s.getsockname()[1],flush=True)\ntime.sleep(120)"


def test_kills_the_proxy(sandbox, sample):
    work, home, _ = sample
    proxy = subprocess.Popen([sys.executable, "-c", PROXY_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proxy.stdout.readline())
        # "kill -9 -1" (every process it may signal) only in a PID namespace of its own, checked by
        # the script itself: in the host's (the host backend, or a sandbox broken to share it) it
        # would kill every process on the machine
        res, _, log = run(sandbox, work, home, f"""
            kill -9 {proxy.pid}
            echo tried > tried.txt
            [ "$(readlink /proc/self/ns/pid)" != "{HOST_PID_NS}" ] && kill -9 -1
        """, proxy_port=port)
        assert (work / "tried.txt").exists(), log
        time.sleep(0.2)
        assert proxy.poll() is None, "the solution killed the model proxy"
    finally:
        proxy.kill()
        proxy.wait()


def test_background_process_writing_later_is_ended_with_the_phase(sandbox, sample):
    work, home, _ = sample
    res, wall, log = run(sandbox, work, home, """
        setsid sh -c 'sleep 1.5; echo late > late.txt' > /dev/null 2>&1 < /dev/null &
        nohup sh -c 'sleep 1.5; echo late > late2.txt' > /dev/null 2>&1 &
        sleep 0.3; echo done
    """)
    assert wall < 1.5
    time.sleep(2.0)
    assert not (work / "late.txt").exists() and not (work / "late2.txt").exists(), "a process outlived its phase"
    assert any("leftover" in n for n in res.notes), res.notes


def test_spawning_is_capped_by_the_pids_limit(sandbox, sample):
    work, home, _ = sample
    # each background process that starts leaves a marker file (a builtin: no fork); dash gives up
    # at the first fork the pids cap refuses
    res, wall, log = run(sandbox, work, home, """
        i=0; while [ $i -lt 200 ]; do (echo > started.$i; exec sleep 20) & i=$((i+1)); done
        wait
    """, pids=32, timeout_s=15)
    started = len(list(work.glob("started.*")))
    assert started <= 32, f"{started} processes started at once despite pids=32"
    assert wall < 15, "the run must return without waiting for the spawned processes"
    assert any("pids limit" in n for n in res.notes), res.notes


@pytest.mark.skipif(BACKEND == "host", reason="a real fork bomb would take the shared machine down")
def test_fork_bomb_is_contained(sandbox, sample):
    work, home, _ = sample
    tag = f"bomb{uuid.uuid4().hex[:8]}"
    # never a real bomb where it could reach the host: only with a pids cap enforced and in a PID
    # namespace of its own (the script checks that itself too)
    pre, _, _ = run(sandbox, work, home, "true", pids=64, timeout_s=10)
    if not any("pids limit enforced" in n for n in pre.notes):
        pytest.fail(f"no pids limit enforced, not running the fork bomb: {pre.notes}")
    t0 = time.monotonic()
    res, wall, log = run(sandbox, work, home, f"""
        [ "$(readlink /proc/self/ns/pid)" = "{HOST_PID_NS}" ] && exit 99
        {tag}() {{ {tag} | {tag} & }}; {tag}
        sleep 30
    """, pids=64, timeout_s=4)
    assert res.returncode != 99, "the sandbox shares the host's PID namespace"
    assert wall < 10, f"the run must return (wall {wall:.1f} s)"
    time.sleep(0.3)
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if tag.encode() in _read(p)]
    assert not left, f"{len(left)} fork bomb processes outlived the phase"
    # the shell gives up when a fork is refused, or the timeout ends it: either way the rest die
    assert any("pids limit hit" in n for n in res.notes), res.notes
    assert any("timed out" in n or "leftover" in n for n in res.notes), res.notes
    assert time.monotonic() - t0 < 12


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError:
        return b""


def _tree_bytes(root: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*"))


def test_filling_the_disk_is_bounded(sandbox, sample):
    """/tmp, one file, the work dir and HOME together: each write past the cap fails at once.
    Unbounded (the ``host`` backend, or the old watchdog under load), the script writes 632 MiB
    and reaches finished.txt; the watchdog let 382 MiB through a 100 MiB cap and never counted HOME."""
    work, home, _ = sample
    big_tmp = Path("/tmp") / f"polar-sandbox-fill-{uuid.uuid4().hex[:8]}"
    try:
        res, wall, log = run(sandbox, work, home, f"""
            head -c 200M /dev/zero > {big_tmp} 2>/dev/null; ls -s {big_tmp} > tmp_size.txt
            head -c 200M /dev/zero > big 2>/dev/null
            i=0; while [ $i -lt 200 ]; do head -c 1M /dev/zero > "$HOME/h$i" || break; i=$((i+1)); done
            i=0; while [ $i -lt 200 ]; do head -c 1M /dev/zero > f$i || break; i=$((i+1)); done
            echo finished > finished.txt
        """, disk_mb=32, timeout_s=60)
    finally:
        big_tmp.unlink(missing_ok=True)
    tmp_kib = int((work / "tmp_size.txt").read_text().split()[0])
    assert tmp_kib <= 32 * 1024, f"/tmp took {tmp_kib} KiB past its 32 MiB cap"
    assert (work / "big").stat().st_size <= 32 * 1024 * 1024, "one file outgrew the disk cap"
    used = _tree_bytes(work) + _tree_bytes(home)
    # hard: the writes past the cap failed, whatever the load (no poll gap to overshoot in)
    assert used <= 34 * 1024 * 1024, f"the work dir and HOME reached {used / 2**20:.1f} MiB with a 32 MiB cap"
    assert (work / "finished.txt").exists() is False or (work / "finished.txt").stat().st_size == 0, \
        "a write past the cap must fail"
    assert any("disk limit hit" in n for n in res.notes), res.notes
