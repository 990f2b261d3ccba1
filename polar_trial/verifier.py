"""The verifier phase: after the agent phase has ended (every process of it gone), the task's
hidden tests are copied fresh to ``/tests`` -- they are never visible while the agent runs -- and
``tests/test.sh`` runs in a sandbox of its own on the sample's work dir; the float it wrote to
``/logs/verifier/reward.txt`` (or ``reward.json``) is the sample's reward.

Outcomes (``Evaluation.status``):

* ``pass`` / ``fail``: a reward was written (``fail`` when it is <= 0);
* ``fail`` with reward 0 and a ``verdict tampered`` note: the verdict was tampered with -- the
  reward file is a link, a FIFO or another special file, or bigger than any reward (64 KiB), or
  test.sh was killed by a signal that was not our timeout (a program of the sample's killed the
  test runner). The sample did it, so it is the sample's failure: reward 0, never "no signal"
  (a failing sample must not turn its 0 into a zero advantage by breaking the verdict);
* ``timeout``: test.sh ran past the verifier timeout: reward 0 (the tests run the sample's work,
  and a hang there -- a program that never returns, a server that never answers -- is the
  sample's failure; a task whose tests hang for the oracle too shows in ``polar tasks check``);
* ``error``: test.sh wrote no reward with no sign of tampering, wrote something that is not a
  finite number, or could not start (reward null: an infrastructure failure, zero advantage);
* ``none``: the task has no tests.

Verifier failures are recorded per sample, never fatal to the rollout. Everything the verifier
printed is kept in ``<sample>/verifier/test-output.txt`` (with whatever test.sh itself wrote under
/logs/verifier) and its tail in the rollout row. test.sh sees the task's ENV values, task.toml's
``[verifier] env``, and POLAR_SESSION, POLAR_TASK_ID, POLAR_STATUS (the agent phase's outcome),
POLAR_WORKDIR, POLAR_HARNESS_STDOUT / POLAR_HARNESS_STDERR (the harness's output under
``/logs/agent``, read-only), POLAR_TESTS_DIR (and TEST_DIR, Terminal-Bench's name) and POLAR_VERIFIER_DIR.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_trial.failures import failure_notes
from polar_trial.sandbox.egress import registries
from polar_trial.tasks.environment import build_env
from polar_trial.tasks.model import DEFAULT_PATH, DEFAULT_VERIFIER_TIMEOUT, Task

OUTPUT_TAIL = 4000
REWARD_FILE_LIMIT = 64 * 1024
TEST_OUTPUT_LIMIT = 16 * 2**20
#: how much of a test.sh is read to find the uv installer it fetches (a test.sh is a few KiB)
TEST_SH_LIMIT = 1 * 2**20


@dataclass
class Evaluation:
    reward: float | None
    status: str  # pass | fail | error | timeout | none
    output: str
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


class TamperedVerdict(Exception):
    """The reward file is not what a test.sh writes: a link, a special file, an oversize file."""


def read_reward(verifier_dir: Path) -> tuple[float | None, str, bool]:
    """(reward, problem, tampered): the float in reward.txt, else reward.json's ``reward`` (or its
    only number); problem is "" when a finite reward was found.

    ``/logs/verifier`` is writable by the sample's own programs (the tests run them), so a reward
    file that is a symlink (to a host-only 0600 file, say), a FIFO or a device is never followed
    or opened, and one over 64 KiB is not read: each is refused with ``tampered`` True."""
    from polar_trial.sandbox.hostfs import UnsafePath, read_bytes

    def read(name: str) -> str | None:
        try:
            data = read_bytes(verifier_dir, verifier_dir / name, limit=REWARD_FILE_LIMIT + 1)
        except FileNotFoundError:
            return None
        except UnsafePath as exc:
            raise TamperedVerdict(f"{name} refused: {exc}") from None
        if len(data) > REWARD_FILE_LIMIT:
            raise TamperedVerdict(f"{name} is over {REWARD_FILE_LIMIT // 1024} KiB; not read")
        return data.decode(errors="replace")

    value: Any = None
    try:
        raw_txt = read("reward.txt")
        raw_js = read("reward.json") if raw_txt is None else None
    except TamperedVerdict as exc:
        return None, f"refused to read the reward: {exc}", True
    except UnsafePath as exc:  # a link on the way to the verifier dir itself
        return None, f"refused to read the reward: {exc}", True
    except OSError as exc:
        return None, f"cannot read the reward: {exc}", False
    if raw_txt is not None:
        raw = raw_txt.strip()
        try:
            value = float(raw)
        except ValueError:
            return None, f"reward.txt holds {raw[:80]!r}, not a number", False
    elif raw_js is not None:
        try:
            data = json.loads(raw_js)
        except ValueError as exc:
            return None, f"reward.json is not JSON: {exc}", False
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            value = data
        elif isinstance(data, dict):
            nums = {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if "reward" in nums:
                value = nums["reward"]
            elif len(nums) == 1:
                value = next(iter(nums.values()))
            else:
                return None, f"reward.json has no 'reward' key and {len(nums)} numbers: {sorted(nums)[:5]}", False
        else:
            return None, "reward.json holds neither a number nor an object", False
    else:
        return None, "test.sh wrote no /logs/verifier/reward.txt or reward.json", False
    value = float(value)
    if not math.isfinite(value):
        return None, f"reward is {value}", False
    return value, "", False


def verify(task: Task, *, sandbox: Any, sample_dir: Path, workdir_host: Path, agent_logs: Path,
           facts: dict[str, str] | None = None, timeout: float | None = None,
           base_path: str | None = None, image: str | None = None) -> Evaluation:
    """Run the task's tests on ``workdir_host`` in ``sandbox``; never raises for test failures."""
    from polar_trial.sandbox import SandboxError, SandboxSpec

    if not task.has_tests:
        return Evaluation(None, "none", "")
    tests, vdir = sample_dir / "tests", sample_dir / "verifier"
    if vdir.exists():
        shutil.rmtree(vdir)
    vdir.mkdir(parents=True)
    home = sample_dir / "verifier-home"
    home.mkdir(parents=True, exist_ok=True)
    agent_logs.mkdir(parents=True, exist_ok=True)
    limit = timeout or task.verifier_timeout or DEFAULT_VERIFIER_TIMEOUT
    t0 = time.monotonic()
    try:
        task.write_tests(tests)  # only now: the agent phase never saw them
    except OSError as exc:
        return Evaluation(None, "error", f"tests could not be copied: {exc}", time.monotonic() - t0)
    spec = SandboxSpec(workdir_host=workdir_host, workdir=task.workdir, home_host=home,
                       rw_binds=[(tests, "/tests"), (vdir, "/logs/verifier")], ro_binds=[(agent_logs, "/logs/agent")],
                       egress=registries(), **task.limits(), timeout_s=limit, image=image or task.image,
                       userns_caps=True)
    env = build_env(task, base_path)
    env.update(LANG="C.UTF-8", HOME=sandbox.inside(spec, home), TERM="dumb")
    for k, v in (facts or {}).items():
        env[f"POLAR_{k.upper()}"] = sandbox.inside(spec, v) if k in ("harness_stdout", "harness_stderr") else v
    env["TEST_DIR"] = sandbox.inside(spec, tests)  # Terminal-Bench's name for it, which many test.sh use
    env.update(POLAR_WORKDIR=sandbox.inside(spec, workdir_host), POLAR_TESTS_DIR=sandbox.inside(spec, tests),
               POLAR_VERIFIER_DIR=sandbox.inside(spec, vdir))
    env.update(task.verifier_env)
    stand_in_notes: list[str] = []
    if getattr(sandbox, "builds_images", False):
        # Terminal-Bench 2's `curl https://astral.sh/uv/<v>/install.sh | sh`, answered locally
        # (sandbox/uvstandin.py); said in the notes of every run it served
        from polar_trial.sandbox.uvstandin import MOUNT, UvStandInError, verifier_binds

        try:
            from polar_trial.sandbox.hostfs import read_bytes

            # the task's file: a link or a FIFO there is not followed (hostfs), a huge one not read whole
            script = read_bytes(tests, tests / "test.sh", limit=TEST_SH_LIMIT).decode(errors="replace")
            binds, stand_in_notes = verifier_binds(script)
        except (OSError, UvStandInError) as exc:
            stand_in_notes = [f"no local uv installer: {exc}"]
            binds = []
        if binds:
            spec.ro_binds += binds
            env["PATH"] = f"{MOUNT}/bin:{env.get('PATH', DEFAULT_PATH)}"
    spec.env = env
    out_path = sample_dir / "verifier-output.txt"
    try:
        with open(out_path, "wb") as out:
            res = sandbox.run(spec, ["bash", sandbox.inside(spec, tests / "test.sh")], stdout=out, stderr=out)
    except (SandboxError, OSError) as exc:
        return Evaluation(None, "error", f"the verifier could not start: {exc}", time.monotonic() - t0)
    secs = time.monotonic() - t0
    with open(out_path, "rb") as fh:  # only the end (the phase's output is bounded: sandbox/base.py)
        fh.seek(max(0, fh.seek(0, 2) - 4 * OUTPUT_TAIL))
        output = fh.read().decode(errors="replace")
    with_notes = stand_in_notes + list(res.notes)
    if res.timed_out:
        why = (f"the verifier timed out after {limit:g} s: scored 0 (a hang in the tests of the sample's "
               f"work is the sample's failure)")
        return Evaluation(0.0, "timeout", (output + f"\n[polar] {why}")[-OUTPUT_TAIL:], secs, with_notes + [why])
    reward, problem, tampered = read_reward(vdir)
    if reward is None and not tampered:
        # a FIFO or device where the reward should be is not copied back from the disk image:
        # absent on the host, but the phase put it there
        planted = {str(vdir / name) for name in ("reward.txt", "reward.json")} & set(res.special_files)
        if planted:
            tampered = True
            problem = f"refused to read the reward: {', '.join(sorted(Path(p).name for p in planted))} was a special file"
    _keep_output(out_path, vdir)
    if reward is None or reward < 1:  # a failed verdict says why: its failing tests, else the output's end
        with_notes = with_notes + failure_notes(vdir, output)
    if reward is None:
        signal = _killed_by(res.returncode)
        oom = any(n.startswith("memory limit hit") for n in res.notes)
        if signal and oom and getattr(task, "clamped", {}).get("memory_mb"):
            # the host has less memory than the task asks for: the machine's failure, not the sample's
            why = (f"test.sh was killed at the memory limit clamped to this host "
                   f"({task.memory_mb} MiB; the task asks {task.clamped['memory_mb']} MiB): no verdict")
            return Evaluation(None, "error", (output + f"\n[polar] {why}")[-OUTPUT_TAIL:], secs, with_notes + [why])
        if tampered or signal:
            why = f"verdict tampered: {problem}" if tampered else (
                f"no verdict: test.sh was killed at the task's memory limit ({task.memory_mb} MiB) and wrote "
                f"no reward (the tests ran the sample's work)" if oom else
                f"verdict tampered: test.sh was killed by signal {signal} (not by the verifier's timeout) "
                f"and wrote no reward")
            return Evaluation(0.0, "fail", (output + f"\n[polar] {why}; scored 0")[-OUTPUT_TAIL:], secs,
                              with_notes + [why + "; scored 0"])
        msg = f"\n[polar] {problem} (test.sh exited {res.returncode})"
        return Evaluation(None, "error", (output + msg)[-OUTPUT_TAIL:], secs, with_notes)
    return Evaluation(reward, "pass" if reward > 0 else "fail", output[-OUTPUT_TAIL:], secs, with_notes)


def _killed_by(returncode: int) -> int | None:
    """The signal that ended test.sh: -N from the runtime, or 128+N as the sandbox's init and
    shells report it (129-159; 126/127 are "cannot execute" / "not found", not a signal)."""
    if returncode < 0:
        return -returncode
    if 128 < returncode < 160:
        return returncode - 128
    return None


def _keep_output(out_path: Path, vdir: Path) -> None:
    """test-output.txt next to what test.sh wrote: a link planted under that name is replaced, not
    written through."""
    from polar_trial.sandbox.hostfs import write_bytes

    try:
        with open(out_path, "rb") as fh:
            write_bytes(vdir, vdir / "test-output.txt", fh.read(TEST_OUTPUT_LIMIT))
    except OSError:
        pass  # the output stays in verifier-output.txt; the reward does not depend on it
