"""The build's network (``sandbox/egress.py`` + ``sandbox/publicnet.py``): build steps reach public
hosts, checked on the resolved address and pinned to it; a dead host fails in seconds; hostile
request heads and connection floods are bounded; the verifier keeps the registries only.

No traffic leaves this machine: the "public" host is a listener on loopback that a test declares
public through ``publicnet.fake_public_hosts`` (an in-process override only pytest can set), and
every other address is refused before any connection (the refusal is the point)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from polar_testing.listeners import CountingListener, http_reply
from polar_trial.sandbox import SandboxSpec
from polar_trial.sandbox import publicnet
from polar_trial.sandbox.egress import EgressProxy, build_egress, registries
from polar_trial.sandbox.publicnet import PUBLIC, fake_public_hosts


def ask(path: Path, request: bytes, timeout: float = 10) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(request)
        out = b""
        while chunk := s.recv(4096):
            out += chunk
        return out


@pytest.fixture
def public():
    lst = CountingListener(http_reply(b"PUBLIC"))
    yield lst
    lst.close()


@pytest.mark.parametrize("addr", [
    "127.0.0.1", "127.8.9.10", "::1", "0.0.0.0", "::", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
    "fe80::1", "fd00::1", "fc00::5", "fec0::1", "100.64.0.1", "100.127.255.254", "224.0.0.1", "ff02::1",
    "255.255.255.255", "192.0.2.1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1",
    "2002:7f00:1::1", "64:ff9b::a00:1", "2001:0:4136:e378:8000:63bf:80ff:fffe"])
def test_no_address_but_a_public_one_is_reached(addr):
    """Every non-public form, v4-in-v6 included, is refused by the check the proxy makes on the
    resolved address (a pure check: nothing is contacted)."""
    assert publicnet.check(addr, registry=False), addr


def test_public_addresses_pass_the_check_and_this_hosts_own_do_not():
    for addr in ("8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8"):
        assert publicnet.not_public(addr) is None, addr
    # an address this host holds (vLLM or the control API on --listen-host 0.0.0.0 answer there)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # UDP connect: picks a source address, sends nothing
            mine = s.getsockname()[0]
        except OSError:
            mine = "127.0.0.1"
    assert publicnet.check(mine, registry=False) and publicnet.check(mine, registry=True)
    assert publicnet.check("10.0.0.7", registry=True) is None  # a registry mirror on the user's network


def test_a_build_reaches_a_public_host_and_the_verifier_does_not(tmp_path, public):
    """build_egress() lets a public host through (absolute-form and CONNECT); registries() (the
    verifier's) refuses the same host; neither reaches it without the test's override."""
    assert PUBLIC in build_egress() and PUBLIC not in registries()
    with fake_public_hosts({"files.example-public.org": ["127.0.0.1"]}, public={"127.0.0.1"}):
        build = EgressProxy(tmp_path / "b.sock", build_egress())
        verifier = EgressProxy(tmp_path / "v.sock", registries())
        try:
            got = ask(tmp_path / "b.sock", f"GET http://files.example-public.org:{public.port}/x HTTP/1.1\r\n"
                                           f"Host: files.example-public.org\r\n\r\n".encode())
            assert got.endswith(b"PUBLIC"), got
            got = ask(tmp_path / "b.sock", f"CONNECT files.example-public.org:{public.port} HTTP/1.1\r\n\r\n"
                                           "GET / HTTP/1.1\r\n\r\n".encode())
            assert got.startswith(b"HTTP/1.1 200 Connection established") and got.endswith(b"PUBLIC"), got
            got = ask(tmp_path / "v.sock", f"CONNECT files.example-public.org:{public.port} HTTP/1.1\r\n\r\n".encode())
            assert got.startswith(b"HTTP/1.1 403") and b"not a package registry" in got, got
            assert public.accepted == 2
        finally:
            build.close()
            verifier.close()


def test_builds_restricted_to_the_registries(monkeypatch):
    monkeypatch.setenv("POLAR_BUILD_NETWORK", "registries")
    assert build_egress() == registries()
    monkeypatch.setenv("POLAR_BUILD_NETWORK", "everything")
    with pytest.raises(ValueError, match="POLAR_BUILD_NETWORK"):
        build_egress()


def test_a_name_that_resolves_to_loopback_is_refused_and_a_rebind_never_reached(tmp_path, public):
    """Resolved once, checked, connected to as resolved: a name whose first answer is the (test-
    declared) public host and whose second is the host's loopback service reaches the first only;
    a name resolving to loopback is refused naming the address, and the listener sees nothing."""
    inner = CountingListener(http_reply(b"CONTROL-API"))
    answers = iter([["127.0.0.1"], ["127.0.0.2"], ["127.0.0.2"]])
    try:
        with fake_public_hosts({"rebind.example-public.org": lambda: next(answers),
                                "loop.example-public.org": ["127.0.0.1"]}, public={"127.0.0.1"}) as ov:
            proxy = EgressProxy(tmp_path / "e.sock", build_egress())
            try:
                got = ask(tmp_path / "e.sock", f"GET http://rebind.example-public.org:{public.port}/ HTTP/1.1\r\n\r\n".encode())
                assert got.endswith(b"PUBLIC") and ov["lookups"]["rebind.example-public.org"] == 1, got
                got = ask(tmp_path / "e.sock", f"GET http://rebind.example-public.org:{inner.port}/ HTTP/1.1\r\n\r\n".encode())
                assert got.startswith(b"HTTP/1.1 403") and b"127.0.0.2 (a loopback address)" in got, got
                ov["public"].clear()
                got = ask(tmp_path / "e.sock", f"CONNECT loop.example-public.org:{public.port} HTTP/1.1\r\n\r\n".encode())
                assert got.startswith(b"HTTP/1.1 403") and b"127.0.0.1 (a loopback address)" in got, got
                for target in (f"127.0.0.1:{inner.port}", f"[::ffff:127.0.0.1]:{inner.port}", f"0.0.0.0:{inner.port}"):
                    got = ask(tmp_path / "e.sock", f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
                    assert got.startswith(b"HTTP/1.1 403"), (target, got)
            finally:
                proxy.close()
        assert inner.accepted == 0 and public.accepted == 1
    finally:
        inner.close()


def test_special_use_names_are_refused_without_a_lookup(tmp_path):
    proxy = EgressProxy(tmp_path / "e.sock", build_egress())
    try:
        for host in ("public.example", "x.test", "a.invalid", "localhost", "printer.local"):
            got = ask(tmp_path / "e.sock", f"CONNECT {host}:443 HTTP/1.1\r\n\r\n".encode())
            assert got.startswith(b"HTTP/1.1 403") and b"special-use" in got, (host, got)
    finally:
        proxy.close()
    # a registry mirror the operator configures may have such a name: it is resolved (here by the
    # test's override), not refused by name
    with fake_public_hosts({"mirror.internal": ["10.9.8.7"]}):
        assert publicnet.resolve("mirror.internal", 443, registry=True) == [(socket.AF_INET, ("10.9.8.7", 443))]


def test_a_host_that_does_not_answer_fails_fast_naming_it(tmp_path):
    """A refused port answers 502 at once; a host that drops the SYN (a listener whose backlog is
    full) 403 after the connect timeout (a status clients do not retry), not the build step's whole
    timeout, and at once when asked again; both name the host."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    closed_port = dead.getsockname()[1]
    dead.close()
    full = CountingListener(backlog=0)  # accepts nothing; its queue filled below, later SYNs are dropped
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", full.port))
        fillers.append(c)
    time.sleep(0.2)
    try:
        with fake_public_hosts({"gone.example-public.org": ["127.0.0.1"], "slow.example-public.org": ["127.0.0.1"]},
                               public={"127.0.0.1"}):
            proxy = EgressProxy(tmp_path / "e.sock", build_egress(), connect_timeout_s=1.0)
            try:
                t0 = time.monotonic()
                got = ask(tmp_path / "e.sock", f"CONNECT gone.example-public.org:{closed_port} HTTP/1.1\r\n\r\n".encode())
                assert got.startswith(b"HTTP/1.1 502") and b"gone.example-public.org" in got, got
                assert time.monotonic() - t0 < 1.0
                t0 = time.monotonic()
                got = ask(tmp_path / "e.sock", f"CONNECT slow.example-public.org:{full.port} HTTP/1.1\r\n\r\n".encode())
                took = time.monotonic() - t0
                assert got.startswith(b"HTTP/1.1 403") and b"slow.example-public.org" in got, got
                assert 0.9 < took < 3.0, took
                t0 = time.monotonic()
                got = ask(tmp_path / "e.sock", f"CONNECT slow.example-public.org:{full.port} HTTP/1.1\r\n\r\n".encode())
                assert got.startswith(b"HTTP/1.1 403") and b"answered at once" in got and time.monotonic() - t0 < 0.5
                assert any("did not answer within 1 s" in r for r in proxy.refused), proxy.refused
            finally:
                proxy.close()
    finally:
        for c in fillers:
            c.close()
        full.close()
    assert publicnet.CONNECT_TIMEOUT_S <= 5.0


def test_hostile_heads_and_connection_floods_are_bounded(tmp_path, public):
    with fake_public_hosts({"h.example-public.org": ["127.0.0.1"]}, public={"127.0.0.1"}):
        proxy = EgressProxy(tmp_path / "e.sock", build_egress())
        try:
            many = "".join(f"X-{i}: y\r\n" for i in range(150))
            for head in (f"CONNECT h.example-public.org:{public.port} HTTP/1.1\r\n{many}\r\n",
                         f"CONNECT h.example-public.org:{public.port} HTTP/1.1\r\nX: {'a' * 9000}\r\n\r\n"):
                got = ask(tmp_path / "e.sock", head.encode())
                assert got.startswith(b"HTTP/1.1 431"), got[:200]
            try:  # a head that never ends: answered 431 and closed unread (the client may see a reset)
                ask(tmp_path / "e.sock", b"GET http://h.example-public.org/ HTTP/1.1\r\n" + b"X: y\r\n" * 20000)
            except OSError:
                pass
            assert proxy.refused[-1] == "request head too large", proxy.refused
            # 64 idle connections hold every slot; the 65th waits, and is served once one goes
            idle = []
            for _ in range(64):
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(tmp_path / "e.sock"))
                idle.append(s)
            time.sleep(0.3)
            late = socket.socket(socket.AF_UNIX)
            late.settimeout(1.0)
            late.connect(str(tmp_path / "e.sock"))
            late.sendall(f"CONNECT h.example-public.org:{public.port} HTTP/1.1\r\n\r\n".encode())
            with pytest.raises(TimeoutError):
                late.recv(100)
            idle.pop().close()
            late.settimeout(5)
            assert late.recv(100).startswith(b"HTTP/1.1 200")
            late.close()
            for s in idle:
                s.close()
        finally:
            proxy.close()
    for _ in range(40):  # the listener's thread counts it after the proxy's connect returned
        if public.accepted:
            break
        time.sleep(0.05)
    assert public.accepted == 1


def test_only_pytest_can_set_the_override_and_a_tasks_environment_does_not_reach_it(sandbox, tmp_path, public):
    """Outside a pytest process the override raises; a build step whose environment (a task's
    ENV, [environment.env]) names the fake host and every variable one might guess is refused:
    the name is resolved by Polar's process, which the task's environment never reaches."""
    code = "from polar_trial.sandbox.publicnet import fake_public_hosts as f\nwith f({'a': ['127.0.0.1']}): pass"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert r.returncode != 0 and "for the test suite only" in r.stderr, r.stderr
    work = tmp_path / f"w-{uuid.uuid4().hex[:6]}"
    work.mkdir()
    guesses = {k: f"public.example=127.0.0.1:{public.port}" for k in (
        "POLAR_TEST_PUBLIC_HOSTS", "POLAR_EGRESS_HOSTS", "POLAR_FAKE_PUBLIC_HOSTS", "PYTEST_CURRENT_TEST")}
    spec = SandboxSpec(work, env={"PATH": "/usr/bin:/bin", **guesses}, timeout_s=30, egress=build_egress())
    with open(tmp_path / "out.log", "wb") as out:
        res = sandbox.run(spec, ["bash", "-c", f"curl -sS -m 5 -x \"$HTTP_PROXY\" http://public.example:{public.port}/;"
                                             f" echo; echo seen=$POLAR_TEST_PUBLIC_HOSTS"],
                          stdout=out, stderr=subprocess.STDOUT)
    log = (tmp_path / "out.log").read_text(errors="replace")
    assert "seen=public.example" in log and "special-use" in log, (res, log)
    assert public.accepted == 0


def _build_task(root: Path, name: str, run: str) -> Path:
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "task.toml").write_text('version = "1.0"\n')
    (d / "instruction.md").write_text("x\n")
    (d / "environment" / "Dockerfile").write_text(f"FROM debian:bookworm\nWORKDIR /app\nRUN {run}\n")
    (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    return d


def test_a_build_step_reaches_a_public_host_and_a_dead_one_fails_in_seconds_naming_it(sandbox, tmp_path, public,
                                                                                      monkeypatch):
    """The local mode's build (bubblewrap) through its egress proxy: a fetch from the (test-
    declared) public host lands in the work dir; one from a host that drops the SYN fails the
    step after the connect timeout, not the build's 600 s, and the error names the host."""
    from polar_trial.tasks import load_tasks
    from polar_trial.tasks.environment import BuildError, prepare_workdir

    monkeypatch.setattr(publicnet, "CONNECT_TIMEOUT_S", 1.0)
    full = CountingListener(backlog=0)
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", full.port))
        fillers.append(c)
    time.sleep(0.2)
    try:
        with fake_public_hosts({"dl.example-public.org": ["127.0.0.1"], "dead.example-public.org": ["127.0.0.1"]},
                               public={"127.0.0.1"}):
            (ok,) = load_tasks(_build_task(tmp_path, "ok", f"curl -sSf -m 30 http://dl.example-public.org:{public.port}/x -o got"))
            prepare_workdir(ok, tmp_path / "w-ok", sandbox, tmp_path / "builds")
            assert (tmp_path / "w-ok" / "got").read_text() == "PUBLIC"
            (dead,) = load_tasks(_build_task(tmp_path, "dead", f"curl -sSf -m 300 http://dead.example-public.org:{full.port}/x"))
            t0 = time.monotonic()
            with pytest.raises(BuildError) as err:
                prepare_workdir(dead, tmp_path / "w-dead", sandbox, tmp_path / "builds")
            took = time.monotonic() - t0
    finally:
        for c in fillers:
            c.close()
        full.close()
    assert took < 15 and "dead.example-public.org" in str(err.value) and "did not answer within 1 s" in str(err.value), \
        (took, str(err.value)[-600:])


def test_allow_internet_opens_the_agent_phase_only_when_the_run_allows_it(tmp_path):
    """``allow_internet = true`` gives the agent public hosts (egress ``*``), never the host's
    network, and only with the run's flag; a harness in proxy mode keeps the model proxy."""
    from polar_runtime import rollout as r
    from polar_runtime.harnesses import Endpoint, get_preset
    from polar_trial.sandbox.trial import TrialConfig
    from polar_trial.tasks.model import Task

    def spec(task, flag, endpoint):
        cfg = r.RolloutConfig(tasks=[task], preset=get_preset("nop"), capture_dir=tmp_path / "c", model="m",
                              endpoint=endpoint, allow_internet=flag)
        return r.agent_spec(cfg, task, tmp_path / "w", tmp_path / "h", 10)

    base = Endpoint("base_url", base_url="http://127.0.0.1:8123")
    open_task, closed = Task(id="o", instruction="x", allow_internet=True), Task(id="c", instruction="x")
    assert spec(open_task, True, base).egress == (PUBLIC,) and spec(open_task, True, base).network is False
    assert spec(open_task, False, base).egress == () and spec(closed, True, base).egress == ()
    assert r.RolloutConfig(tasks=[], preset=get_preset("nop"), capture_dir=tmp_path / "c", model="m",
                           endpoint=base).allow_internet is False
    assert TrialConfig(image="x", workdir_host=tmp_path).agent_internet is False


def test_a_resolver_that_does_not_answer_costs_the_connect_timeout_only(monkeypatch):
    """A name whose DNS never answers (here: a getaddrinfo that hangs, no query sent) fails within
    the connect timeout, naming it, instead of the resolver's own timeouts times its attempts."""
    def hang(*a, **k):
        time.sleep(5)
        raise socket.gaierror("late")

    monkeypatch.setattr(publicnet.socket, "getaddrinfo", hang)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="quiet.example-public.org: no DNS answer within 0.5 s"):
        publicnet.connect_checked("quiet.example-public.org", 443, registry=False, timeout_s=0.5)
    assert time.monotonic() - t0 < 1.5
