"""What can be told about a task before anything of it runs: whether the backend that will run it
can (its build steps' network, the scripts' apt installs and downloads), read from the Dockerfile's
steps, ``tests/test.sh`` and ``solution/solve.sh`` without running them.

Every refusal names the backend whose rule it is (``tasks/model.mode_name``: "the local mode" is
bubblewrap on the host's read-only toolchain; "the docker backend" builds the task's image): on
public Terminal-Bench tasks checked with ``--sandbox docker``, rules of the local mode ("the local
mode cannot install into the read-only host system") refused tasks the docker backend could run.
Under a container backend only what it cannot do is refused:

* an apt install in the Dockerfile or the verifier installs into the image (build steps and the
  verifier reach the package registries through the egress proxy);
* the oracle's apt installs and downloads are not refused by reading (in an image they are often
  no-ops or fallbacks that never run: `if ! command -v kotlinc; then wget ...`); a note says what
  the oracle phase lacks, and one that does run fails with its own error;
* build steps reach public hosts through the egress proxy, as Harbor's builds have the network,
  so no build step is refused by reading (``POLAR_BUILD_NETWORK=registries`` restricts them to
  the registries, and the stand-ins' URLs: astral's uv installer, release archives republished on
  a registry); the verifier reaches only the package registries.

Reading is best effort: a line the reader cannot parse (a shell line ending in a backslash, an
unbalanced quote: ``shlex`` raises ``ValueError: No escaped character``) never refuses a task. The
task runs, and a note says which line was not read; the run then says what really happens.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from polar_trial.sandbox.releasestandin import strip_known
from polar_trial.tasks.model import CONTAINER_BACKENDS, Task, mode_name

_APT_NOISE = re.compile(r"^(apt(-get)?\s+(-\S+\s+)*(update|clean|autoremove)\b.*|rm\s+-rf\s+/var/lib/apt/lists/\S*|true)$")
_APT_INSTALL = re.compile(r"^(DEBIAN_FRONTEND=\S+\s+)?apt(-get)?\s+((-\S+|--\S+)\s+)*install\s+(?P<pkgs>.*)$")


def apt_packages(command: str) -> list[str] | None:
    """The packages of a RUN that only updates/installs with apt (``apt-get update && apt-get
    install -y curl git && rm -rf /var/lib/apt/lists/*``); None when it does anything else. The
    local mode cannot install into the read-only host system, but such a step is satisfied when
    every package is already installed on the host. Raises ValueError when the package list
    cannot be split (an unbalanced quote)."""
    pkgs: list[str] = []
    saw_apt = False
    for part in re.split(r"\s*(?:&&|;|\|\|)\s*", command.strip()):
        part = part.strip()
        if not part or _APT_NOISE.match(part):
            saw_apt = saw_apt or part.startswith("apt")
            continue
        m = _APT_INSTALL.match(part)
        if not m:
            return None
        words = [w for w in shlex.split(m["pkgs"]) if not w.startswith("-")]
        pkgs += [w.split("=")[0] for w in words]
        saw_apt = True
    return pkgs if saw_apt else None


def missing_host_packages(pkgs: list[str]) -> list[str]:
    """Those of ``pkgs`` that dpkg does not list as installed on the host."""
    missing = []
    for p in pkgs:
        proc = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True)
        if proc.returncode != 0 or "install ok installed" not in proc.stdout:
            missing.append(p)
    return missing


#: an install from a package registry (build steps and the verifier reach the registries through
#: the sandbox's filtering proxy, ``sandbox/egress.py``; the agent and oracle phases do not)
_REGISTRY_INSTALL = re.compile(
    r"\b(pip3?|python3?(\.\d+)?\s+-m\s+pip)\s+(install|download)\b|\buv\s+(pip\s+install|sync|add|tool\s+install)\b"
    r"|\buvx\b(?!\s+(-p|--python)\b)|\bnpm\s+(install|ci|i)\b")
#: a URL fetched (curl, wget, git clone): allowed only when its host is a registry
_URL_FETCH = re.compile(
    r"\b(curl|wget|git\s+clone)\b[^\n|;&]*?\b(?:https?|ftp|git|ssh)://(?:[^@/\s\"']*@)?(?P<host>[A-Za-z0-9.\-\[\]:]+)")
#: what needs more than the registries (toolchains and interpreters downloaded from elsewhere)
_OTHER_NET = re.compile(r"\bcargo\s+install\b|\bgo\s+(get|install|mod\s+download)\b|\buv\s+python\s+install\b"
                        r"|\buvx\s+(-p|--python)\b|\bgit\s+clone\b[^\n|;&]*git@")
#: Terminal-Bench 2's verifier bootstrap, which a container backend serves (``sandbox/uvstandin.py``)
_TB2_UV = re.compile(r"\bcurl\b.*https://astral\.sh/uv/\d+\.\d+\.\d+/install\.sh|^\s*uvx\b")
#: astral's uv installer, which a container backend's build steps and verifier get locally
_ASTRAL_UV = re.compile(r"https://astral\.sh/uv/\d+\.\d+\.\d+/install\.sh")
_LOCAL_HOST = re.compile(r"^(localhost|127\.\d+\.\d+\.\d+|0\.0\.0\.0|\[::1\])(:\d+)?$")


def network_refusal(line: str, *, registries_reachable: bool) -> str | None:
    """Why ``line`` cannot run in its phase's network (None when it can): build steps and the
    verifier reach the package registries only; the agent and oracle phases reach nothing."""
    from polar_trial.sandbox.egress import allowed_host, registries

    m = _OTHER_NET.search(line)
    if m:
        return f"`{m.group(0).strip()[:60]}` downloads from outside the package registries"
    for m in _URL_FETCH.finditer(line):
        host = m["host"].split(":")[0].strip("[]") if not m["host"].startswith("[") else m["host"]
        if _LOCAL_HOST.match(m["host"]) or "$" in m["host"]:
            continue
        if not registries_reachable or not allowed_host(host, registries()):
            return f"`{m.group(0).strip()[:60]}` fetches from {host}, not a package registry"
    m = _REGISTRY_INSTALL.search(line)
    if m and not registries_reachable:
        return f"`{m.group(0).strip()[:60]}` needs a package registry, which this phase cannot reach"
    return None


def script_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, command) of a shell script: backslash continuations joined (an apt
    install split over lines is one command), comments and blank lines dropped."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if not buf:
            start = n
        if s.endswith("\\") and not s.endswith("\\\\"):
            buf += s[:-1].rstrip() + " "
            continue
        out.append((start, (buf + s).strip()))
        buf = ""
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def _backend(builds_image: bool | str) -> bool | str:
    """``builds_image``: False (the local mode), a container backend's name, or True (either)."""
    if isinstance(builds_image, str):
        return builds_image if builds_image in CONTAINER_BACKENDS else False
    return builds_image


def static_check(task: Task, backend: bool | str = False) -> tuple[str | None, list[str]]:
    """(why ``backend`` cannot run ``task``, or None; notes): found without running anything.
    ``backend``: False or a non-container name for the local mode (the host's toolchain,
    read-only, the package registries only in build steps and the verifier, no network for the
    agent and oracle); a container backend's name (or True) when the task's image is built for
    real. The build itself may still fail: ``environment.prepare_workdir`` then says which line."""
    container = _backend(backend)
    env_plan = task.environment
    assert env_plan is not None
    notes: list[str] = []
    dockerfile = f"{task.root / 'environment' / 'Dockerfile'}" if task.root else "setup"
    has_dpkg = shutil.which("dpkg-query") is not None
    variables: dict[str, str] = {}

    def unread(where: str, exc: Exception) -> None:
        notes.append(f"{where}: not read before running ({type(exc).__name__}: {exc}); it runs unchecked")

    for step in env_plan.steps:
        if step.kind in ("env", "arg"):
            variables[step.dest] = step.text
        if step.kind != "run":
            continue
        where = f"{dockerfile}:{step.line}" if step.line else dockerfile
        try:
            why = _build_step(step.text, variables, container, has_dpkg)
        except Exception as exc:  # noqa: BLE001 - reading never refuses a task
            unread(where, exc)
            continue
        if why:
            return f"{where}: {why}", notes
    if task.root is None:
        return None, notes
    for rel, what in (("tests/test.sh", "the verifier"), ("solution/solve.sh", "the oracle")):
        f = task.root / rel
        if not f.is_file() or f.is_symlink():
            continue
        try:
            lines = script_lines(f.read_text(errors="replace"))
        except OSError as exc:
            unread(str(f), exc)
            continue
        for n, line in lines:
            try:
                why = _script_line(line, what, container, has_dpkg, notes, f"{f}:{n}")
            except Exception as exc:  # noqa: BLE001 - reading never refuses a task
                unread(f"{f}:{n}", exc)
                continue
            if why:
                return f"{f}:{n}: {why}", notes
    return None, notes


def _build_step(text: str, variables: dict[str, str], container: bool | str, has_dpkg: bool) -> str | None:
    pkgs = apt_packages(text)
    if pkgs is not None:
        if container:
            return None  # installs into the image
        missing = missing_host_packages(pkgs) if has_dpkg else pkgs
        if missing:
            return (f"installs apt packages this host lacks ({' '.join(missing)}); the local mode "
                    "cannot install into the read-only host system")
        return None
    # stood in for by a container backend's build (uvstandin.py, releasestandin.py)
    text = strip_known(_ASTRAL_UV.sub("", text), variables) if container else text
    from polar_trial.sandbox.egress import BUILD_NETWORK_ENV, builds_reach_public_hosts

    if builds_reach_public_hosts():
        return None  # public hosts are reached through the egress proxy (a dead one fails in 5 s)
    why = network_refusal(text, registries_reachable=True)
    if why:
        return (f"{why}; under {mode_name(container)}, build steps reach only the package registries "
                f"({BUILD_NETWORK_ENV}=registries; POLAR_SANDBOX_REGISTRIES)")
    return None


def _script_line(line: str, what: str, container: bool | str, has_dpkg: bool, notes: list[str],
                 where: str) -> str | None:
    pkgs = apt_packages(line)
    if pkgs is not None:
        if container and what == "the verifier":
            return None  # the verifier installs into its container through the egress proxy
        if container:
            notes.append(f"{where}: the oracle installs apt packages ({' '.join(pkgs)}): under {mode_name(container)} "
                         "the oracle phase reaches no registry, so this works only where the image has them")
            return None
        missing = missing_host_packages(pkgs) if has_dpkg else pkgs
        if missing:
            return (f"{what} installs apt packages this host lacks ({' '.join(missing)}); the local mode cannot "
                    "install into the read-only host system")
        return None
    if container and what == "the verifier" and _TB2_UV.search(line):
        return None  # astral's uv installer is stood in for, `uvx -p` finds the image's Python
    if container and what == "the oracle":
        # not refused by reading: in an image, a solution's download is often a fallback that never
        # runs (public Kotlin tasks: `if ! command -v kotlinc; then wget ...`, kotlinc being in
        # the image); one that does run fails there, with no network
        return None
    why = network_refusal(line, registries_reachable=(what == "the verifier"))
    if why:
        reach = ("reaches only the package registries" if what == "the verifier"
                 else "has no network (it runs as the agent does)")
        return f"{what} runs {why}; under {mode_name(container)}, {what} {reach}"
    return None


def local_mode_refusal(task: Task, *, builds_image: bool | str = False) -> str | None:
    """The refusal of :func:`static_check` alone (``builds_image``: a container backend's name, or
    True for either; False: the local mode)."""
    return static_check(task, builds_image)[0]
