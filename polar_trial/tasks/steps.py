"""Multi-step Harbor tasks (``[[steps]]`` in task.toml), with Harbor's semantics.

Read from Harbor 0.26's own code (``harbor/trial/multi_step.py``, ``models/task/config.py``
``StepConfig``, ``models/task/paths.py``, ``verifier/verifier.py``, ``agents/oracle.py``; the sdist
carries no test suite):

* a step is ``[[steps]]`` with a ``name`` (one portable directory name, unique ignoring case and
  Unicode normalisation), optional ``[steps.agent] timeout_sec``/``user``, ``[steps.verifier]
  timeout_sec``/``env``/``user`` and ``min_reward``; its files are under ``steps/<name>/``:
  ``instruction.md`` (required), ``tests/`` (uploaded to /tests *after* the task's shared
  ``tests/``, so a step's ``test.sh`` replaces the shared one; without one the shared runs),
  ``solution/solve.sh`` (the oracle's for that step, else the shared ``solution/``), and
  ``workdir/`` (copied into the work dir before the step; its ``setup.sh`` runs there first);
* the steps run in order, in **one** environment (Harbor's trial: nothing is reset between steps
  but the verifier's /tests and /logs/verifier); each step's agent runs, then that step's tests;
* ``min_reward`` stops the remaining steps when this step's reward is below it: a number gates
  the ``reward`` key, a table each key it names; a missing verdict counts as -inf. A step whose
  agent failed *and* which has no verdict stops them too;
* the trial's reward (``multi_step_reward_strategy``): ``mean`` (the default) is the mean over the
  steps that have a verdict (steps not run, or without one, are not in the denominator); ``final``
  is the last step's run.

For training a trial is one sample: one session (the harness's conversation is resumed from step
to step, as Polar's follow-ups are: one token stream to learn from, where Harbor starts a fresh
conversation per step unless ``resume_trajectory``), one reward, the one Harbor reports for the
trial, each step's reward recorded beside it (``step_rewards`` in rollouts.parquet).

Polar reads rewards as one number, so a ``min_reward`` table may name only ``reward``. What a step
sets that Polar does not run (a per-step ``healthcheck``, ``artifacts``, a separate verifier
environment, for a step or the whole task, a step user other than root) is refused naming the key.
"""

from __future__ import annotations

import math
import re
import shutil
import unicodedata
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from polar_trial.tasks.model import Task, _fresh, _make_executable

STEP_KEYS = {"name", "agent", "verifier", "min_reward"}
AGENT_KEYS = {"timeout_sec", "user"}
VERIFIER_KEYS = {"timeout_sec", "env", "user"}
STRATEGIES = ("mean", "final")
_INVALID = re.compile(r'[<>:"/\\|?*\x00-\x1f\x7f]')
_DEVICE = re.compile(r"^(CON|PRN|AUX|NUL|CONIN\$|CONOUT\$|(?:COM|LPT)[1-9¹²³])$", re.IGNORECASE)


@dataclass
class TaskStep:
    name: str
    instruction: str
    dir: Path  # steps/<name>
    agent_timeout: float | None = None
    verifier_timeout: float | None = None
    verifier_env: dict[str, str] = field(default_factory=dict)
    min_reward: float | dict[str, float] | None = None

    @property
    def workdir_files(self) -> Path | None:
        d = self.dir / "workdir"
        return d if d.is_dir() else None


@dataclass
class StepResult:
    name: str
    reward: float | None
    status: str  # the verifier's: pass | fail | error | timeout | none; "not run"
    agent_status: str = "ok"
    stopped: str = ""  # why the steps after this one did not run

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "reward": self.reward, "status": self.status, "agent_status": self.agent_status,
                **({"stopped": self.stopped} if self.stopped else {})}


def valid_name(name: Any) -> str:
    """Harbor's ``validate_step_name``: one portable directory name."""
    if (not isinstance(name, str) or not name.strip() or name in {".", ".."} or name.endswith((".", " "))
            or _INVALID.search(name) or _DEVICE.fullmatch(name.partition(".")[0].rstrip(" "))
            or len(name.encode()) > 255):
        raise ValueError(f"[[steps]] name {name!r}: a step name must be one portable directory name")
    return name


def _seconds(table: dict, key: str, where: str) -> float | None:
    if key not in table:
        return None
    v = table[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"{where} {key} must be a positive number of seconds")
    return float(v)


def _min_reward(v: Any, where: str) -> float | dict[str, float] | None:
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, dict) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values()):
        other = sorted(set(v) - {"reward"})
        if other:
            raise ValueError(f"{where} min_reward names {other}: Polar reads a step's reward as one number "
                             "(reward.txt, or reward.json's 'reward'), so only 'reward' can be gated")
        return {k: float(x) for k, x in v.items()}
    raise ValueError(f"{where} min_reward must be a number or a table of numbers, not {v!r}")


def read_steps(root: Path, cfg: dict[str, Any], read_text, root_users: tuple[str, ...]) -> tuple[list[TaskStep], str]:
    """(the steps of task.toml ``cfg``, the reward strategy); ``read_text(path, what)`` reads a
    task file without following a link out of the task. ValueError names what is wrong."""
    raw = cfg.get("steps")
    if not isinstance(raw, list) or not raw or not all(isinstance(s, dict) for s in raw):
        raise ValueError("steps must be a non-empty array of tables ([[steps]])")
    if (cfg.get("verifier") or {}).get("environment_mode") == "separate":
        raise ValueError("[verifier] environment_mode = \"separate\" with [[steps]]: Polar runs each step's tests "
                         "in the trial's environment (a separate environment per step is not supported)")
    strategy = cfg.get("multi_step_reward_strategy") or "mean"
    if strategy not in STRATEGIES:
        raise ValueError(f"multi_step_reward_strategy must be one of {STRATEGIES}, not {strategy!r}")
    steps, seen = [], set()
    for i, s in enumerate(raw, 1):
        name = valid_name(s.get("name"))
        where = f"[[steps]] {name!r}:"
        key = unicodedata.normalize("NFC", name).casefold()
        if key in seen:
            raise ValueError(f"{where} step names must be unique (ignoring case and Unicode normalisation)")
        seen.add(key)
        for k in sorted(set(s) - STEP_KEYS):
            raise ValueError(f"{where} {k} is not supported by Polar's multi-step trial "
                             f"(it reads {', '.join(sorted(STEP_KEYS))})")
        agent, verifier = s.get("agent") or {}, s.get("verifier") or {}
        for sect, table, known in (("agent", agent, AGENT_KEYS), ("verifier", verifier, VERIFIER_KEYS)):
            if not isinstance(table, dict):
                raise ValueError(f"{where} [steps.{sect}] must be a table")
            for k in sorted(set(table) - known):
                raise ValueError(f"{where} [steps.{sect}] {k} is not supported by Polar's multi-step trial")
            user = table.get("user")
            if user is not None and str(user) not in root_users:
                raise ValueError(f"{where} [steps.{sect}] user = {user!r}: every phase runs as root")
        env = verifier.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ValueError(f"{where} [steps.verifier] env must be a table of strings")
        d = root / "steps" / name
        instruction = read_text(d / "instruction.md", f"steps/{name}/instruction.md").strip()
        if not instruction:
            raise ValueError(f"{d / 'instruction.md'} is empty")
        if not (d / "tests" / "test.sh").is_file() and not (root / "tests" / "test.sh").is_file():
            raise ValueError(f"{where} neither steps/{name}/tests/test.sh nor tests/test.sh (its verifier)")
        steps.append(TaskStep(name=name, instruction=instruction, dir=d,
                              agent_timeout=_seconds(agent, "timeout_sec", f"{where} [steps.agent]"),
                              verifier_timeout=_seconds(verifier, "timeout_sec", f"{where} [steps.verifier]"),
                              verifier_env=dict(env), min_reward=_min_reward(s.get("min_reward"), where)))
    return steps, strategy


def min_reward_failure(reward: float | None, min_reward: float | dict[str, float] | None) -> str | None:
    """Harbor's ``_min_reward_failure``: why this step's verdict stops the rest (None: it does not)."""
    if min_reward is None:
        return None
    thresholds = {"reward": min_reward} if isinstance(min_reward, float) else min_reward
    rewards = {"reward": reward} if reward is not None else {}
    for key, threshold in thresholds.items():
        actual = rewards.get(key, -math.inf)
        if actual < threshold:
            return f"{key}={actual} below min_reward {threshold:g}"
    return None


def stop_after(step: TaskStep, result: StepResult) -> str | None:
    """Why the steps after ``step`` do not run (Harbor's ``_should_stop_after_step``)."""
    if result.agent_status != "ok" and result.reward is None:
        return f"step {step.name!r} failed ({result.agent_status}) with no verdict"
    why = min_reward_failure(result.reward, step.min_reward)
    return f"step {step.name!r}: {why}" if why else None


def trial_reward(results: list[StepResult], strategy: str) -> float | None:
    """The trial's reward as Harbor reports it (``_select_multi_step_reward``)."""
    if strategy == "final":
        return results[-1].reward if results else None
    with_verdict = [r.reward for r in results if r.reward is not None]
    return sum(with_verdict) / len(with_verdict) if with_verdict else None


def step_task(task, step: TaskStep):
    """``task`` as its step's verifier and oracle see it: this step's tests (the shared ``tests/``,
    then ``steps/<name>/tests/`` over it), its solution (its own, else the shared one), its
    verifier timeout and env (over the task's)."""
    data = {f.name: getattr(task, f.name) for f in fields(task) if f.init}
    st = StepView(**data)
    st.step = step
    if step.verifier_timeout is not None:
        st.verifier_timeout = step.verifier_timeout
    st.verifier_env = {**task.verifier_env, **step.verifier_env}
    st.instruction = step.instruction
    return st


def copy_tree(src: Path, dest: Path) -> None:
    """Copy a task dir's tree (links kept as links: the loader refused any leaving the task)."""
    shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)


class StepView(Task):
    """A Task whose tests and solution are one step's."""

    step: TaskStep

    def write_tests(self, dest: Path) -> None:
        _fresh(dest)
        if self.root is not None and (self.root / "tests").is_dir():
            copy_tree(self.root / "tests", dest)
        if (self.step.dir / "tests").is_dir():
            copy_tree(self.step.dir / "tests", dest)
        _make_executable(dest, "test.sh")

    @property
    def has_tests(self) -> bool:
        return (self.step.dir / "tests" / "test.sh").is_file() or (self.root / "tests" / "test.sh").is_file()

    @property
    def has_solution(self) -> bool:
        return (self.step.dir / "solution" / "solve.sh").is_file() or (self.root / "solution" / "solve.sh").is_file()
