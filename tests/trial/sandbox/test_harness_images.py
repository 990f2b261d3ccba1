"""Real harnesses inside a task image that has no Node and no libc (issue 52).

The image is busybox-static from Debian and nothing else (``docker import``-ed: no loader, no
libc, no Node; a ``bash`` that is a busybox ``sh`` script, for the verifier's ``bash test.sh``).
Before the harness brought its own runtime (``polar_runtime/harnessruntime.py``), Pi there ended with
``env: 'node': No such file or directory`` and 0 model calls. Here Pi (and Codex) run through the
real proxy in exact-history mode to the test session's vLLM serving tiny-qwen, on a Harbor task
with two follow-up turns: every call captured with its token ids, every follow-up's prompt spliced
exactly from the model's own ids, and the reward written by the task's own test.sh, run by busybox
in the same image.

Wall time on the 2-core CI machine kind (harnesses installed, the runtime built once, 1.3 s): the
image ~2 s, the relaunch/payload/library checks 12-19 s, Pi 32 s (81 s with the machine's load
average at 20), Codex 25-68 s; the shared dockerd and vLLM are started once per session.
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
        (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (root / "etc" / "group").write_text("root:x:0:\n")
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
    from polar_proxy.process import ProxyProcess

    root = tmp_path_factory.mktemp("harness-images")
    px = ProxyProcess(vllm_tiny.base_url, root / "captures", confdir=root / "mitmproxy",
                      served_model=vllm_tiny.served_model_name, log_file=root / "proxy.log",
                      options={"polar_exact_history": True, "polar_max_tokens_cap": CAP}).start()
    try:
        yield root / "captures", px
    finally:
        px.stop()


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
