"""The subset of a Dockerfile the local mode (no container runtime) can honour on the host's
toolchain, and a clear refusal, naming the line, for the rest.

Honoured: ``FROM`` of a base image the host stands in for (Python, Debian, Ubuntu and
buildpack-deps images, and Terminal-Bench's python/ubuntu bases: a Debian-like system with
bash, coreutils and python3, which is what this host is), ``WORKDIR`` (one work dir; default
/app), ``COPY``/``ADD`` of local files of the build context into the work dir, ``ENV``, ``RUN``
(run inside the sandbox at build time, with the work dir writable and the rest of the system
read-only; a RUN that only does ``apt-get update/install`` is skipped when the host has every
package, and refused naming the missing ones otherwise), and ``ARG`` with a default. Ignored with a note: ``LABEL``, ``MAINTAINER``, ``EXPOSE``,
``CMD``, ``ENTRYPOINT``, ``HEALTHCHECK``, ``STOPSIGNAL``, ``USER root``. Refused: other base images
(alpine, images of other distributions or with preinstalled services), multi-stage builds,
``COPY --from``, ``ADD`` of URLs or archives, a destination outside the work dir, ``USER``
other than root, ``SHELL``, ``VOLUME``, ``ONBUILD``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path, PurePosixPath

from polar_runtime.tasks.model import DEFAULT_WORKDIR, Environment, Step

#: Base images whose userland the host's Debian-like toolchain stands in for (the last path part
#: of the image name, before the tag).
STAND_IN_IMAGES = re.compile(r"^(python|debian|ubuntu|buildpack-deps|python-3-\d+|ubuntu-\d+-\d+)$")
IGNORED = {"LABEL", "MAINTAINER", "EXPOSE", "CMD", "ENTRYPOINT", "HEALTHCHECK", "STOPSIGNAL"}
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".txz")


class DockerfileError(ValueError):
    """An instruction the local mode cannot honour; the message names the file and line."""


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) with backslash continuations joined and comments dropped."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # a comment inside a continuation
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        out.append((start, buf.strip()))
        buf = ""
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def _subst(text: str, env: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return env.get(name, "")
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", one, text)


def _env_pairs(rest: str) -> list[tuple[str, str]]:
    parts = shlex.split(rest)
    if parts and "=" not in parts[0]:  # legacy ``ENV KEY value with spaces``
        return [(parts[0], rest.split(None, 1)[1] if len(rest.split(None, 1)) > 1 else "")]
    pairs = []
    for p in parts:
        if "=" not in p:
            raise ValueError(f"ENV expects KEY=value, not {p!r}")
        k, v = p.split("=", 1)
        pairs.append((k, v))
    return pairs


def _copy_args(rest: str) -> tuple[list[str], list[str]]:
    """(flags, [src..., dest]) of COPY/ADD, shell or JSON form."""
    flags = []
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
        rest = rest.strip()
    if rest.startswith("["):
        args = json.loads(rest)
    else:
        args = shlex.split(rest)
    return flags, args


def parse(dockerfile: Path, base_env: dict[str, str] | None = None) -> Environment:
    """The build plan of ``dockerfile`` for the local mode, or :class:`DockerfileError`."""
    context = dockerfile.parent
    env_out = Environment(workdir="", context=context)
    variables = dict(base_env or {})  # for $VAR substitution (ENV and ARG defaults)
    froms = 0

    def fail(n: int, src: str, why: str) -> DockerfileError:
        return DockerfileError(f"{dockerfile}:{n}: `{src[:120]}`: {why}")

    for n, src in logical_lines(dockerfile.read_text()):
        word, _, rest = src.partition(" ")
        instr, rest = word.upper(), rest.strip()
        if instr == "FROM":
            froms += 1
            if froms > 1:
                raise fail(n, src, "multi-stage builds are not supported by the local mode (one FROM)")
            image = rest.split()[0] if rest else ""
            name = image.split("@")[0].rsplit("/", 1)[-1].split(":")[0]
            if not STAND_IN_IMAGES.match(name):
                raise fail(n, src, f"the local mode (no container runtime) cannot stand in for image {image!r}; "
                                   "it accepts python, debian, ubuntu and buildpack-deps bases (the host's toolchain "
                                   "replaces them); run this task where docker or podman is available")
            env_out.base_image = image
            env_out.notes.append(f"FROM {image}: the host's toolchain stands in for it")
        elif froms == 0 and instr != "ARG":
            raise fail(n, src, "instruction before FROM")
        elif instr == "WORKDIR":
            wd = str(PurePosixPath(env_out.workdir or "/") / _subst(rest, variables))
            if env_out.workdir and wd != env_out.workdir:
                raise fail(n, src, f"a second work dir ({wd} after {env_out.workdir}): the local mode has one")
            if wd == "/" or not PurePosixPath(wd).is_absolute():
                raise fail(n, src, "the work dir must be an absolute path below /")
            env_out.workdir = wd
        elif instr in ("COPY", "ADD"):
            try:
                flags, args = _copy_args(rest)
            except (ValueError, json.JSONDecodeError) as exc:
                raise fail(n, src, f"cannot parse: {exc}") from None
            if any(f.startswith("--from") for f in flags):
                raise fail(n, src, "COPY --from (multi-stage) is not supported by the local mode")
            if len(args) < 2:
                raise fail(n, src, f"{instr} needs a source and a destination")
            *srcs, dest = [_subst(a, variables) for a in args]
            wd = env_out.workdir or DEFAULT_WORKDIR
            dest_abs = str(PurePosixPath(wd) / dest)
            norm = PurePosixPath(*[p for p in PurePosixPath(dest_abs).parts])
            if ".." in norm.parts or not (norm == PurePosixPath(wd) or PurePosixPath(wd) in norm.parents):
                raise fail(n, src, f"destination {dest_abs} is outside the work dir {wd}: the local mode "
                                   "makes only the work dir writable")
            rel_dest = str(norm.relative_to(wd)) + ("/" if dest.endswith("/") else "")
            for s in srcs:
                if re.match(r"^[a-z]+://", s) or s.startswith("git@"):
                    raise fail(n, src, "ADD of a URL is not supported by the local mode")
                if instr == "ADD" and s.endswith(ARCHIVES):
                    raise fail(n, src, "ADD of an archive (auto-extraction) is not supported by the local mode")
                if ".." in PurePosixPath(s).parts or PurePosixPath(s).is_absolute():
                    raise fail(n, src, f"source {s!r} is outside the build context")
                if not list(context.glob(s)) and not (context / s).exists():
                    raise fail(n, src, f"source {s!r} not found in the build context {context}")
                env_out.steps.append(Step("copy", src=s, dest=rel_dest, line=n, source=src))
            for f in flags:
                env_out.notes.append(f"line {n}: {f} ignored")
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
            name, eq, default = rest.partition("=")
            if not eq:
                raise fail(n, src, "ARG without a default: the local mode passes no build arguments")
            variables.setdefault(name.strip(), _subst(default.strip().strip('"'), variables))
            # as in docker build: visible to later RUN steps, not to the running container
            env_out.steps.append(Step("arg", dest=name.strip(), text=variables[name.strip()], line=n, source=src))
        elif instr == "RUN":
            if rest.startswith("--"):
                raise fail(n, src, "RUN flags (--mount, --network) are not supported by the local mode")
            if rest.startswith("["):
                try:
                    rest = shlex.join(json.loads(rest))
                except json.JSONDecodeError as exc:
                    raise fail(n, src, f"cannot parse: {exc}") from None
            env_out.steps.append(Step("run", text=rest, line=n, source=src))
        elif instr == "USER":
            if rest.split(":")[0] not in ("root", "0"):
                raise fail(n, src, "USER other than root is not supported by the local mode")
        elif instr in IGNORED:
            env_out.notes.append(f"line {n}: {instr} ignored (the runner starts the agent itself)")
        else:
            raise fail(n, src, f"{instr} is not supported by the local mode")
    if froms == 0:
        raise DockerfileError(f"{dockerfile}: no FROM line")
    env_out.workdir = env_out.workdir or DEFAULT_WORKDIR
    return env_out
