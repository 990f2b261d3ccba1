"""The one task object every format becomes: a Harbor task (instruction, environment, hidden tests,
optional reference solution, limits).

Harbor task directories (``harbor.py``) and the JSONL shorthand (``jsonl.py``) both load into
:class:`Task`; the runner, the environment build (``environment.py``) and the verifier
(``polar_trial/verifier.py``) only ever see this object, so there is one code path. A shorthand
task carries its files, setup command, evaluator and reference solution as text; a Harbor task
points at its directory. Either way the environment is a list of build steps (the Dockerfile's, or
the shorthand's ``COPY``/``RUN`` equivalents), the tests are materialised into a fresh directory
only after the agent phase (:meth:`Task.write_tests`), and the solution only for the oracle.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path


class BuildError(RuntimeError):
    """The environment could not be built; the message names the step (Dockerfile line)."""


DEFAULT_WORKDIR = "/app"
DEFAULT_AGENT_TIMEOUT = 600.0
DEFAULT_VERIFIER_TIMEOUT = 120.0
DEFAULT_BUILD_TIMEOUT = 600.0
#: Every phase (build RUN steps, agent, oracle, verifier) runs under these unless task.toml sets
#: its own: a sample's limits never depend on which phase it is in (Harbor's defaults are 1 CPU,
#: 2 GiB, 10 GiB; the memory is higher here because a Node harness and a test run share a phase).
DEFAULT_CPUS = 2.0
DEFAULT_MEMORY_MB = 4096
DEFAULT_STORAGE_MB = 10240
DEFAULT_PIDS = 4096
#: PATH inside when neither the caller nor the Dockerfile sets one (what $PATH means in an ENV line).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: the backends that build a task's image for real (``tasks/imagebuild.py``)
CONTAINER_BACKENDS = ("docker", "podman")


def mode_name(container: bool | str = False) -> str:
    """How a message names the backend its rule applies to: ``"the local mode"`` (bubblewrap on
    the host's toolchain), ``"the docker backend"``, ``"the podman backend"`` (``container`` is
    the backend's name; True: either). A rule of one backend never reads as another's."""
    if not container:
        return "the local mode"
    return f"the {container} backend" if isinstance(container, str) else "a container backend"


def host_cpus() -> int:
    """The CPUs this process may run on (what the daemon's ``--cpus`` range allows: docker refuses
    ``--cpus 4`` on a 2-CPU machine, "Range of CPUs is from 0.01 to 2.00")."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_memory_mb() -> int | None:
    """The host's memory in MiB (``MemTotal``), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class Step:
    """One build step of the environment, in order.

    ``kind``: ``copy`` (``src`` under the build context -> ``dest`` inside the work dir), ``write``
    (``text`` -> ``dest``), ``run`` (``text`` is a shell command run inside the sandbox), ``env``
    (``dest`` = name, ``text`` = value) or ``arg`` (the same, for later RUN steps only). ``line`` is the Dockerfile line it came from (errors name it).
    """

    kind: str
    text: str = ""
    src: str = ""
    dest: str = ""
    line: int = 0
    source: str = ""  # the Dockerfile line as written, for messages
    cwd: str = ""  # ``run``: Docker's working directory at that line ("" = the work dir)
    shell: str = ""  # ``run``: bash options of the Dockerfile's SHELL (``-o pipefail``)


@dataclass
class Environment:
    """What the local (no container runtime) mode builds: the host toolchain standing in for
    ``base_image``, the work dir at ``workdir``, then ``steps``."""

    workdir: str = DEFAULT_WORKDIR
    base_image: str = ""
    steps: list[Step] = field(default_factory=list)
    context: Path | None = None  # the build context (a Harbor task's environment/)
    notes: list[str] = field(default_factory=list)  # what the local mode ignored or stood in for
    #: task.toml's ``[environment] docker_image`` on a container backend: pulled where a registry
    #: answers (then nothing is built), else the Dockerfile (or, without one, the image's stand-in)
    pull: str = ""

    @property
    def env(self) -> dict[str, str]:
        """ENV values after the last step (the agent and the verifier see them, as in a container)."""
        return {s.dest: s.text for s in self.steps if s.kind == "env"}

    def digest(self) -> str:
        """Content hash of everything the build reads: a built work dir is reused only as long as
        neither the Dockerfile nor a file of its context changed."""
        h = hashlib.sha256(f"{self.workdir}\0{self.base_image}".encode() + (f"\0pull\0{self.pull}".encode()
                                                                        if self.pull else b""))
        for s in self.steps:
            h.update(f"\0{s.kind}\0{s.text}\0{s.src}\0{s.dest}\0{s.cwd}\0{s.shell}".encode())
        if self.context is not None and self.context.is_dir() and not self.context.is_symlink():
            for dirpath, dirnames, filenames in sorted(os.walk(self.context, followlinks=False)):
                for name in sorted(dirnames + filenames):
                    p = Path(dirpath) / name
                    rel = str(p.relative_to(self.context)).encode() + b"\0"
                    if p.is_symlink():  # a link is hashed as a link, never read through
                        h.update(rel + b"->" + os.readlink(p).encode())
                    elif p.is_file():
                        h.update(rel + p.read_bytes())
        return h.hexdigest()[:16]


@dataclass
class Task:
    """One task. The keyword fields after ``followups`` are the shorthand's; a Harbor task sets
    ``root`` (its directory) and leaves them empty.

    ``timeout`` is the agent timeout (the whole sample, follow-ups included), ``verifier_timeout``
    the verifier's; both override the command line's defaults when set. ``cpus``, ``memory_mb`` and
    ``allow_internet`` come from task.toml's ``[environment]`` and reach the sandbox.
    """

    id: str
    instruction: str
    files: dict[str, str] = field(default_factory=dict)
    setup: str | None = None
    evaluator: str | None = None
    timeout: float | None = None
    followups: list[str] = field(default_factory=list)
    reference: str | None = None  # the shorthand's reference solution (a shell command)
    root: Path | None = None  # a Harbor task directory
    verifier_timeout: float | None = None
    build_timeout: float | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    allow_internet: bool = False
    verifier_env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)
    environment: Environment | None = None
    notes: list[str] = field(default_factory=list)  # task.toml keys ignored, stand-ins used
    #: requests above this host's, clamped to it: ``{"cpus": 4.0, "memory_mb": 65536}`` (what was asked)
    clamped: dict[str, float] = field(default_factory=dict)
    #: a multi-step task's ``[[steps]]`` (``tasks/steps.py``: ``TaskStep``), run in one environment
    #: in order; ``instruction`` is then the first step's. Empty: a single-step task
    steps: list = field(default_factory=list)
    #: how a multi-step trial's reward comes from its steps' (``mean`` or ``final``, as Harbor's)
    reward_strategy: str = "mean"
    #: a multi-container task's services (``tasks/compose.py``: ``ComposePlan``), run beside the
    #: live trial's main container in its network namespace; None: one container
    compose: object = None
    #: the users the agent and the verifier run as (``[agent] user``, ``[verifier] user``; in a
    #: container backend's live trial, ``sandbox/trial.py``); None: the image's USER, else root
    agent_user: str | None = None
    verifier_user: str | None = None
    #: ``[verifier] environment_mode = "separate"``: the verifier in a fresh environment of its own
    #: from the task's image, with only ``artifacts`` (paths in the work dir) copied in
    verifier_separate: bool = False
    artifacts: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.environment is None:  # the shorthand: files are COPYs, setup is a RUN
            steps = [Step("write", text=content, dest=rel) for rel, content in self.files.items()]
            if self.setup:
                steps.append(Step("run", text=self.setup, source=f"setup: {self.setup}"))
            self.environment = Environment(steps=steps)

    @property
    def workdir(self) -> str:
        assert self.environment is not None
        return self.environment.workdir

    def limits(self, pids: int | None = None) -> dict:
        """The sandbox limits of any phase of this task (SandboxSpec keyword arguments), never above
        the host's CPUs and memory (:meth:`fit_to_host` says so in the notes for task.toml's own)."""
        mem = self.memory_mb or DEFAULT_MEMORY_MB
        host_mem = host_memory_mb()
        return dict(cpus=min(self.cpus or DEFAULT_CPUS, float(host_cpus())),
                    memory_mb=min(mem, host_mem) if host_mem else mem,
                    disk_mb=self.storage_mb or DEFAULT_STORAGE_MB, pids=pids or DEFAULT_PIDS)

    def fit_to_host(self) -> None:
        """Requests above this host's (``cpus = 4`` on 2 CPUs, more memory than it has) clamped to
        it, with a note: a build never fails for a request (docker refused ``--cpus 4`` here with
        "Range of CPUs is from 0.01 to 2.00"), and an out-of-memory at the clamped limit is
        reported as such (``clamped``), not as a failed oracle."""
        cpus, mem = host_cpus(), host_memory_mb()
        if self.cpus is not None and self.cpus > cpus:
            self.clamped["cpus"] = self.cpus
            self.notes.append(f"[environment] cpus = {self.cpus:g} clamped to this host's {cpus} CPU(s)")
            self.cpus = float(cpus)
        if self.memory_mb is not None and mem and self.memory_mb > mem:
            self.clamped["memory_mb"] = self.memory_mb
            self.notes.append(f"[environment] memory {self.memory_mb} MiB clamped to this host's {mem} MiB")
            self.memory_mb = mem

    @property
    def image(self) -> str | None:
        """The image a container backend (docker) runs the phases in: the Dockerfile's base image,
        with the work dir built by the same local steps bound in (the bubblewrap backend ignores it)."""
        return (self.environment.base_image if self.environment else "") or None

    @property
    def has_tests(self) -> bool:
        if self.root is not None:
            return (self.root / "tests" / "test.sh").is_file()
        return bool(self.evaluator)

    @property
    def has_solution(self) -> bool:
        if self.root is not None:  # a multi-step task's steps may each have their own
            return (self.root / "solution" / "solve.sh").is_file() or any(
                (st.dir / "solution" / "solve.sh").is_file() for st in self.steps)
        return bool(self.reference)

    def write_tests(self, dest: Path) -> None:
        """A fresh copy of the hidden tests at ``dest`` (placed at /tests after the agent phase)."""
        _fresh(dest)
        if self.root is not None:
            shutil.copytree(self.root / "tests", dest, symlinks=True, dirs_exist_ok=True)
        else:
            (dest / "test.sh").write_text(shorthand_test_sh(self.evaluator or "false", self.workdir))
        _make_executable(dest, "test.sh")

    def write_solution(self, dest: Path) -> None:
        """The reference solution at ``dest`` (placed at /solution for the oracle only)."""
        _fresh(dest)
        if self.root is not None:
            shutil.copytree(self.root / "solution", dest, symlinks=True, dirs_exist_ok=True)
        else:
            (dest / "solve.sh").write_text(f'#!/usr/bin/env bash\ncd "${{POLAR_WORKDIR:-{self.workdir}}}"\n{self.reference}\n')
        _make_executable(dest, "solve.sh")


def _make_executable(dest: Path, name: str) -> None:
    """chmod 0755 through an fd opened without following a link (a link there is not chmodded)."""
    from polar_trial.sandbox.hostfs import open_under

    fd = open_under(dest, dest / name)
    try:
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)


def _fresh(dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)


def shorthand_test_sh(evaluator: str, workdir: str = DEFAULT_WORKDIR) -> str:
    """tests/test.sh for a shorthand evaluator, with the shorthand's reward rule: exit 0 -> the
    number on its last output line if there is one (partial credit), else 1; exit != 0 -> 0;
    126/127 (not executable, command not found) and a non-finite number -> no reward (an error)."""
    return f"""#!/usr/bin/env bash
# Generated from a JSONL shorthand evaluator (polar_trial/tasks/model.py).
cd "${{POLAR_WORKDIR:-{workdir}}}" || exit 2
vdir="${{POLAR_VERIFIER_DIR:-/logs/verifier}}"
mkdir -p "$vdir"
out="$vdir/evaluator.out"
bash -c {shlex.quote(evaluator)} >"$out" 2>&1 </dev/null
rc=$?
cat "$out"
if [ "$rc" -eq 126 ] || [ "$rc" -eq 127 ]; then exit "$rc"; fi
if [ "$rc" -ne 0 ]; then echo 0 > "$vdir/reward.txt"; exit 0; fi
last=$(grep -v '^[[:space:]]*$' "$out" | tail -n 1 | tr -d '[:space:]')
if [[ "$last" =~ ^[-+]?([0-9]+(\\.[0-9]*)?|\\.[0-9]+)([eE][-+]?[0-9]+)?$ ]]; then
  echo "$last" > "$vdir/reward.txt"
else
  echo 1 > "$vdir/reward.txt"
fi
"""
