"""A sample against a root caller (issue: the sandbox against a root caller). Each test makes the
attack that works when its protection is missing, as CI's user (root), and checks from the host:

* no capability in the host's user namespace, no_new_privs, the seccomp filter, looked up in
  ``/proc/PID/status`` of the phase's own process from outside;
* remounting a read-only bind writable, ``open_by_handle_at`` to the host's root directory (reading
  a key in the host's HOME, planting a ``.pth`` in the checkout's venv), the kernel keyring, a
  ``/proc/sys`` write;
* the verifier phase's limits (pids, /tmp, disk for work dir and HOME together);
* links a sample plants for the host to follow (reward files, test output, harness configs);
* reward hacks on our own tasks (the tested program swapping the reward file, an /app module
  shadowing the standard library).

Show what each protection prevents (the tests then fail):

    POLAR_SANDBOX_UNHARDENED=1 .venv/bin/python -m pytest tests/trial/sandbox/test_root_hardening.py
    POLAR_SANDBOX_UNDER_TEST=host .venv/bin/python -m pytest tests/trial/sandbox/test_root_hardening.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from polar_trial.sandbox import SandboxSpec
from polar_trial.tasks import load_tasks
from polar_trial.tasks.environment import prepare_workdir
from polar_trial.verifier import verify

REPO = Path(__file__).resolve().parents[3]
HOST_HOME = Path(os.path.expanduser("~"))
HOST_USERNS = os.readlink("/proc/self/ns/user")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the root caller's attacks need root (CI runs as root)")


@pytest.fixture
def dirs(tmp_path):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    return work, home


@pytest.fixture
def host_secret():
    """A 0600 file in the host user's HOME holding a number (a reward, if anything followed it)."""
    d = HOST_HOME / f".polar-hardening-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o700)
    secret = d / "secret"
    secret.write_text("0.75\n")
    secret.chmod(0o600)
    yield secret
    shutil.rmtree(d, ignore_errors=True)


def spec_for(work: Path, home: Path, **kw) -> SandboxSpec:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home)}
    return SandboxSpec(work, home_host=home, env=env, timeout_s=kw.pop("timeout_s", 30), **kw)


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def _find(marker: bytes, deadline: float) -> int | None:
    while time.monotonic() < deadline:
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    if (p / "cmdline").read_bytes().startswith(marker + b"\0"):
                        return int(p.name)
                except OSError:
                    pass
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("userns_caps", [False, True], ids=["agent", "verifier"])
def test_no_capability_in_the_hosts_user_namespace(sandbox, dirs, userns_caps):
    """Looked up from the host: the phase's process is an unprivileged host uid with no capability
    in the host's user namespace (the verifier's uid 0 keeps its capabilities only over a user
    namespace of its own), no_new_privs, seccomp filtering."""
    work, home = dirs
    tag = f"polar-probe-{uuid.uuid4().hex[:8]}"
    spec = spec_for(work, home, userns_caps=userns_caps)
    t = threading.Thread(target=sandbox.run, args=(spec, ["bash", "-c", f"exec -a {tag} sleep 20"]), daemon=True)
    t.start()
    pid = _find(tag.encode(), time.monotonic() + 15)
    assert pid is not None, "the phase's process did not start"
    try:
        st, userns = _status(pid), os.readlink(f"/proc/{pid}/ns/user")
        uid_map = Path(f"/proc/{pid}/uid_map").read_text().split()
    finally:
        os.kill(pid, 9)
        t.join(30)
    host_uids = {int(u) for u in st["Uid"].split()}
    assert 0 not in host_uids, f"the phase runs as the host's root: Uid {st['Uid']}"
    assert st["NoNewPrivs"] == "1", "no_new_privs is not set"
    assert st["Seccomp"] == "2", "no seccomp filter"
    if userns_caps:
        assert userns != HOST_USERNS, "capabilities in the host's own user namespace"
        assert uid_map[:2] == ["0", str(min(host_uids))], f"uid 0 inside is not the unprivileged host uid: {uid_map}"
    else:
        assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0, f"CapEff {st['CapEff']}"
        assert int(st["CapBnd"], 16) == 0, f"a capability can be regained: CapBnd {st['CapBnd']}"


ATTACK = r'''
import ctypes, os, struct, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
tag, secret, repo_venv = sys.argv[1], sys.argv[2], sys.argv[3]
def say(what, ok): print(f"{what}: {'DONE' if ok else 'blocked'}", flush=True)

# 1. a read-only bind remounted writable, then written
r = subprocess.run(["mount", "-o", "remount,bind,rw", "/usr"], capture_output=True)
try:
    open(f"/usr/.{tag}", "w").write("pwned"); say("remount-write", True)
except OSError:
    say("remount-write", r.returncode == 0)

# 2. open_by_handle_at: a handle of /usr's file system with the root inode (ext4: ino 2, gen 0)
class FH(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int), ("f_handle", ctypes.c_ubyte * 128)]
fh, mnt = FH(), ctypes.c_int()
fh.handle_bytes = 128
got = libc.name_to_handle_at(-100, b"/usr", ctypes.byref(fh), ctypes.byref(mnt), 0)
opened = False
if got == 0:
    for i, b in enumerate(struct.pack("II", 2, 0)):
        fh.f_handle[i] = b
    mfd = os.open("/usr", os.O_RDONLY | os.O_DIRECTORY)
    rfd = libc.open_by_handle_at(mfd, ctypes.byref(fh), os.O_RDONLY | os.O_DIRECTORY)
    if rfd >= 0:
        opened = True
        try:
            fd = os.open(secret.lstrip("/"), os.O_RDONLY, dir_fd=rfd)
            print("SECRET", os.read(fd, 100).decode().strip(), flush=True)
        except OSError as e:
            print("handle read failed", e)
        try:
            fd = os.open(f"{repo_venv.lstrip('/')}/{tag}.pth", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=rfd)
            os.write(fd, b"import os\n")
        except OSError as e:
            print("handle write failed", e)
say("open_by_handle_at", opened)

# 3. the kernel keyring
kid = libc.syscall(248, b"user", tag.encode(), b"x", 1, -3)  # add_key(..., KEY_SPEC_SESSION_KEYRING)
say("add_key", kid > 0)

# 4. a kernel setting (written back with its own value)
try:
    p = "/proc/sys/kernel/printk_ratelimit"
    v = open(p).read()
    with open(p, "w") as f:
        f.write(v)
    say("sysctl-write", True)
except OSError:
    say("sysctl-write", False)
'''


def test_mounts_handles_keys_and_kernel_settings_are_out_of_reach(sandbox, dirs, host_secret):
    work, home = dirs
    tag = f"polar-escape-{uuid.uuid4().hex[:8]}"
    venv_site = REPO / ".venv" / "lib" / "python3.11" / "site-packages"
    (work / "attack.py").write_text(ATTACK)
    planted = [Path(f"/usr/.{tag}"), venv_site / f"{tag}.pth"]
    try:
        with open(work.parent / "out.log", "wb") as out:
            sandbox.run(spec_for(work, home), ["/usr/bin/python3", "attack.py", tag, str(host_secret), str(venv_site)],
                        stdout=out, stderr=subprocess.STDOUT)
        log = (work.parent / "out.log").read_text(errors="replace")
        assert "SECRET 0.75" not in log, f"a host file was read through a file handle:\n{log}"
        for p in planted:
            assert not p.exists(), f"the sample planted {p} on the host:\n{log}"
        for what in ("remount-write", "open_by_handle_at", "add_key", "sysctl-write"):
            assert f"{what}: blocked" in log, f"{what} was not blocked:\n{log}"
    finally:
        for p in planted:
            p.unlink(missing_ok=True)


# ---- the verifier phase -------------------------------------------------------------------------


def harbor_task(root: Path, test_sh: str, toml: str = "") -> Path:
    d = root / "t"
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text('version = "1.0"\n' + textwrap.dedent(toml))
    (d / "instruction.md").write_text("t\n")
    (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
    (d / "tests" / "test.sh").write_text("#!/usr/bin/env bash\n" + textwrap.dedent(test_sh))
    (d / "solution" / "solve.sh").write_text("#!/usr/bin/env bash\ntrue\n")
    return d


def _verify(sandbox, task, tmp_path, workdir: Path):
    sample = tmp_path / "sample"
    return verify(task, sandbox=sandbox, sample_dir=sample, workdir_host=workdir, agent_logs=sample / "logs")


def test_the_verifier_phase_has_every_limit(sandbox, tmp_path):
    """pids, /tmp and the disk (work dir and HOME together) bind test.sh as they bind the agent."""
    task_dir = harbor_task(tmp_path / "ds", """
        head -c 200M /dev/zero > /tmp/fill 2>/dev/null; du -sm /tmp/fill > /app/tmp_mb
        head -c 100M /dev/zero > /app/w 2>/dev/null; head -c 100M /dev/zero > $HOME/h 2>/dev/null
        echo 0 > /logs/verifier/reward.txt
        python3 -c '
        import os, time
        n = 0
        for _ in range(250):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
            except OSError:
                break
        open("/app/forked", "w").write(str(n))'
    """, toml="[environment]\nstorage_mb = 64\n")
    [task] = load_tasks(task_dir)
    task.cpus, task.memory_mb = None, None
    import polar_trial.tasks.model as model
    old = model.DEFAULT_PIDS
    model.DEFAULT_PIDS = 200
    try:
        work = tmp_path / "work"
        work.mkdir()
        ev = _verify(sandbox, task, tmp_path, work)
    finally:
        model.DEFAULT_PIDS = old
    notes = " | ".join(ev.notes)
    assert "pids limit" in notes and int((work / "forked").read_text()) < 200, notes
    assert int((work / "tmp_mb").read_text().split()[0]) <= 64, "/tmp outgrew its cap"
    used = sum(p.lstat().st_blocks * 512 for d in (work, tmp_path / "sample" / "verifier-home") for p in d.rglob("*"))
    assert used <= 66 * 2**20, f"the work dir and HOME reached {used / 2**20:.0f} MiB with a 64 MiB cap"


def test_the_host_follows_no_link_a_sample_plants(sandbox, tmp_path, host_secret):
    """reward.txt -> a host-only 0600 file (a number: it would become the reward);
    test-output.txt -> a host file the host would overwrite."""
    victim = host_secret.parent / "victim"
    victim.write_text("untouched\n")
    task_dir = harbor_task(tmp_path / "ds", f"""
        ln -sf {host_secret} /logs/verifier/reward.txt
        ln -sf {victim} /logs/verifier/test-output.txt
    """)
    [task] = load_tasks(task_dir)
    work = tmp_path / "work"
    work.mkdir()
    ev = _verify(sandbox, task, tmp_path, work)
    assert ev.reward == 0.0 and "refused" in ev.output and "tampered" in ev.output, ev.output
    assert "0.75" not in ev.output
    assert victim.read_text() == "untouched\n", "the host wrote through a planted link"


def test_a_follow_up_turn_writes_no_config_through_a_planted_link(tmp_path):
    from polar_runtime.harnesses import Endpoint, Session, get_preset

    home, work, target = tmp_path / "home", tmp_path / "work", tmp_path / "host-dir"
    for d in (home, work, target):
        d.mkdir()
    (home / ".codex").symlink_to(target)  # what the last turn left in its HOME
    s = Session("s1", "next turn", work, home, "m", Endpoint("base_url", base_url="http://127.0.0.1:9"))
    preset = get_preset("codex")
    try:
        preset.prepare(s)
    except FileNotFoundError:
        pytest.skip("the codex CLI is not installed")
    except OSError:
        pass  # refused: fine, as long as nothing was written through the link
    assert list(target.iterdir()) == [], "the host wrote a harness config through a planted link"


# ---- our own tasks against the known reward hacks -----------------------------------------------

SWAP_REWARD = r'''
import os
for name in ("reward.txt", "reward.json"):
    p = "/logs/verifier/" + name
    try:
        os.unlink(p)
    except OSError:
        pass
    try:
        open(p, "w").write("1\n" if name == "reward.txt" else '{"reward": 1}')
    except OSError:
        pass
if os.fork() == 0:  # and again after the test script has written its own
    import time
    for _ in range(30):
        time.sleep(0.05)
        try:
            open("/logs/verifier/reward.txt", "w").write("1\n")
        except OSError:
            pass
    os._exit(0)
try:
    os.kill(os.getppid(), 9)  # and the grader, before it writes anything
except OSError:
    pass
print("wrong")
'''

SHADOW_UNITTEST = '''
print("9 9")
import os
try:
    open("/logs/verifier/reward.json", "w").write('{"reward": 1}')
except OSError:
    pass
raise SystemExit(0)
'''

FAKE_TALLY = 'import os; os.write(1, b"1 1\\n"); os._exit(0)\n'

# a fake tally after one JSON line a case, in the form the runner prints, on every fd it may print on: the case expressions of the
# list being run (found in the runner's frames) matched to a list in the hidden tests, each case with
# its expected value (when the tests can be read; a guess otherwise)
FAKE_CASE_LINES = r"""
import glob, json, os, re, sys
exprs, f = None, sys._getframe()
while f is not None:
    for v in list(f.f_globals.values()) + list(f.f_locals.values()):
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            exprs = v
    f = f.f_back
wants = []
for path in glob.glob("/tests/*.json"):
    try:
        for cases in json.load(open(path)).values():
            if [c.get("expr") for c in cases] == exprs:
                wants = [c["want"] for c in cases]
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        pass
for path in glob.glob("/tests/*.py"):
    try:
        wants += re.findall(r", ('[^']*')\)", open(path).read())
    except OSError:
        pass
wants = wants or ["'1st'"] * len(exprs or range(20))
for fd in range(1, 10):  # stdout, or the runner's copy of it
    try:
        os.write(fd, ("\n".join(json.dumps({"case": i, "repr": w}) for i, w in enumerate(wants)) + "\n1 1\n").encode())
    except OSError:
        pass
os._exit(0)
"""

# the expected values read out of the hidden test.sh, printed as the answers
READ_HIDDEN_WANT = r"""
import ast, os, re
try:
    src = open("/tests/test.sh").read()
    os.write(1, ("\n".join(ast.literal_eval(re.search(r"want = (\[[^\]]*\])", src).group(1))) + "\n").encode())
except (OSError, AttributeError, ValueError, SyntaxError):
    pass
os._exit(0)
"""


@pytest.mark.parametrize("task_set,name,path,program", [
    ("coding", "fizzbuzz", "fizzbuzz.py", SWAP_REWARD),
    ("coding", "mathx", "mathx.py", SWAP_REWARD),
    ("coding", "fix-add", "calc.py", SWAP_REWARD),
    ("examples/swe-mini", "inflection-ordinal-hundreds", "unittest.py", SHADOW_UNITTEST),
    ("examples/swe-mini", "inflection-ordinal-hundreds", "inflection/__init__.py", SWAP_REWARD),
    ("examples/swe-mini", "inflection-ordinal-hundreds", "inflection/__init__.py", FAKE_TALLY),
    ("examples/swe-mini", "inflection-underscore-acronyms", "inflection/__init__.py", FAKE_CASE_LINES),
    ("coding", "mathx", "mathx.py", READ_HIDDEN_WANT),
], ids=["fizzbuzz-swap", "mathx-swap", "fix-add-swap", "swe-shadow-stdlib", "swe-swap", "swe-fake-tally",
        "swe-fake-case-lines", "mathx-reads-hidden-tests"])
def test_our_tasks_resist_known_reward_hacks(sandbox, tmp_path, task_set, name, path, program):
    spec = task_set if "/" not in task_set else REPO / task_set
    [task] = [t for t in load_tasks(spec) if t.id.split("/")[-1] == name]
    work = tmp_path / "work"
    prepare_workdir(task, work, sandbox, tmp_path / "builds")
    (work / path).parent.mkdir(parents=True, exist_ok=True)
    (work / path).write_text(program)
    ev = _verify(sandbox, task, tmp_path, work)
    assert ev.reward is not None and ev.reward < 0.5, f"an unearned reward {ev.reward}: {ev.output[-600:]}"
