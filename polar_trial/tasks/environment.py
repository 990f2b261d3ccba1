"""The local mode's environment build: a task's Dockerfile (or the shorthand's files and setup)
applied to an empty work dir on the host's toolchain, then copied for every sample.

``COPY``/``ADD`` copy files of the build context into the work dir; ``ENV`` values reach every
later ``RUN`` and, as in a container, the agent, the oracle and the verifier; each ``RUN`` runs
inside the sandbox with the work dir (bound at the Dockerfile's WORKDIR) writable, the host
system read-only, and no network but public hosts and the package registries through the egress
proxy (``sandbox/egress.py``; ``POLAR_BUILD_NETWORK=registries``: the registries only). A build is
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
from pathlib import Path
from typing import Any

from polar_core.processes import file_lock
from polar_trial.sandbox.egress import build_egress
from polar_trial.sandbox.hostfs import UnsafePath, copy_tree, write_bytes
from polar_trial.tasks.model import DEFAULT_BUILD_TIMEOUT, DEFAULT_PATH, BuildError, Task  # noqa: F401
#: the static reading of a task lives in staticcheck.py (re-exported here, where callers found it)
from polar_trial.tasks.staticcheck import (apt_packages, local_mode_refusal, missing_host_packages,  # noqa: F401
                                             network_refusal, static_check)


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
    from polar_trial.sandbox.hostfs import _open_dir, _parts, copy_tree, write_bytes

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
    RUN steps run through ``sandbox`` (a polar_trial.sandbox.Sandbox), or through ``run_step(spec,
    argv, out)`` when the sandbox builds a real image (``tasks/imagebuild.py``: then an apt step
    really installs, and is not checked against the host's packages). ``copy_in(root)``: a COPY
    or here-document whose destination is outside the work dir (an absolute ``dest``, planned only
    for a container backend) is laid out under a fresh ``root`` as it would be under /, then handed
    to it (``imagebuild`` copies it into the image being built)."""
    import tempfile
    from polar_trial.sandbox import SandboxSpec

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
        elif step.kind == "image-copy":  # ``COPY --from=ghcr.io/astral-sh/uv``: uv from its PyPI wheel
            if copy_in is None:
                raise BuildError(f"{where}: COPY --from an image needs a container backend")
            with tempfile.TemporaryDirectory(prefix="polar-copy-in-") as tmp:
                notes.append(f"line {step.line}: {_lay_out_uv(step, Path(tmp), where)}")
                copy_in(Path(tmp))
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
                               egress=build_egress(), **task.limits(),
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
                # the hosts the egress proxy refused or that did not answer, by name (curl prints only the status)
                net = [n for n in res.notes if n.startswith("egress refused:")]
                raise BuildError(f"{where} {what}: {tail}" + (f"\n{'; '.join(net)}" if net else ""))
    return notes


def _lay_out_uv(step: Any, root: Path, where: str) -> str:
    """``COPY --from=ghcr.io/astral-sh/uv:<tag> /uv /uvx <dest>``: the same static binaries, from
    uv's PyPI wheel (``sandbox/uvstandin.py``), laid out under ``root`` as under /; the note."""
    from polar_trial.sandbox.uvstandin import UvStandInError, ensure_uv, newest_version
    from polar_trial.tasks.dockerfile import UV_IMAGE

    m = UV_IMAGE.match(step.src)
    tag = (m["tag"] if m else None) or "latest"
    want = re.match(r"^(\d+\.\d+\.\d+)", tag)
    try:
        version = want[1] if want else newest_version()
        have = ensure_uv(version)
    except UvStandInError as exc:
        raise BuildError(f"{where}: no local uv for {step.src}: {exc}") from exc
    names = step.text.split("\n")
    for name in names:
        rel = step.dest.strip("/") + ("/" + name if step.dest.endswith("/") else "")
        write_bytes(root, root / rel, (have / name).read_bytes(), mode=0o755)
    return (f"STAND-IN IMAGE FILES: COPY --from={step.src} {' '.join(names)} answered with uv {version} from its "
            "PyPI wheel (the same static binaries; the image's registry is unreachable here)")


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
            from polar_trial.tasks.imagebuild import build_task_image, export_workdir

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
