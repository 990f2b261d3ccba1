"""Real harnesses inside a task image that has no Node and no libc (issue 52).

The image is busybox-static from Debian and nothing else (``docker import``-ed: no loader, no
libc, no Node; a ``bash`` that is a busybox ``sh`` script, for the verifier's ``bash test.sh``).
Before the harness brought its own runtime (``polar_runtime/harnessruntime.py``), Pi there ended with
``env: 'node': No such file or directory`` and 0 model calls. Here Pi (and Codex) run through the
real proxy in exact-history mode to the test session's vLLM serving tiny-qwen, on a Harbor task
with two follow-up turns: every call captured with its token ids, every follow-up's prompt spliced
exactly from the model's own ids, and the reward written by the task's own test.sh, run by busybox
in the same image. The harness's HOME is the image user's (``/root``), its config copied in and
its sessions read back through safetar; the HOME copy alone, in per-phase containers and in a live
trial whose agent is a non-root user, with a FIFO and a link to a host file left for the read-back
and a link planted where the config goes, is checked without a model (2-4 s each).

Wall time on the 2-core CI machine kind (harnesses installed, the runtime built once, 1.3 s): the
image ~2 s, the relaunch/payload/library checks 12-19 s, Pi 32 s (81 s with the machine's load
average at 20; 26-27 s at load 5-9 with the HOME copy and read-back), Codex 25-68 s (8-13 s at load
5-9); the shared dockerd and vLLM are started once per session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

from polar_core.schema import SESSIONS_SUBDIR, read_capture_lines
from polar_runtime import harnesses as h
from polar_runtime import rollout as r
from polar_runtime.harnessruntime import INSIDE
from polar_trial.tasks import load_tasks

pytestmark = [pytest.mark.docker, pytest.mark.harness]
IMAGE = "polar-test/nolibc:1"
CAP = 24  # polar_max_tokens_cap: every tiny-qwen answer is cut (finish length), so each turn is one call
FOLLOWUPS = ["Now also write two.txt.", "Which files did you write?"]


@pytest.fixture(scope="module")
def nolibc_image(dockerd):
    """busybox-static alone, imported as an image: no loader, no libc, no Node."""
    from polar_trial.sandbox.dockerd import ensure_installed

    ensure_installed(("busybox-static",), "busybox")
    from polar_runtime.harnessruntime import elf_interpreter

    busybox = shutil.which("busybox") or "/bin/busybox"
    if elf_interpreter(busybox) != "":
        pytest.fail(f"{busybox} is not statically linked: apt-get install busybox-static (scripts/setup.sh does)")
    root = Path(tempfile.mkdtemp(prefix="polar-nolibc-"))
    try:
        for d in ("bin", "etc", "tmp", "root", "app", "usr/bin"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(busybox, root / "bin" / "busybox")
        applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
        for a in applets:
            if a != "busybox":
                os.symlink("busybox", root / "bin" / a)
        os.symlink("/bin/env", root / "usr" / "bin" / "env")
        (root / "bin" / "bash").write_text('#!/bin/sh\nexec /bin/sh "$@"\n')  # the verifier runs `bash test.sh`
        os.chmod(root / "bin" / "bash", 0o755)
        os.chmod(root / "tmp", 0o1777)
        os.chmod(root, 0o755)  # mkdtemp's 0700 would be the image's /: a remapped root could not enter it
        # a non-root user whose passwd HOME the image lacks (the harness's HOME is made and copied there)
        (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n")
        (root / "etc" / "group").write_text("root:x:0:\nagent:x:1000:\n")
        (root / "home").mkdir()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-c", "ENV PATH=/usr/local/bin:/usr/bin:/bin", "-", IMAGE],
                       stdin=tar.stdout, check=True, capture_output=True, env=dockerd.env())
        assert tar.wait() == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ls = subprocess.run(["docker", "run", "--rm", "--network", "none", IMAGE, "sh", "-c", "ls /lib* /usr/lib 2>&1"],
                        capture_output=True, text=True, env=dockerd.env())
    assert "No such file" in ls.stdout, ls.stdout  # truly no libc
    return IMAGE


def harbor_task(root: Path, harness: str) -> Path:
    t = root / f"hello-nolibc-{harness}"  # its own task id: the module's rollouts share one capture dir
    (t / "environment").mkdir(parents=True)
    (t / "tests").mkdir()
    (t / "instruction.md").write_text("Write the word hello to /app/hello.txt.\n")
    (t / "environment" / "Dockerfile").write_text(f"FROM {IMAGE}\nWORKDIR /app\n")
    (t / "tests" / "test.sh").write_text(textwrap.dedent("""\
        #!/bin/bash
        # graded by busybox in the task's own image (no libc there)
        echo "graded by $(readlink /bin/sh) in an image with $(ls /lib 2>/dev/null | wc -l) entries in /lib"
        mkdir -p /logs/verifier
        if grep -qi hello /app/hello.txt 2>/dev/null; then echo 1 > /logs/verifier/reward.txt
        else echo 0 > /logs/verifier/reward.txt; fi
        """))
    (t / "task.toml").write_text(textwrap.dedent(f"""\
        version = "1.0"
        [verifier]
        timeout_sec = 60.0
        [agent]
        timeout_sec = 200.0
        [environment]
        cpus = 1
        memory_mb = 2048
        [polar]
        followups = {FOLLOWUPS!r}
        """).replace("'", '"'))
    return t


@pytest.fixture(scope="module")
def proxy(vllm_tiny, tmp_path_factory):
    from polar_testing.proxies import capturing_proxy

    with capturing_proxy(vllm_tiny.base_url, tmp_path_factory.mktemp("harness-images"),
                         vllm_tiny.served_model_name, polar_max_tokens_cap=CAP) as started:
        yield started


def read_calls(capture_dir: Path, sid: str) -> list[dict]:
    path = capture_dir / SESSIONS_SUBDIR / f"{sid}.jsonl"
    return sorted(read_capture_lines(path), key=lambda c: c["call_index"]) if path.exists() else []


def log_tail(row: dict) -> str:
    logs = Path(row["workdir"]).parent / "logs"
    return row["sandbox_notes"] + "\n" + "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(logs.glob("*")) if p.is_file())


def in_image(dockerd, image: str, argv: list[str], env: dict[str, str], binds: list[tuple[str, str]] = ()) -> subprocess.CompletedProcess:
    from polar_core import paths
    from polar_runtime.harnessruntime import harness_runtime

    rt = harness_runtime()
    a = ["docker", "run", "--rm", "--network", "none", "-v", f"{rt.dir}:{INSIDE}:ro",
         "-v", f"{paths.harnesses_dir()}:{paths.harnesses_dir()}:ro"]
    for host, dest in binds:
        a += ["-v", f"{host}:{dest}"]
    for k, v in env.items():
        a += ["-e", f"{k}={v}"]
    return subprocess.run([*a, "--entrypoint", argv[0], image, *argv[1:]], capture_output=True, text=True,
                          timeout=120, env=dockerd.env())


def test_relaunches_bun_payloads_and_a_tasks_library_path(nolibc_image, dockerd, tmp_path):
    """What the spike found breaks, each in the no-libc image (~6 s): Gemini CLI relaunches itself
    through ``process.execPath`` with ``--max-old-space-size`` even for ``--version`` (through the
    loader, execPath is the loader: ``unrecognized option``); Claude Code's Bun binary, run by the
    loader, finds its payload; a task's ENV ``LD_LIBRARY_PATH`` naming a planted ``libc.so.6`` does
    not reach node (DT_RPATH is searched first; a RUNPATH would lose)."""
    from polar_runtime.harnessruntime import harness_runtime

    rt = harness_runtime()
    for name, want in (("gemini", "0.61.0"), ("claude-code", "Claude Code")):
        preset = h.get_preset(name)
        if not preset.installed():
            pytest.fail(f"{name} is not installed: run `polar harness install {preset.package}` (setup does)")
        argv, env = rt.adapt([str(preset.binary()), "--version"], {"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
        res = in_image(dockerd, nolibc_image, argv, env)
        assert res.returncode == 0 and want in res.stdout, (name, argv, res.stdout[-500:], res.stderr[-1500:])
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "libc.so.6").write_bytes(b"\x7fELF not a library")
    res = in_image(dockerd, nolibc_image, [rt.node, "-e", "console.log(process.execPath)"],
                   {"LD_LIBRARY_PATH": "/evil"}, [(str(evil), "/evil")])
    assert res.returncode == 0 and res.stdout.strip() == rt.node, res.stderr[-800:]
    # the tools come after the image's PATH, found by name by a shell of the image
    _, env = rt.adapt([rt.node], {"PATH": "/usr/bin:/bin"})
    res = in_image(dockerd, nolibc_image, ["/bin/sh", "-c", "command -v rg fd && rg --version && fd --version"], env)
    assert res.returncode == 0 and f"{INSIDE}/tools/rg" in res.stdout and "ripgrep" in res.stdout, res.stderr


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["pi-chat", "codex"])
def test_harness_runs_in_an_image_without_node_or_libc(name, nolibc_image, proxy, vllm_tiny, tmp_path):
    preset = h.get_preset(name)
    if not preset.installed():
        pytest.fail(f"{name} is not installed: run `polar harness install {preset.package}` (setup does)")
    capture_dir, px = proxy
    (task,) = load_tasks(harbor_task(tmp_path, name), container=True)
    cfg = r.RolloutConfig(tasks=[task], preset=preset, endpoint=h.Endpoint("base_url", base_url=px.url),
                          capture_dir=capture_dir, model=vllm_tiny.served_model_name, samples=1, timeout=200,
                          eval_timeout=60, sandbox="docker", work_root=tmp_path / "work")
    df = r.run_rollout(cfg, control=px.control)  # every row of the shared capture dir: this task's
    row = df.filter(df["task_id"] == task.id).row(0, named=True)
    calls = read_calls(capture_dir, row["session_id"])
    assert row["harness"] == name and row["status"] == "ok" and row["turns"] == 3, log_tail(row)
    assert f"harness runtime bound read-only at {INSIDE}" in row["sandbox_notes"], row["sandbox_notes"]
    assert len(calls) >= 3 and row["calls"] == len(calls)
    for c in calls:
        assert c["status"] == "ok" and c["prompt_token_ids"] and c["sampled_token_ids"], (c["status"], c.get("error"))
        assert len(c["sampled_logprobs"]) == len(c["sampled_token_ids"])
    # every follow-up re-sends the history: its prompt is the earlier call's own ids, spliced exactly
    for text in FOLLOWUPS:
        at = next(i for i, c in enumerate(calls) if text in str(c["normalized_request"]))
        before, resumed = calls[at - 1], calls[at]
        assert resumed["history"] == "exact", (resumed["history"], resumed.get("history_cause"))
        head = before["prompt_token_ids"] + before["sampled_token_ids"]
        assert resumed["prompt_token_ids"][: len(head)] == head
    # the task's own verifier, in the same image: busybox graded it (tiny-qwen writes no hello.txt)
    assert row["evaluator_status"] in ("pass", "fail") and row["reward"] in (0.0, 1.0), row["evaluator_output"]
    assert "graded by busybox in an image with 0 entries in /lib" in row["evaluator_output"]
    # its HOME was the image user's (/root), the config copied in, not bound (CODEX_HOME and
    # PI_CODING_AGENT_DIR moved there: the follow-ups resumed from it), and what the harness left
    # there came back into the sample's host HOME through safetar
    assert "copied into /root (user " in row["sandbox_notes"], row["sandbox_notes"]
    home = Path(row["workdir"]).parent / "home"
    sessions = home / (".codex/sessions" if name == "codex" else ".pi/agent/sessions")
    assert list(sessions.rglob("*.jsonl")), sorted(str(p.relative_to(home)) for p in home.rglob("*"))[:40]


#: a turn of a "harness" in the image: what its HOME holds, then the hostile leftovers a sample may
#: leave for the read-back (a FIFO, a link to a host file) and for the next turn's copy (its config
#: replaced by a link to a file of its own)
HOME_TURN1 = r"""
echo "uid=$(id -u) home=$HOME codex=$CODEX_HOME xdg=$XDG_CONFIG_HOME"
stat -c "owner=%u mode=%a" "$CODEX_HOME/config.toml"
cat "$CODEX_HOME/config.toml"
[ -e "${1#host:}" ] && echo "HOST HOME VISIBLE"  # (a bare host HOME argument is moved too)
echo "mounts at HOME: $(grep -c " $HOME " /proc/self/mountinfo)"
mkdir -p "$CODEX_HOME/sessions"
echo '{"turn":1}' > "$CODEX_HOME/sessions/s.jsonl"
mkdir -p "$XDG_DATA_HOME/opencode" && echo db > "$XDG_DATA_HOME/opencode/opencode.db"  # OpenCode's sessions
mkfifo "$CODEX_HOME/sessions/fifo.jsonl"
ln -s "$2" "$CODEX_HOME/sessions/link.jsonl"
echo mine > /tmp/victim && rm "$CODEX_HOME/config.toml" && ln -s /tmp/victim "$CODEX_HOME/config.toml"
"""
HOME_TURN2 = r"""
echo "victim: $(cat /tmp/victim 2>&1)"
[ -L "$CODEX_HOME/config.toml" ] && echo "CONFIG IS A LINK"
cat "$CODEX_HOME/config.toml" "$CODEX_HOME/sessions/s.jsonl"
"""


def _home_spec(tmp_path: Path, image: str) -> "SandboxSpec":
    from polar_trial import SandboxSpec

    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text('model_provider = "polar"\n')
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
           "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local" / "share")}
    return SandboxSpec(workdir_host=tmp_path / "work", workdir="/app", home_copy=home, image=image, env=env,
                       timeout_s=60)


def _turn(box, spec, script: str, secret: Path, tmp_path: Path) -> tuple[str, list[str]]:
    out = tmp_path / "out"
    with open(out, "wb") as fh:
        res = box.run(spec, ["/bin/sh", "-c", script, "sh", f"host:{spec.home_copy}", str(secret)], stdout=fh, stderr=fh)
    text = out.read_text()
    assert res.returncode == 0, (text, res.notes)
    return text, res.notes


def _read_back_checks(spec, notes: list[str]) -> None:
    codex = spec.home_copy / ".codex"
    assert (codex / "sessions" / "s.jsonl").read_text() == '{"turn":1}\n', notes  # read back
    assert (spec.home_copy / ".local/share/opencode/opencode.db").read_text() == "db\n", notes  # not the preset's
    for name in ("fifo.jsonl", "link.jsonl"):  # neither kept nor followed
        assert not os.path.lexists(codex / "sessions" / name), notes
    assert not (codex / "config.toml").is_symlink() and "polar" in (codex / "config.toml").read_text()
    assert any("special file" in n and "fifo.jsonl" in n for n in notes), notes
    assert any("outside the tree dropped" in n and "link.jsonl" in n for n in notes), notes


def test_harness_home_in_per_phase_containers(nolibc_image, dockerd, tmp_path):
    """Per-phase containers (``live_trial`` off: a fresh container each turn): the config lands in
    the HOME of the container's user (root: /root), CODEX_HOME and XDG follow, the host HOME is
    not mounted; the turn's sessions come back to the host through safetar (a FIFO and a link to
    a host file left behind), and the next turn's fresh container finds them (~3 s)."""
    from polar_runtime.harnessruntime import image_path
    from polar_trial import DockerSandbox

    # the harness's PATH starts from the image's config (its `docker import -c ENV PATH=...`)
    assert image_path(nolibc_image) == "/usr/local/bin:/usr/bin:/bin"
    secret = tmp_path / "secret"
    secret.write_text("host secret\n")
    spec = _home_spec(tmp_path, nolibc_image)
    box = DockerSandbox()
    text, notes = _turn(box, spec, HOME_TURN1, secret, tmp_path)
    assert "uid=0 home=/root codex=/root/.codex xdg=/root/.config" in text and "owner=0 mode=600" in text, text
    assert 'model_provider = "polar"' in text and "HOST HOME VISIBLE" not in text, text
    assert "mounts at HOME: 0" in text, text
    _read_back_checks(spec, notes)
    text, notes = _turn(box, spec, HOME_TURN2, secret, tmp_path)
    assert '{"turn":1}' in text and "CONFIG IS A LINK" not in text, text


def test_harness_home_in_a_live_trial_as_the_images_user(nolibc_image, dockerd, tmp_path):
    """The live trial, the agent as the image's non-root user ``agent`` (passwd HOME
    /home/agent, which the image lacks): the config is there, owned by the agent, 0600; the host
    HOME is not mounted; the read-back refuses the FIFO and the link; on the next turn the config
    copied as the agent replaces the link the sample left at it and writes nothing through it
    (~4 s)."""
    from polar_trial import DockerSandbox
    from polar_trial.sandbox.trial import LiveTrial, TrialConfig

    secret = tmp_path / "secret"
    secret.write_text("host secret\n")
    spec = _home_spec(tmp_path, nolibc_image)
    with LiveTrial(DockerSandbox(), TrialConfig(image=nolibc_image, workdir_host=spec.workdir_host,
                                                agent_user="agent")) as trial:
        box = trial.view("agent")
        text, notes = _turn(box, spec, HOME_TURN1, secret, tmp_path)
        assert "uid=1000 home=/home/agent codex=/home/agent/.codex xdg=/home/agent/.config" in text, text
        assert "owner=1000 mode=600" in text and 'model_provider = "polar"' in text, text
        assert "HOST HOME VISIBLE" not in text and "mounts at HOME: 0" in text, text
        assert any("copied into /home/agent (user agent's passwd HOME)" in n for n in notes), notes
        _read_back_checks(spec, notes)
        text, notes = _turn(box, spec, HOME_TURN2, secret, tmp_path)
        assert "victim: mine" in text and "CONFIG IS A LINK" not in text, text
        assert 'model_provider = "polar"' in text and '{"turn":1}' in text, text
