"""A hostile *task* against bubblewrap's privileged start (issue 50, part A), as root. The task
(its Dockerfile's ENV and WORKDIR, task.toml) is as untrusted as the sample; each test makes the
attack that gave host root when its defence was missing, and checks from the host:

* the task's loader variables (LD_PRELOAD of a library the task built, relative or not,
  LD_AUDIT, LD_LIBRARY_PATH; GCONV_PATH, LOCPATH) reach only the unprivileged phase, never the
  host's sh and bwrap (real root) nor the init (privileged until the drop): a library the test
  compiles writes the CapEff of every process it is loaded into;
* a work dir (or bind) where a mount would replace what the privileged start runs: the init's
  private dir, /run, the init's stdlib and interpreter, /, /proc, /etc, paths with ``..``, and a
  link the phase left under an earlier writable bind: refused with an error naming it, at task
  load time where the task says it; a normal /app works;
* concurrent sandboxes get distinct uid ranges: one sample holding its 128 inotify instances
  leaves another's ``inotify_init1`` working.

Seen failing with each defence removed (bubblewrap.py's ``env=dict(HOST_ENV), cwd=HOST_CWD``
back to ``env=env, cwd=None``; ``SandboxSpec.check_mounts`` a no-op; one uid range for all).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from polar_trial.sandbox import SandboxError, SandboxSpec
from polar_trial.sandbox.bubblewrap import HOST_ENV, PRIVATE, PYTHON, BubblewrapSandbox
from polar_trial.tasks import load_tasks

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="the privileged start exists for a root caller (CI runs as root)")

EVIL_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
/* LD_AUDIT wants la_version; LD_PRELOAD and LD_LIBRARY_PATH only run the constructor */
unsigned int la_version(unsigned int v) { return v; }
__attribute__((constructor)) static void mark(void) {
    char line[512], comm[64] = "?", cap[64] = "?", out[160];
    FILE *f = fopen("/proc/self/status", "r");
    if (f) {
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "CapEff:", 7)) sscanf(line + 7, "%63s", cap);
        fclose(f);
    }
    f = fopen("/proc/self/comm", "r");
    if (f) {
        if (fgets(comm, sizeof comm, f)) comm[strcspn(comm, "\n")] = 0;
        fclose(f);
    }
    char path[] = MARK "/m-XXXXXX";
    int fd = mkstemp(path);
    if (fd >= 0) {
        snprintf(out, sizeof out, "%s %s\n", comm, cap);
        if (write(fd, out, strlen(out)) < 0) {}
        close(fd);
    }
}
"""


@pytest.fixture
def marks(tmp_path):
    """A dir every process may write (bound at its own path), where the evil library reports."""
    d = tmp_path / "marks"
    d.mkdir()
    d.chmod(0o777)
    return d


def _gcc(out: Path, marks: Path, *extra: str) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    src = out.parent / "evil.c"
    src.write_text(EVIL_C)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARK="{marks}"', "-o", str(out), str(src), *extra],
                   check=True, capture_output=True)
    return out


def _loaded_into(marks: Path) -> list[tuple[str, int]]:
    """(command, CapEff) of every process the library was loaded into."""
    out = []
    for p in marks.iterdir():
        comm, _, cap = p.read_text().strip().partition(" ")
        out.append((comm, int(cap, 16) if cap not in ("", "?") else -1))
    return out


def _spec(work: Path, marks: Path, env: dict[str, str], **kw) -> SandboxSpec:
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root"}
    return SandboxSpec(work, rw_binds=[(marks, "")], env={**base, **env}, timeout_s=30, **kw)


@pytest.mark.parametrize("variant", ["preload-relative", "preload-absolute", "audit", "library-path"])
def test_the_tasks_loader_variables_reach_only_the_unprivileged_phase(sandbox, tmp_path, marks, monkeypatch, variant):
    """``ENV LD_PRELOAD=./evil.so`` (built by the task, in its work dir; the same file in Polar's
    cwd for the host's own sh and bwrap), ``LD_PRELOAD=/app/evil.so``, ``LD_AUDIT=./evil.so``, and
    ``LD_LIBRARY_PATH=.`` with an evil libz.so.1 (python3 links it): the library runs in the
    phase (so the attack is live), and only there, with no capability."""
    work = tmp_path / "work"
    work.mkdir()
    if variant == "library-path":
        # libz.so.1 that needs the real libz under another name: python3 still finds its symbols
        real = Path("/lib/x86_64-linux-gnu/libz.so.1")
        if not real.exists():
            pytest.skip("no /lib/x86_64-linux-gnu/libz.so.1")
        shutil.copy(real, work / "libzreal.so.1")
        _gcc(work / "libz.so.1", marks, "-Wl,-soname,libz.so.1", f"-L{work}", "-l:libzreal.so.1")
        env, argv = {"LD_LIBRARY_PATH": "."}, [PYTHON, "-c", "pass"]
    else:
        _gcc(work / "evil.so", marks)
        cwd = tmp_path / "polar-cwd"  # where a relative path is resolved on the host: Polar's cwd
        cwd.mkdir()
        shutil.copy(work / "evil.so", cwd / "evil.so")
        monkeypatch.chdir(cwd)
        var = "LD_AUDIT" if variant == "audit" else "LD_PRELOAD"
        env = {var: "/app/evil.so" if variant == "preload-absolute" else "./evil.so"}
        argv = ["/bin/true"]
    # the cgroup join's /bin/sh runs only where a cgroup can be made; the test does not depend on it
    res = sandbox.run(_spec(work, marks, env), argv)
    loaded = _loaded_into(marks)
    privileged = [(c, hex(cap)) for c, cap in loaded if cap != 0]
    assert not privileged, f"the task's library ran with capabilities in {privileged} (notes: {res.notes})"
    assert loaded, f"the library never loaded, not even into the phase: the attack is not live (rc {res.returncode})"


INJECTED = {"LD_PRELOAD": "/nonexistent-polar-preload.so", "LD_LIBRARY_PATH": "/nonexistent-polar-lib",
            "LD_AUDIT": "/nonexistent-polar-audit.so", "GCONV_PATH": "/nonexistent-polar-gconv",
            "LOCPATH": "/nonexistent-polar-locale", "PYTHONPATH": "/nonexistent-polar-py",
            "PYTHONHOME": "/nonexistent-polar-home", "BASH_ENV": "/nonexistent-polar-bashenv"}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


Chain = list[tuple[int, str, dict[str, str], dict[str, str]]]


def _while_running(sandbox, spec: SandboxSpec) -> tuple[dict[str, str], Chain]:
    """(the phase's environment, [(pid, command, environment, status)] of each process between
    it and this test: the init, bwrap), looked up from the host while the phase sleeps."""
    tag = f"polar-probe-{uuid.uuid4().hex[:8]}"
    t = threading.Thread(target=sandbox.run, args=(spec, ["bash", "-c", f"exec -a {tag} sleep 20"]), daemon=True)
    t.start()
    pid = None
    deadline = time.monotonic() + 15
    while pid is None and time.monotonic() < deadline:
        for p in Path("/proc").iterdir():
            try:
                if p.name.isdigit() and (p / "cmdline").read_bytes().startswith(tag.encode() + b"\0"):
                    pid = int(p.name)
            except OSError:
                pass
        time.sleep(0.05)
    assert pid is not None, "the phase did not start"
    try:
        phase_env = _environ(pid)
        chain, p = [], _ppid(pid)
        while p not in (os.getpid(), 0, 1):
            chain.append((p, Path(f"/proc/{p}/comm").read_text().strip(), _environ(p), _status(p)))
            p = _ppid(p)
    finally:
        os.kill(pid, 9)
        t.join(30)
    assert [c for _, c, _, _ in chain][:1] == ["python3"] and "bwrap" in [c for _, c, _, _ in chain], chain
    return phase_env, chain


def test_every_process_between_polar_and_the_phase_has_the_fixed_environment(sandbox, tmp_path, marks):
    """Looked up from the host while the phase runs: the init, bwrap (and the cgroup join's sh,
    which execs bwrap) have exactly HOST_ENV; the phase has the task's variables, GCONV_PATH and
    LOCPATH included."""
    work = tmp_path / "work"
    work.mkdir()
    phase_env, chain = _while_running(sandbox, _spec(work, marks, INJECTED))
    assert {k: phase_env.get(k) for k in INJECTED} == INJECTED, "the phase lost its own environment"
    for p, comm, env, _ in chain:
        env.pop("PWD", None)  # bwrap's --chdir sets it for the init
        assert env == HOST_ENV, f"{comm} (pid {p}), privileged, has the environment {env}"


CAP_SETGID, CAP_SETUID = 6, 7


@pytest.mark.parametrize("userns_caps", [False, True], ids=["agent", "verifier"])
def test_the_init_could_never_hold_more_than_setuid_and_setgid(sandbox, tmp_path, userns_caps):
    """The host writes the phase's uid/gid maps, so the init's bounding set (what it was given and
    could ever have) is CAP_SETUID|CAP_SETGID, not CAP_SYS_ADMIN and CAP_SETFCAP with them (with
    those, a task's code in the init remounted the host's /usr writable); and it holds none once
    the phase runs."""
    work = tmp_path / "work"
    work.mkdir()
    _, chain = _while_running(sandbox, SandboxSpec(work, env={"PATH": "/usr/bin:/bin"}, timeout_s=30,
                                                   userns_caps=userns_caps))
    _, _, _, init = chain[0]
    assert int(init["CapBnd"], 16) == (1 << CAP_SETUID) | (1 << CAP_SETGID), f"the init's CapBnd is {init['CapBnd']}"
    assert int(init["CapEff"], 16) == 0 and int(init["CapPrm"], 16) == 0, init["CapEff"]
    assert 0 not in {int(u) for u in init["Uid"].split()}, f"the init is still the host's root: {init['Uid']}"


# ---- the work dir and the binds -------------------------------------------------------------------

HOSTILE_WORKDIRS = [
    PRIVATE, "/run", "/run/polar-report", "/usr/lib/python3.11", "/usr/bin", "/lib/x86_64-linux-gnu", "/",
    "/proc", "/proc/self", "/dev/shm", "/sys/fs", "/etc/x", "/etc", "/opt/app",
    "/app/../run/polar-sandbox", "//run//polar-sandbox/", "/srv/../usr/lib/python3.11/.",
]


@pytest.mark.parametrize("workdir", HOSTILE_WORKDIRS)
def test_a_hostile_work_dir_is_refused_naming_it(sandbox, tmp_path, workdir):
    work = tmp_path / "work"
    work.mkdir()
    (work / "init.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').write('init')\n")
    with pytest.raises(SandboxError) as err:
        sandbox.run(SandboxSpec(work, workdir=workdir, env={"PATH": "/usr/bin:/bin"}, timeout_s=20), ["true"])
    norm = "/" + os.path.normpath(workdir).lstrip("/")
    assert norm in str(err.value) and "refused" in str(err.value), str(err.value)
    assert not (tmp_path / "pwned").exists()


# os only (frozen): in encodings/__init__.py no codec exists yet for a text-mode open
PAYLOAD = """
import os
fd = os.open('/proc/self/status', os.O_RDONLY)
cap = [l for l in os.read(fd, 65536).split(b'\\n') if l.startswith(b'CapEff')][0].split()[1]
out = os.open({out!r}, os.O_WRONLY | os.O_CREAT, 0o644)
os.write(out, cap)
"""


def _run_refused(sandbox, **kw) -> SandboxError | None:
    try:
        sandbox.run(SandboxSpec(**kw), ["true"])
    except SandboxError as exc:
        return exc
    return None


@pytest.mark.parametrize("workdir,planted", [(PRIVATE, "init.py"), ("/usr/lib/python3.11", "encodings/__init__.py")],
                         ids=["private-dir", "stdlib"])
def test_a_work_dir_over_the_inits_files_does_not_run_the_tasks_code(sandbox, tmp_path, workdir, planted):
    """The attack itself: the task's own init.py at /run/polar-sandbox, or its encodings package
    (imported at the interpreter's start) at the init's stdlib dir, would run as the init, with
    the init's capabilities (it reports its CapEff)."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / planted).parent.mkdir(parents=True)
    out.mkdir()
    out.chmod(0o777)
    (work / planted).write_text(PAYLOAD.format(out=str(out / "pwned")))
    err = _run_refused(sandbox, workdir_host=work, workdir=workdir, rw_binds=[(out, "")],
                       env={"PATH": "/usr/bin:/bin"}, timeout_s=20)
    assert not (out / "pwned").exists(), f"the task's {planted} ran as the init, CapEff {(out / 'pwned').read_text()}"
    assert err is not None and "refused" in str(err), err


def test_a_link_left_under_a_writable_bind_cannot_redirect_the_work_dirs_mount(sandbox, tmp_path):
    """The phase's HOME (writable, kept between turns) holds ``x -> /run/polar-sandbox``; a task
    whose WORKDIR is ``<HOME>/x`` would have its work dir mounted over the init's private dir
    (a mount follows links in its destination), and its init.py run as the init."""
    work, home, out = tmp_path / "work", tmp_path / "home", tmp_path / "out"
    for d in (work, home, out):
        d.mkdir()
    out.chmod(0o777)
    (home / "x").symlink_to(os.path.relpath(PRIVATE, home))  # bwrap resolves it in the new root
    (work / "init.py").write_text(PAYLOAD.format(out=str(out / "pwned")))
    err = _run_refused(sandbox, workdir_host=work, workdir=f"{home}/x", home_host=home, rw_binds=[(out, "")],
                       env={"PATH": "/usr/bin:/bin"}, timeout_s=20)
    assert not (out / "pwned").exists(), f"the task's init.py ran as the init, CapEff {(out / 'pwned').read_text()}"
    assert err is not None and "a writable bind mounted before it" in str(err), err


def test_no_bind_can_reach_the_inits_interpreter_or_its_code(tmp_path):
    """Every dir on the init's sys.path (``python3 -I -S``), the interpreter, the loader's files
    and the private dir: no work dir and no bind (writable or not, from another host path) lands
    there. A read-only bind of a host path at its own place is the one allowed (it shows what
    is already there)."""
    probe = subprocess.run([PYTHON, "-I", "-S", "-c", "import sys; print('\\n'.join(p for p in sys.path if p))"],
                           capture_output=True, text=True, check=True, env=HOST_ENV)
    targets = [*probe.stdout.split(), PYTHON, os.path.realpath(PYTHON), "/etc/ld.so.preload", "/etc/ld.so.cache",
               "/lib64/ld-linux-x86-64.so.2", f"{PRIVATE}/init.py", f"{PRIVATE}/env.json"]
    bwrap = BubblewrapSandbox()
    src = tmp_path / "src"
    src.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    for t in targets:
        for kw in ({"workdir": t}, {"rw_binds": [(src, t)]}, {"ro_binds": [(src, t)]}):
            with pytest.raises(SandboxError, match="refused"):
                spec = SandboxSpec(work, env={}, **kw)  # type: ignore[arg-type]
                bwrap.argv(spec, tmp_path, ["true"])
    # the host's own dir at its own place, read-only: nothing is replaced (and bwrap skips it)
    lib = next(p for p in probe.stdout.split() if os.path.isdir(p))
    for same in (lib, "/etc", "/etc/ssh"):  # /etc again would uncover /etc/shadow
        argv = bwrap.argv(SandboxSpec(work, env={}, ro_binds=[(Path(same), "")]), tmp_path, ["true"])
        binds = [argv[i:i + 3] for i in range(len(argv) - 2)].count(["--ro-bind", same, same])
        assert binds == (1 if same == "/etc" else 0), f"{same} was bound again"  # once: bwrap's own system dir


def test_a_normal_work_dir_still_works(sandbox, tmp_path):
    for workdir in ("/app", "/root/project", "/var/www/html", "/tmp/build", "/home/user/./x/.."):
        work = tmp_path / workdir.strip("/").replace("/", "_")
        work.mkdir()
        res = sandbox.run(SandboxSpec(work, workdir=workdir, env={"PATH": "/usr/bin:/bin"}, timeout_s=20),
                          ["sh", "-c", "pwd > here"])
        assert res.returncode == 0, (workdir, res.notes)
        assert (work / "here").read_text().strip() == os.path.normpath(workdir), workdir


def _harbor(root: Path, dockerfile: str, toml: str = "") -> Path:
    d = root / "t"
    for sub in ("environment", "tests"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text('version = "1.0"\n' + toml)
    (d / "instruction.md").write_text("t\n")
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    (d / "tests" / "test.sh").write_text("#!/usr/bin/env bash\necho 1 > /logs/verifier/reward.txt\n")
    return d


APP = "FROM python:3.11-slim\nWORKDIR /app\n"


@pytest.mark.parametrize("dockerfile,toml,key", [
    ("FROM python:3.11-slim\nWORKDIR /run/polar-sandbox\n", "", "the Dockerfile's WORKDIR"),
    ("FROM python:3.11-slim\nWORKDIR /app\nWORKDIR ../usr/lib/python3.11\n", "", "the Dockerfile's WORKDIR"),
    (APP, '[environment]\nworkdir = "/proc/self"\n', "task.toml [environment] workdir"),
    (APP, '[environment]\nworkdir = "/etc/cron.d"\n', "task.toml [environment] workdir"),
], ids=["run", "stdlib-via-dotdot", "proc", "etc"])
def test_a_hostile_workdir_is_refused_when_the_task_is_loaded(tmp_path, dockerfile, toml, key):
    task_dir = _harbor(tmp_path, dockerfile, toml)
    with pytest.raises(ValueError) as err:
        load_tasks(task_dir)
    assert key in str(err.value) and "refused" in str(err.value), str(err.value)


def test_a_container_task_keeps_its_system_dir_workdir(tmp_path):
    """/usr/src/app is an image's own dir under docker (common in public Dockerfiles); only the
    local mode, whose sandbox shows the host's /usr, refuses it."""
    task_dir = _harbor(tmp_path, "FROM python:3.11-slim\nWORKDIR /usr/src/app\n")
    [task] = load_tasks(task_dir, container=True)
    assert task.workdir == "/usr/src/app"
    with pytest.raises(ValueError, match="refused"):
        load_tasks(task_dir)


# ---- one uid range per sandbox --------------------------------------------------------------------

def test_concurrent_leases_get_distinct_ranges_and_a_dead_holders_slot_comes_back():
    from polar_trial.sandbox.uidrange import LOCK_DIR, UID_COUNT, lease_uid_range

    a, b = lease_uid_range(), lease_uid_range()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from polar_trial.sandbox.uidrange import lease_uid_range
        r = lease_uid_range()
        print(r.slot, r.base, r.init_uid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        slot, base, init_uid = map(int, holder.stdout.readline().split())  # type: ignore[union-attr]
        ranges = [(a.base, a.init_uid), (b.base, b.init_uid), (base, init_uid)]
        spans = sorted((lo, lo + UID_COUNT) for lo, _ in ranges)
        assert all(hi <= nxt for (_, hi), (nxt, _) in zip(spans, spans[1:])), f"overlapping ranges {ranges}"
        inits = {i for _, i in ranges}
        assert len(inits) == 3 and not any(lo <= i < lo + UID_COUNT for lo, _ in ranges for i in inits), ranges
        import fcntl

        fd = os.open(LOCK_DIR / str(slot), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.kill()
            holder.wait(10)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel dropped the dead holder's lease
        finally:
            os.close(fd)
    finally:
        holder.kill()
        a.release()
        b.release()


HOG = """
import ctypes, os, time
libc = ctypes.CDLL(None)
n = 0
while libc.inotify_init1(0) >= 0:
    n += 1
open("held.tmp", "w").write(str(n) + " " + open("/proc/self/uid_map").read().split()[1])
os.rename("held.tmp", "held")
t = time.monotonic()
while not os.path.exists("stop") and time.monotonic() - t < 20:
    time.sleep(0.05)
"""

PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
open("probe", "w").write(f"{fd} {ctypes.get_errno()} " + open("/proc/self/uid_map").read().split()[1])
"""


def test_one_sample_holding_every_inotify_instance_leaves_another_samples_working(sandbox, tmp_path):
    limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    env = {"PATH": "/usr/bin:/bin"}
    hog = threading.Thread(target=sandbox.run, args=(SandboxSpec(a, env=env, timeout_s=30), [PYTHON, "-c", HOG]),
                           daemon=True)
    hog.start()
    try:
        deadline = time.monotonic() + 20
        while not (a / "held").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        held, a_base = (a / "held").read_text().split()
        assert int(held) >= limit - 8, f"the first sample held only {held} of {limit} inotify instances"
        res = sandbox.run(SandboxSpec(b, env=env, timeout_s=30), [PYTHON, "-c", PROBE])
        fd, errno_, b_base = (b / "probe").read_text().split()
    finally:
        (a / "stop").write_text("")
        hog.join(30)
    assert int(fd) >= 0, f"the second sample's inotify_init1 failed (errno {errno_}: EMFILE is 24) {res.notes}"
    assert a_base != b_base, f"both samples ran as host uid {a_base}"



@pytest.mark.parametrize("workdir", [PRIVATE, "/usr/lib/python3.11"], ids=["spec", "bwrap"])
def test_a_hostile_work_dir_past_the_loader_fails_its_sample_not_the_rollout(tmp_path, workdir):
    """A task whose work dir got past the loader (built in code here) fails its own samples with
    the refusal, whether the spec refuses it (/run) or bubblewrap does (a system dir); the rollout
    goes on and the other task's sample runs."""
    from polar_runtime import rollout as r
    from polar_runtime.harnesses import Endpoint, get_preset

    bad, good = r.Task("bad", "x", evaluator="true"), r.Task("good", "x", evaluator="true")
    bad.environment.workdir = workdir  # type: ignore[union-attr]
    cfg = r.RolloutConfig(tasks=[bad, good], preset=get_preset("generic", command="true"),
                          endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
                          capture_dir=tmp_path / "captures", model="m", samples=1, timeout=60.0, eval_timeout=60.0)
    rows = {row["task_id"]: row for row in r.run_rollout(cfg).iter_rows(named=True)}
    assert rows["bad"]["status"] == "failed" and "refused" in (rows["bad"]["error"] or ""), rows["bad"]
    assert workdir in rows["bad"]["error"], rows["bad"]["error"]
    assert rows["good"]["status"] == "ok" and rows["good"]["reward"] == 1.0, rows["good"]
