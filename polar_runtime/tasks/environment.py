"""The local mode's environment build: a task's Dockerfile (or the shorthand's files and setup)
applied to an empty work dir on the host's toolchain, then copied for every sample.

``COPY``/``ADD`` copy files of the build context into the work dir; ``ENV`` values reach every
later ``RUN`` and, as in a container, the agent, the oracle and the verifier; each ``RUN`` runs
inside the sandbox with the work dir (bound at the Dockerfile's WORKDIR) writable, the host
system read-only, and no network but the package registries (``sandbox/egress.py``). A build is
done once per task and content (``Environment.digest``) under ``<work root>/.builds`` and reused by
every sample and later step; a failed build is recorded there too, so the samples of a broken task
fail at once with the build's error (the line and its output) instead of rebuilding it each time.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

from polar_core.processes import file_lock
from polar_runtime.sandbox.egress import registries
from polar_runtime.sandbox.hostfs import UnsafePath, copy_tree, write_bytes
from polar_runtime.sandbox.releasestandin import strip_known
from polar_runtime.tasks.model import DEFAULT_BUILD_TIMEOUT, DEFAULT_PATH, BuildError, Task  # noqa: F401


_APT_NOISE = re.compile(r"^(apt(-get)?\s+(-\S+\s+)*(update|clean|autoremove)\b.*|rm\s+-rf\s+/var/lib/apt/lists/\S*|true)$")
_APT_INSTALL = re.compile(r"^(DEBIAN_FRONTEND=\S+\s+)?apt(-get)?\s+((-\S+|--\S+)\s+)*install\s+(?P<pkgs>.*)$")


def apt_packages(command: str) -> list[str] | None:
    """The packages of a RUN that only updates/installs with apt (``apt-get update && apt-get
    install -y curl git && rm -rf /var/lib/apt/lists/*``); None when it does anything else. The
    local mode cannot install into the read-only host system, but such a step is satisfied when
    every package is already installed on the host."""
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


def dockerignore(context: Path) -> list[str]:
    """The patterns of the build context's ``.dockerignore`` (``!`` exceptions are not honoured)."""
    f = context / ".dockerignore"
    if not f.is_file() or f.is_symlink():
        return []
    pats = []
    for line in f.read_text(errors="replace").splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "!")):
            pats.append(os.path.normpath(line.lstrip("/")))
    return pats


def _ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    return any(fnmatch.fnmatch(rel, p) or any(fnmatch.fnmatch("/".join(parts[:i]), p) for i in range(1, len(parts)))
               or (p.startswith("**/") and fnmatch.fnmatch(parts[-1], p[3:])) for p in patterns)


def _copy(src: Path, dest: Path, root: Path, context: Path | None = None, patterns: list[str] | None = None) -> None:
    """COPY ``src`` (of the build context) to ``dest`` under the work dir ``root``. An earlier RUN
    step may have planted links in the work dir (``pkg/config.py -> /root/.ssh/...``): the
    destination is walked and written without following one (``hostfs``), never through it."""
    from polar_runtime.sandbox.hostfs import _open_dir, _parts, copy_tree, write_bytes

    if src.is_dir() and not src.is_symlink():
        def ignore(rel: str) -> bool:
            if not patterns or context is None:
                return False
            return _ignored(os.path.normpath(os.path.join(os.path.relpath(src, context), rel)), patterns)

        dfd = _open_dir(root, _parts(root, dest), create=True)
        try:
            copy_tree(src, dfd, ignore=ignore)
        finally:
            os.close(dfd)
    else:
        write_bytes(root, dest, src.read_bytes(), mode=src.stat().st_mode & 0o777)


def build_env(task: Task, base_path: str | None = None) -> dict[str, str]:
    """The environment variables of the task's ENV lines ($PATH resolved against the host's)."""
    assert task.environment is not None
    env = {"PATH": base_path or DEFAULT_PATH}
    env.update(task.environment.env)
    return env


def apply_steps(task: Task, workdir_host: Path, sandbox: Any, log_dir: Path,
                run_step: Any = None, copy_in: Any = None) -> list[str]:
    """Build the task's environment into ``workdir_host`` (empty); returns the notes of the build.
    RUN steps run through ``sandbox`` (a polar_runtime.sandbox.Sandbox), or through ``run_step(spec,
    argv, out)`` when the sandbox builds a real image (``tasks/imagebuild.py``: then an apt step
    really installs, and is not checked against the host's packages). ``copy_in(root)``: a COPY
    or here-document whose destination is outside the work dir (an absolute ``dest``, planned only
    for a container backend) is laid out under a fresh ``root`` as it would be under /, then handed
    to it (``imagebuild`` copies it into the image being built)."""
    import tempfile
    from polar_runtime.sandbox import SandboxSpec

    env_plan = task.environment
    assert env_plan is not None
    workdir_host.mkdir(parents=True, exist_ok=True)
    notes = list(env_plan.notes)
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive"}
    log_dir.mkdir(parents=True, exist_ok=True)
    for i, step in enumerate(env_plan.steps):
        where = f"line {step.line} `{step.source[:100]}`" if step.line else (step.source[:100] or step.kind)
        if step.kind in ("env", "arg"):
            env[step.dest] = step.text
        elif step.kind in ("write", "copy") and step.dest.startswith("/"):
            if copy_in is None:
                raise BuildError(f"{where}: destination {step.dest} is outside the work dir (only a container "
                                 "backend's image can take it)")
            with tempfile.TemporaryDirectory(prefix="polar-copy-in-") as tmp:
                _lay_out(step, Path(tmp), env_plan.context, where)
                copy_in(Path(tmp))
        elif step.kind == "write":
            target = Path(os.path.normpath(workdir_host / step.dest))
            if Path(os.path.normpath(workdir_host)) not in target.parents:
                raise BuildError(f"task file {step.dest!r} escapes the work dir")
            write_bytes(workdir_host, target, step.text.encode())
        elif step.kind == "copy":
            assert env_plan.context is not None
            sources = sorted(glob.glob(str(env_plan.context / step.src))) or [str(env_plan.context / step.src)]
            dest = workdir_host / step.dest
            for s in map(Path, sources):
                # COPY dir/ dest copies the contents; a file goes into dest/ when dest ends in /
                # or more than one source was named
                target = Path(os.path.normpath(dest / s.name if (step.dest.endswith("/") or len(sources) > 1)
                                               and s.is_file() else dest))
                base = Path(os.path.normpath(workdir_host))
                if base not in target.parents and target != base:
                    raise BuildError(f"{where}: destination escapes the work dir")
                try:
                    _copy(s, target, base, env_plan.context, dockerignore(env_plan.context))
                except UnsafePath as exc:
                    raise BuildError(f"{where}: {exc} (a link an earlier step left in the work dir)") from exc
        elif step.kind == "run":
            pkgs = apt_packages(step.text)
            if pkgs is not None and run_step is None and shutil.which("dpkg-query"):
                missing = missing_host_packages(pkgs)
                if missing:
                    raise BuildError(f"{where}: the local mode cannot install packages (the host system is "
                                     f"read-only); not on this host: {' '.join(missing)}")
                notes.append(f"line {step.line}: apt step skipped, its packages are on the host: {' '.join(pkgs) or '-'}")
                continue
            command = step.text
            if step.cwd and step.cwd != task.workdir:  # the Dockerfile's WORKDIR at that line
                command = f"mkdir -p {shlex.quote(step.cwd)} 2>/dev/null; cd {shlex.quote(step.cwd)} || exit 1\n{command}"
            spec = SandboxSpec(workdir_host=workdir_host, workdir=task.workdir, env=dict(env),
                               egress=registries(), **task.limits(),
                               timeout_s=task.build_timeout or DEFAULT_BUILD_TIMEOUT, image=task.image,
                               userns_caps=True)
            out_path = log_dir / f"build-step{i}.log"
            argv = ["bash", *shlex.split(step.shell), "-c", command]
            with open(out_path, "wb") as out:
                res = (run_step(spec, argv, out) if run_step is not None
                       else sandbox.run(spec, argv, stdout=out, stderr=out))
            if res.timed_out or res.returncode != 0:
                tail = out_path.read_text(errors="replace")[-1500:]
                what = f"timed out after {spec.timeout_s:g} s" if res.timed_out else f"exited {res.returncode}"
                raise BuildError(f"{where} {what}: {tail}")
    return notes


def _lay_out(step: Any, root: Path, context: Path | None, where: str) -> None:
    """A COPY (or here-document) to the absolute ``step.dest``, laid out under ``root`` as under /."""
    rel = step.dest.strip("/")
    if step.kind == "write":
        write_bytes(root, root / rel, step.text.encode())
        return
    assert context is not None
    sources = sorted(glob.glob(str(context / step.src))) or [str(context / step.src)]
    for s in map(Path, sources):
        into = step.dest.endswith("/") or len(sources) > 1
        target = Path(os.path.normpath(root / rel / s.name if into and s.is_file() else root / rel))
        if root not in target.parents and target != root:
            raise BuildError(f"{where}: destination escapes /")
        try:
            _copy(s, target, root, context, dockerignore(context))
        except UnsafePath as exc:
            raise BuildError(f"{where}: {exc}") from exc


def prepare_workdir(task: Task, workdir: Path, sandbox: Any, build_root: Path) -> list[str]:
    """The task's built environment copied into ``workdir`` (built once under ``build_root``).
    Returns the build's notes; raises :class:`BuildError`."""
    assert task.environment is not None
    key = f"{task.id[:60]}-{task.environment.digest()}"
    built = build_root / key
    ready, failed = built / ".polar-built", built / ".polar-build-error"
    with file_lock(build_root / f".{key}.lock"):
        if failed.exists():
            raise BuildError(failed.read_text())
        if getattr(sandbox, "builds_images", False) and task.image:
            # a container backend: the task's image, built once per content on the daemon (a
            # second check or run finds it by its tag), and the work dir copied out of it
            from polar_runtime.tasks.imagebuild import build_task_image, export_workdir

            try:
                tag, notes = build_task_image(task, sandbox, built / "logs", apply_steps)
                export_workdir(tag, task.workdir, workdir, sandbox.runtime)
            except (BuildError, OSError, RuntimeError) as exc:
                built.mkdir(parents=True, exist_ok=True)
                failed.write_text(str(exc))
                raise BuildError(str(exc)) from exc
            return notes
        if not ready.exists():
            if built.exists():
                shutil.rmtree(built)
            try:
                notes = apply_steps(task, built / "work", sandbox, built / "logs")
            except (BuildError, OSError) as exc:
                built.mkdir(parents=True, exist_ok=True)
                failed.write_text(str(exc))
                raise BuildError(str(exc)) from exc
            ready.write_text("\n".join(notes))
    if workdir.exists():
        shutil.rmtree(workdir)
    copy_tree(built / "work", workdir)  # links as links, no FIFO opened (a RUN step may leave one)
    os.chmod(workdir, 0o755)
    return [n for n in ready.read_text().splitlines() if n]


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
    from polar_runtime.sandbox.egress import allowed_host, registries

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


def _script_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of a shell script, comments and blank lines dropped."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s and not s.startswith("#"):
            out.append((n, s))
    return out


def local_mode_refusal(task: Task, *, builds_image: bool = False) -> str | None:
    """Why the local mode (the host's toolchain, read-only, the package registries only in build
    steps and the verifier, no network for the agent and oracle)
    cannot run ``task``, found without running anything; None when nothing stands in its way. The
    build itself may still fail: :func:`prepare_workdir` then says which line. ``builds_image``: a
    container backend builds the task's image, so an apt install (in the Dockerfile, or the
    verifier's, through the egress proxy) installs into the image instead of being refused."""
    env_plan = task.environment
    assert env_plan is not None
    dockerfile = f"{task.root / 'environment' / 'Dockerfile'}" if task.root else "setup"
    has_dpkg = shutil.which("dpkg-query") is not None
    variables: dict[str, str] = {}
    for step in env_plan.steps:
        if step.kind in ("env", "arg"):
            variables[step.dest] = step.text
        if step.kind != "run":
            continue
        where = f"{dockerfile}:{step.line}" if step.line else dockerfile
        pkgs = apt_packages(step.text)
        if pkgs is not None:
            if builds_image:
                continue
            missing = missing_host_packages(pkgs) if has_dpkg else pkgs
            if missing:
                return (f"{where}: installs apt packages this host lacks ({' '.join(missing)}); the local mode "
                        "cannot install into the read-only host system")
            continue
        # stood in for by a container backend's build (uvstandin.py, releasestandin.py)
        text = strip_known(_ASTRAL_UV.sub("", step.text), variables) if builds_image else step.text
        why = network_refusal(text, registries_reachable=True)
        if why:
            return (f"{where}: {why}; build steps reach only the package registries "
                    "(POLAR_SANDBOX_REGISTRIES; allow_internet widens nothing)")
    if task.root is None:
        return None
    for rel, what in (("tests/test.sh", "the verifier"), ("solution/solve.sh", "the oracle")):
        f = task.root / rel
        if not f.is_file() or f.is_symlink():
            continue
        for n, line in _script_lines(f.read_text(errors="replace")):
            pkgs = apt_packages(line)
            if pkgs is not None:
                if builds_image and what == "the verifier":
                    continue
                missing = missing_host_packages(pkgs) if has_dpkg else pkgs
                if missing:
                    return (f"{f}:{n}: {what} installs apt packages this host lacks ({' '.join(missing)}); the "
                            "local mode cannot install into the read-only host system")
                continue
            if builds_image and what == "the verifier" and _TB2_UV.search(line):
                continue  # astral's uv installer is stood in for, `uvx -p` finds the image's Python
            if builds_image and what == "the oracle":
                # not refused by reading: in an image, a solution's download is often a fallback
                # that never runs (public Kotlin tasks: `if ! command -v kotlinc; then wget ...`,
                # kotlinc being in the image); one that does run fails there, with no network
                continue
            why = network_refusal(line, registries_reachable=(what == "the verifier"))
            if why:
                reach = ("reaches only the package registries" if what == "the verifier"
                         else "has no network (it runs as the agent does)")
                return f"{f}:{n}: {what} runs {why}; {what} {reach}"
    return None
