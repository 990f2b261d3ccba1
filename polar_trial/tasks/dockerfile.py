"""The subset of a Dockerfile the local mode (no container runtime) can honour on the host's
toolchain, and a clear refusal, naming the file and line, for the rest. Parsing never raises
anything but :class:`DockerfileError` (a ValueError), whatever the file holds.

Honoured: ``FROM`` (flags such as ``--platform`` and ``AS name`` allowed) of a base image the host
stands in for (Python, Debian, Ubuntu and buildpack-deps images, and Terminal-Bench's
python/ubuntu bases: a Debian-like system with bash, coreutils and python3, which is what this
host is); ``WORKDIR``: the work dir is the last one (or task.toml's ``[environment] workdir``),
earlier ones are where the ``RUN`` steps and relative ``COPY`` destinations after them are
(inside the work dir, or under /tmp for RUN); ``COPY``/``ADD`` of files of the build context
(``COPY . dest`` included, ``.dockerignore`` honoured) into the work dir, judged against the
Docker working directory of their line; ``COPY <<EOF dest`` heredocs; ``COPY --from=IMAGE`` of
programs the host has on its PATH (Harbor's ``COPY --from=ghcr.io/astral-sh/uv:latest /uv /uvx
/bin/`` when the host has uv); ``ENV``; ``ARG`` (without a default it is empty, as in
``docker build`` without ``--build-arg``; ``TARGETARCH`` and friends are the host's); ``RUN`` in
shell form, exec form and heredoc form (``RUN <<EOF``), with ``--mount=type=cache`` ignored
(run inside the sandbox at build time, with the work dir writable and the rest of the system
read-only; a RUN that only does ``apt-get update/install`` is skipped when the host has every
package, and refused naming the missing ones otherwise); ``SHELL`` of bash/sh with ``-c``
(``-o pipefail`` kept). Ignored with a note: ``LABEL``, ``MAINTAINER``, ``EXPOSE``, ``CMD``,
``ENTRYPOINT``, ``HEALTHCHECK``, ``STOPSIGNAL``, ``VOLUME``, ``USER root``. Refused: other base
images (alpine, images of other distributions or with preinstalled services), multi-stage builds,
``COPY --from`` of a stage or of programs the host lacks, ``ADD`` of URLs or archives, a
destination outside the work dir, ``USER`` other than root, other ``SHELL``s, ``ONBUILD``,
``RUN --mount`` other than a cache, and any source that is a link leaving the task directory.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
from pathlib import Path, PurePosixPath

from polar_trial.sandbox.base import SandboxError, sandbox_path
from polar_trial.tasks.model import DEFAULT_PATH, DEFAULT_WORKDIR, Environment, Step, mode_name

#: Base images whose userland the host's Debian-like toolchain stands in for (the last path part
#: of the image name, before the tag).
STAND_IN_IMAGES = re.compile(r"^(python|debian|ubuntu|buildpack-deps|python-3-\d+|ubuntu-\d+-\d+)$")
IGNORED = {"LABEL", "MAINTAINER", "EXPOSE", "CMD", "ENTRYPOINT", "HEALTHCHECK", "STOPSIGNAL", "VOLUME"}
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".txz")
#: astral's uv image (``COPY --from=ghcr.io/astral-sh/uv:0.5.11 /uv /uvx /bin/``): a container backend
#: copies uv from its PyPI wheel instead (``sandbox/uvstandin.py``), ghcr.io being unreachable here
UV_IMAGE = re.compile(r"^(?:ghcr\.io/)?astral-sh/uv(?::(?P<tag>[\w.-]+))?(?:@sha256:[0-9a-f]+)?$")
#: a here-document opener (not a here-string ``<<<``): ``<<EOF``, ``<<-EOF``, ``<<"EOF"``, ``<<'EOF'``
HEREDOC = re.compile(r"(?<![<\w])<<(-?)\s*([\"']?)([A-Za-z_][A-Za-z0-9_]*)\2(?!<)")


class DockerfileError(ValueError):
    """An instruction the local mode cannot honour; the message names the file and line."""


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) with backslash continuations joined, comments dropped, and
    here-document bodies (``RUN <<EOF`` ... ``EOF``) kept verbatim after the instruction's line."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    buf, start, i = "", 0, 0
    while i < len(lines):
        raw = lines[i]
        n = i + 1
        i += 1
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and (line.startswith("#") or not line):  # a comment or blank line inside a continuation
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr = buf.strip()
        buf = ""
        word = instr.split(None, 1)[0].upper() if instr else ""
        bodies = []
        if word in ("RUN", "COPY", "ADD"):
            for m in HEREDOC.finditer(instr):
                strip_tabs, delim = m.group(1) == "-", m.group(3)
                body = []
                while i < len(lines):
                    b = lines[i]
                    i += 1
                    if (b.lstrip("\t") if strip_tabs else b).rstrip("\r") == delim:
                        break
                    body.append(b.lstrip("\t") if strip_tabs else b)
                else:
                    raise DockerfileError(f"line {start}: here-document {delim} is never closed")
                bodies.append("\n".join(body) + "\n" + delim)
        out.append((start, instr + "".join("\n" + b for b in bodies)))
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def _subst(text: str, env: dict[str, str]) -> str:
    """``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``${VAR:+alt}`` as Docker expands them."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        if m.group(2):
            val = env.get(name, "")
            return (val or m.group(3)) if m.group(2) == ":-" else (m.group(3) if val else "")
        return env.get(name, "")
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)", one, text)


def _env_pairs(rest: str) -> list[tuple[str, str]]:
    parts = shlex.split(rest)
    if parts and "=" not in parts[0]:  # legacy ``ENV KEY value with spaces``
        value = rest.split(None, 1)[1] if len(rest.split(None, 1)) > 1 else ""
        return [(parts[0], " ".join(shlex.split(value)) if value else "")]
    pairs = []
    for p in parts:
        if "=" not in p:
            raise ValueError(f"ENV expects KEY=value, not {p!r}")
        k, v = p.split("=", 1)
        pairs.append((k, v))
    return pairs


def _flags(rest: str) -> tuple[list[str], str]:
    """Leading ``--flag[=value]`` words of an instruction, and the rest."""
    flags = []
    rest = rest.strip()
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
        rest = rest.strip()
    return flags, rest


def _exec_form(rest: str) -> list[str] | None:
    """The JSON array of an exec-form instruction, or None when it is shell form (``RUN [ -e x ]``
    is a shell test, not a JSON array)."""
    if not rest.startswith("["):
        return None
    try:
        args = json.loads(rest)
    except json.JSONDecodeError:
        return None
    if isinstance(args, list) and all(isinstance(a, str) for a in args):
        return args
    return None


def _under(path: PurePosixPath, top: PurePosixPath) -> bool:
    return path == top or top in path.parents


def _norm(path: str) -> PurePosixPath:
    """An absolute POSIX path with ``.`` and ``..`` resolved lexically (as Docker does)."""
    return PurePosixPath(os.path.normpath("/" + path.lstrip("/")).replace("//", "/"))


def _host_has(program: str) -> str | None:
    """Where the host's system PATH (what the sandbox sees read-only) has ``program``."""
    return shutil.which(program, path=DEFAULT_PATH)


def leaves(path: Path, top: Path) -> bool:
    """Whether ``path`` (a link, or a path through links) resolves outside ``top``."""
    real = Path(os.path.realpath(path))
    top_real = Path(os.path.realpath(top))
    return real != top_real and top_real not in real.parents


def escaping_link(path: Path, top: Path) -> Path | None:
    """The first link at or below ``path`` (walked without following links) that resolves outside
    ``top``, or None. ``path`` itself may be a link."""
    if leaves(path, top):
        return path
    if path.is_dir() and not path.is_symlink():
        for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
            for name in sorted(dirnames + filenames):
                p = Path(dirpath) / name
                if p.is_symlink() and leaves(p, top):
                    return p
    return None


def parse(dockerfile: Path, base_env: dict[str, str] | None = None, *, workdir: str | None = None,
          task_root: Path | None = None, container: bool | str = False) -> Environment:
    """The build plan of ``dockerfile`` for the local mode, or :class:`DockerfileError`.
    ``workdir`` (task.toml's ``[environment] workdir``) overrides the Dockerfile's last WORKDIR;
    ``task_root`` (default: the build context's parent) is what a COPY source may not leave.

    ``container``: the plan for a container backend (its name: refusals say which backend they are
    about), which builds a real image
    (``tasks/imagebuild.py``): any ``FROM`` image (pulled, or stood in for: ``sandbox/standin.py``),
    ``COPY``/``ADD`` to any path (a step whose ``dest`` is absolute goes into the image, not the
    work dir), ``RUN`` in any ``WORKDIR``, and ``USER`` ignored with a note (every phase runs as
    root). Measured on 36 public Harbor tasks (benchmarks/results/harbor_public_docker.json): the
    local mode's limits refused 20 of them before anything ran, all for their FROM image."""
    context = dockerfile.parent
    top = task_root or context.parent
    env_out = Environment(workdir="", context=context)
    try:
        text = dockerfile.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DockerfileError(f"{dockerfile}: cannot read: {exc}") from None
    try:
        lines = logical_lines(text)
    except DockerfileError as exc:
        raise DockerfileError(f"{dockerfile}:{str(exc).removeprefix('line ')}") from None
    try:
        return _plan(dockerfile, lines, env_out, dict(base_env or {}), workdir, top, container)
    except DockerfileError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the file holds, the loader names it and goes on
        raise DockerfileError(f"{dockerfile}: cannot parse: {type(exc).__name__}: {exc}") from None


def _plan(dockerfile: Path, lines: list[tuple[int, str]], env_out: Environment, variables: dict[str, str],
          workdir_override: str | None, top: Path, container: bool | str = False) -> Environment:
    context = env_out.context
    mode = mode_name(container)
    assert context is not None
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), platform.machine())
    automatic = {"TARGETARCH": arch, "BUILDARCH": arch, "TARGETOS": "linux", "BUILDOS": "linux",
                 "TARGETPLATFORM": f"linux/{arch}", "BUILDPLATFORM": f"linux/{arch}", "TARGETVARIANT": ""}

    def fail(n: int, src: str, why: str) -> DockerfileError:
        return DockerfileError(f"{dockerfile}:{n}: `{src.splitlines()[0][:120]}`: {why}")

    # the work dir: task.toml's, else the last WORKDIR, else /app (pass 1: WORKDIRs only)
    final = PurePosixPath(DEFAULT_WORKDIR)
    cur = PurePosixPath("/")
    pre_vars = dict(variables)
    for n, src in lines:
        word, _, rest = src.partition(" ")
        if word.upper() == "WORKDIR" and rest.strip():
            cur = _norm(str(cur / _subst(rest.strip(), pre_vars)))
            final = cur
        elif word.upper() in ("ENV", "ARG"):
            try:
                pairs = _env_pairs(rest) if word.upper() == "ENV" else [
                    (rest.partition("=")[0].strip(), rest.partition("=")[2].strip().strip('"'))]
            except ValueError:
                continue
            for k, v in pairs:
                pre_vars.setdefault(k, _subst(v, pre_vars)) if word.upper() == "ARG" else pre_vars.update({k: _subst(v, pre_vars)})
    if workdir_override:
        if not workdir_override.startswith("/"):
            raise DockerfileError(f"{dockerfile}: task.toml [environment] workdir {workdir_override!r} is not an absolute path")
        final = _norm(workdir_override)
    if final == PurePosixPath("/"):
        raise DockerfileError(f"{dockerfile}: the work dir must be a directory below /, not /")
    # a work dir where a bind could replace what the sandbox itself runs (/run, /proc; the host's
    # system dirs in the local mode, whose sandbox shows them): refused now, naming the key
    try:
        sandbox_path(str(final), "the work dir", host_system_dirs=not container)
    except SandboxError as exc:
        key = "task.toml [environment] workdir" if workdir_override else "the Dockerfile's WORKDIR"
        raise DockerfileError(f"{dockerfile}: {key}: {exc}") from None
    env_out.workdir = str(final)

    froms, stages = 0, set()
    cwd = PurePosixPath("/")  # Docker's working directory at this line
    shell_opts = ""
    for n, src in lines:
        word, _, rest = src.partition(" ")
        instr, rest = word.upper(), rest.strip()
        if instr == "FROM":
            froms += 1
            if froms > 1:
                raise fail(n, src, f"multi-stage builds are not supported by {mode} (one FROM)")
            flags, rest = _flags(rest)
            parts = rest.split()
            image = _subst(parts[0], variables) if parts else ""
            if len(parts) >= 3 and parts[1].upper() == "AS":
                stages.add(parts[2].lower())
            name = image.split("@")[0].rsplit("/", 1)[-1].split(":")[0]
            if container:
                env_out.base_image = image
                env_out.notes += [f"line {n}: FROM {f} ignored" for f in flags]
                continue
            if not STAND_IN_IMAGES.match(name):
                raise fail(n, src, f"the local mode (no container runtime) cannot stand in for image {image!r}; "
                                   "it accepts python, debian, ubuntu and buildpack-deps bases (the host's toolchain "
                                   "replaces them); run this task where docker or podman is available")
            env_out.base_image = image
            env_out.notes.append(f"FROM {image}: the host's toolchain stands in for it")
            for f in flags:
                env_out.notes.append(f"line {n}: FROM {f} ignored")
        elif froms == 0 and instr != "ARG":
            raise fail(n, src, "instruction before FROM")
        elif instr == "WORKDIR":
            if not rest:
                raise fail(n, src, "WORKDIR needs a path")
            cwd = _norm(str(cwd / _subst(rest, variables)))
        elif instr in ("COPY", "ADD"):
            _copy_step(n, src, instr, rest, cwd, final, context, top, variables, stages, env_out, fail, container)
        elif instr == "ENV":
            try:
                pairs = _env_pairs(rest)
            except ValueError as exc:
                raise fail(n, src, str(exc)) from None
            for k, v in pairs:
                v = _subst(v, variables)
                variables[k] = v
                env_out.steps.append(Step("env", dest=k, text=v, line=n, source=src))
        elif instr == "ARG":
            for item in shlex.split(rest) if rest else []:
                name, eq, default = item.partition("=")
                name = name.strip()
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                    raise fail(n, src, f"ARG name {name!r} is not a variable name")
                if eq:
                    value = _subst(default, variables)
                elif name in automatic:
                    value = automatic[name]
                else:
                    value = ""
                    env_out.notes.append(f"line {n}: ARG {name} has no default: empty, as in docker build "
                                         "without --build-arg")
                variables.setdefault(name, value)
                if froms:  # as in docker build: visible to later RUN steps, not to the running container
                    env_out.steps.append(Step("arg", dest=name, text=variables[name], line=n, source=src))
        elif instr == "RUN":
            flags, rest = _flags(rest)
            for f in flags:
                if f.startswith("--mount") and "type=cache" in f:
                    env_out.notes.append(f"line {n}: RUN {f} ignored (a build cache)")
                elif f.startswith("--network"):
                    env_out.notes.append(f"line {n}: RUN {f} ignored (the task's network setting applies)")
                else:
                    raise fail(n, src, f"RUN {f.split('=')[0]} is not supported by {mode}")
            head, _, body = rest.partition("\n")
            args = _exec_form(head) if not body else None
            if args is not None:
                command = shlex.join(args)
            elif body and HEREDOC.fullmatch(head.strip()):
                # ``RUN <<EOF``: the document is the script (its ``#!`` line, if any, picks the interpreter)
                script = body.rsplit("\n", 1)[0] + "\n"
                command = script if not script.startswith("#!") else \
                    f"cat > /tmp/.polar-run-{n} <<'POLAR_HEREDOC_{n}'\n{script}POLAR_HEREDOC_{n}\n" \
                    f"chmod +x /tmp/.polar-run-{n} && /tmp/.polar-run-{n}"
            else:
                command = rest
            if not command.strip():
                raise fail(n, src, "RUN needs a command")
            if (not container and cwd != PurePosixPath("/") and not _under(cwd, final)
                    and not _under(cwd, PurePosixPath("/tmp"))):
                raise fail(n, src, f"runs in {cwd} (WORKDIR), outside the work dir {final}: the local mode makes "
                                   "only the work dir (and a private /tmp) writable")
            env_out.steps.append(Step("run", text=command, line=n, source=src, cwd=str(cwd), shell=shell_opts))
        elif instr == "USER":
            if container and _subst(rest, variables).split(":")[0] not in ("root", "0"):
                env_out.notes.append(f"line {n}: USER {rest} ignored: under {mode_name(container)} every phase runs "
                                     "as root in the container")
            elif _subst(rest, variables).split(":")[0] not in ("root", "0"):
                raise fail(n, src, "USER other than root is not supported by the local mode (every phase runs "
                                   "as root in its own user namespace)")
        elif instr == "SHELL":
            args = _exec_form(rest)
            if not args or os.path.basename(args[0]) not in ("bash", "sh") or args[-1] != "-c":
                raise fail(n, src, f"SHELL other than bash or sh with -c is not supported by {mode}")
            opts = args[1:-1]
            if any(o not in ("-o", "pipefail", "-e", "-u", "-x", "-eu", "-ex", "-eux", "-euo", "-l", "--login") for o in opts):
                raise fail(n, src, f"SHELL options {opts} are not supported by {mode}")
            shell_opts = " ".join(opts)
            env_out.notes.append(f"line {n}: RUN steps run with bash {shell_opts} -c".replace("  ", " "))
        elif instr in IGNORED:
            env_out.notes.append(f"line {n}: {instr} ignored (the runner starts the agent itself)")
        else:
            raise fail(n, src, f"{instr} is not supported by {mode}")
    if froms == 0:
        raise DockerfileError(f"{dockerfile}: no FROM line")
    return env_out


def _copy_step(n, src, instr, rest, cwd, final, context, top, variables, stages, env_out, fail, container=False) -> None:
    mode = mode_name(container)
    flags, rest = _flags(rest)
    head, _, body = rest.partition("\n")
    if body:  # ``COPY <<EOF /app/file``: the document becomes the file
        words = shlex.split(HEREDOC.sub("", head))
        if len(words) != 1:
            raise fail(n, src, f"{instr} of a here-document needs one destination")
        dest = _norm(str(cwd / _subst(words[0], variables)))
        if container and not _under(dest, final):  # into the image, outside the work dir
            env_out.steps.append(Step("write", text=body.rsplit("\n", 1)[0] + "\n", dest=str(dest), line=n, source=src))
            return
        if not _under(dest, final) or dest == final:
            raise fail(n, src, f"destination {dest} is outside the work dir {final}: the local mode makes only "
                               "the work dir writable")
        env_out.steps.append(Step("write", text=body.rsplit("\n", 1)[0] + "\n", dest=str(dest.relative_to(final)),
                                  line=n, source=src))
        return
    try:
        args = _exec_form(head)
        if args is None:
            args = shlex.split(head)
    except ValueError as exc:
        raise fail(n, src, f"cannot parse: {exc}") from None
    if len(args) < 2:
        raise fail(n, src, f"{instr} needs a source and a destination")
    *srcs, dest = [_subst(a, variables) for a in args]
    frm = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
    dest_abs = _norm(str(cwd / dest))
    if frm is not None:
        if frm.lower() in stages or re.fullmatch(r"\d+", frm):
            raise fail(n, src, f"COPY --from={frm} copies from another build stage: multi-stage builds are not "
                               f"supported by {mode}")
        # programs from an image (Harbor's ``COPY --from=ghcr.io/astral-sh/uv:latest /uv /uvx /bin/``):
        # the host's own stand in when it has them
        names = [PurePosixPath(s).name for s in srcs]
        if container:
            uv = UV_IMAGE.match(frm)
            if uv is None or any(x not in ("uv", "uvx") for x in names):
                raise fail(n, src, f"COPY --from={frm}: {mode} cannot copy from that image here (no image registry "
                                   "answers, and the only image it stands in for in a COPY --from is "
                                   "ghcr.io/astral-sh/uv's uv and uvx, from uv's PyPI wheel)")
            env_out.steps.append(Step("image-copy", src=frm, text="\n".join(names), line=n, source=src,
                                      dest=str(dest_abs) + ("/" if dest.endswith("/") or len(srcs) > 1 else "")))
            return
        missing = [x for x in names if not _host_has(x)]
        if missing:
            raise fail(n, src, f"COPY --from={frm}: the local mode has no image to copy from, and the host has no "
                               f"{', '.join(missing)} on its PATH to stand in")
        env_out.notes.append(f"line {n}: COPY --from={frm}: the host's {', '.join(_host_has(x) or x for x in names)} "
                             "stand in")
        return
    if not _under(dest_abs, final) and not container:
        raise fail(n, src, f"destination {dest_abs} is outside the work dir {final}: the local mode makes only "
                           "the work dir writable")
    if not _under(dest_abs, final):  # a container's image: an absolute ``dest`` goes into the image
        rel_dest = str(dest_abs)
    else:
        rel_dest = "./" if dest_abs == final else str(dest_abs.relative_to(final))
    rel_dest += "/" if (dest.endswith("/") or dest in (".", "./")) and not rel_dest.endswith("/") else ""
    for s in srcs:
        if re.match(r"^[a-z]+://", s) or s.startswith("git@"):
            raise fail(n, src, f"{instr} of a URL is not supported by {mode}")
        if instr == "ADD" and s.endswith(ARCHIVES):
            raise fail(n, src, f"ADD of an archive (auto-extraction) is not supported by {mode}")
        norm = os.path.normpath(s.lstrip("/")) if not s.startswith("/") else None
        if norm is None or norm == ".." or norm.startswith("../"):
            raise fail(n, src, f"source {s!r} is outside the build context")
        matches = [context] if norm == "." else (sorted(context.glob(norm)) if any(c in norm for c in "*?[") else
                                                 [context / norm])
        matches = [m for m in matches if m.exists() or m.is_symlink()]
        if not matches:
            raise fail(n, src, f"source {s!r} not found in the build context {context}")
        for m in matches:
            bad = escaping_link(m, top)
            if bad is not None:
                raise fail(n, src, f"source {s!r}: {bad} is a link to {os.path.realpath(bad)}, outside the task "
                                   "directory: refused, not followed")
        env_out.steps.append(Step("copy", src=norm, dest=rel_dest, line=n, source=src))
    for f in flags:
        env_out.notes.append(f"line {n}: {instr} {f} ignored")
