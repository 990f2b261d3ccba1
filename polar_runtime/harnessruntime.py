"""The harnesses' own runtime, bound read-only into any task image: the harness never depends on
the image's libc, Node or PATH.

A task image is the task's (python-slim, ubuntu, an image with no libc at all); the harnesses need
a runtime none of them is sure to carry: Pi, Gemini CLI and Qwen Code are Node scripts, Codex is a
Node launcher in front of a static musl binary, Claude Code and OpenCode are Bun-compiled glibc
binaries. Measured in a no-libc image (docs/harness-runtimes.md), the working combination is:

* **Node: a patched copy of the host's ``node``** (``patchelf``: interpreter
  ``/run/polar-runtime/lib/ld-linux-x86-64.so.2``, ``DT_RPATH`` ``/run/polar-runtime/lib``). Its
  ``process.execPath`` is itself, so Qwen Code's relaunch (``spawnSync(process.execPath,
  ['--expose-gc', ...])``) and Gemini CLI's (``--max-old-space-size=...``) work. Started through
  the loader instead, ``execPath`` is the loader, and both relaunches die on ``ld-linux:
  unrecognized option '--expose-gc'``. ``DT_RPATH`` (not ``RUNPATH``) because it is searched
  before ``LD_LIBRARY_PATH``: a task's ENV cannot swap node's libc.
* **Bun binaries: unpatched, started by the bound loader** (``ld-linux --library-path ...
  claude.exe``). ``patchelf`` on Claude Code 2.1.332's binary segfaults it (any rewrite, even an
  rpath alone on the host); Bun finds its payload in the mapped ``.bun`` section, so the loader
  start reaches the model (both harnesses measured). Their ``execPath`` is then the loader, which
  matters for one thing measured: Claude Code runs its embedded ripgrep as ``execPath`` with argv0
  ``rg``; ``USE_BUILTIN_RIPGREP=0`` sends it to the ``rg`` on PATH instead (ours, below).
* **rg and fd**, which Pi, Claude Code and OpenCode look for on PATH: the static ``rg`` that
  Codex's (or Qwen Code's) npm package vendors, and Debian's ``fd-find`` (patched like node),
  in ``tools/``, appended *after* the image's PATH so the task's own tools come first. Node is not
  put on PATH: a model's command sees the image's programs only.

Layout, built once per host node/fd/rg under ``$POLAR_HOME/harness-runtime/<key>/`` (~110 MB,
~1.5 s), bound at ``/run/polar-runtime``::

    bin/node    lib/ (the loader and what node, fd and the Bun binaries need: ldd)    tools/{rg,fd}

The library list comes from ``hostpython.needed_libraries``, as the init's Python does; the
harness install itself is bound by the rollout (``agent_spec``) at its host path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from polar_core import paths

#: where the runtime directory is seen inside a container
INSIDE = "/run/polar-runtime"
PT_INTERP = 3
#: part of the cache key: bump when what a build puts in the directory changes
LAYOUT = 1


class HarnessRuntimeError(RuntimeError):
    """The runtime could not be built (no node on the host, patchelf missing and not installable)."""


def elf_interpreter(path: str | os.PathLike[str]) -> str | None:
    """The ELF's program interpreter ('' for a static binary), or None when ``path`` is no ELF."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only (x86_64, aarch64)
                return None
            phoff, = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            fh.seek(phoff)
            table = fh.read(phentsize * phnum)
            for i in range(phnum):
                p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
                if p_type == PT_INTERP:
                    fh.seek(p_offset)
                    return fh.read(p_filesz).rstrip(b"\0").decode()
            return ""
    except (OSError, struct.error, UnicodeDecodeError):
        return None


def resolve_in_place(path: str) -> str:
    """``path`` with its symbolic links followed *lexically* (``.bin/pi`` ->
    ``../@scope/pkg/dist/cli.js``), so the result stays under the same, bound, prefix even when
    that prefix itself is reached through a link on the host."""
    for _ in range(40):
        if not os.path.islink(path):
            return path
        path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    return path


def is_node_script(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            first = fh.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"node" in first


@dataclass(frozen=True)
class HarnessRuntime:
    dir: Path  # the runtime directory on the host
    loader: str  # the loader's file name in lib/
    tools: tuple[str, ...]  # what tools/ holds (rg, fd)

    def binds(self) -> list[tuple[Path, str]]:
        return [(self.dir, INSIDE)]

    @property
    def node(self) -> str:
        return f"{INSIDE}/bin/node"

    def loader_argv(self) -> list[str]:
        return [f"{INSIDE}/lib/{self.loader}", "--library-path", f"{INSIDE}/lib"]

    def adapt(self, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The harness's command line and environment for a run inside a task image."""
        exe = resolve_in_place(argv[0])
        env = dict(env)
        if is_node_script(exe):
            argv = [self.node, exe, *argv[1:]]
        elif elf_interpreter(exe):  # dynamically linked (the Bun binaries): our loader starts it
            argv = [*self.loader_argv(), exe, *argv[1:]]
            env["USE_BUILTIN_RIPGREP"] = "0"  # Claude Code: rg from PATH, not execPath (the loader)
        if self.tools:
            path = env.get("PATH") or "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
            env["PATH"] = f"{path}:{INSIDE}/tools"  # after the image's: the task's tools first
        return argv, env


def vendored_rg() -> Path | None:
    """A static x86_64/aarch64 ``rg`` from a harness package that vendors one (Codex, Qwen Code)."""
    arch = os.uname().machine
    musl = {"x86_64": "x86_64-unknown-linux-musl", "aarch64": "aarch64-unknown-linux-musl"}.get(arch, "")
    qwen = {"x86_64": "x64-linux", "aarch64": "arm64-linux"}.get(arch, "")
    root = paths.harnesses_dir()
    for cand in (root / f"codex/node_modules/@openai/codex-linux-{'x64' if arch == 'x86_64' else 'arm64'}"
                 f"/vendor/{musl}/codex-path/rg",
                 root / f"qwen-code/node_modules/@qwen-code/qwen-code/vendor/ripgrep/{qwen}/rg"):
        if cand.is_file() and elf_interpreter(cand) == "":
            return cand
    return None


def _bun_binaries() -> list[str]:
    from polar_runtime.harnesses import PACKAGES

    out = []
    for name in ("claude-code", "opencode"):
        pkg = PACKAGES[name]
        if pkg.installed():
            exe = resolve_in_place(str(pkg.bin_path))
            if elf_interpreter(exe):
                out.append(exe)
    return out


def _stat_key(p: str | Path | None) -> str:
    if p is None:
        return "-"
    st = os.stat(p)
    return f"{os.path.realpath(p)}:{st.st_size}:{st.st_mtime_ns}"


def _patch(binary: Path, loader: str) -> None:
    r = subprocess.run(["patchelf", "--set-interpreter", f"{INSIDE}/lib/{loader}", "--force-rpath",
                        "--set-rpath", f"{INSIDE}/lib", str(binary)], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise HarnessRuntimeError(f"patchelf {binary.name} failed: {r.stderr.strip()[-300:]}")


_CACHE: dict[str, HarnessRuntime] = {}


def harness_runtime(root: Path | None = None) -> HarnessRuntime:
    """The runtime directory for the host's node (built on first use, then reused)."""
    from polar_core.processes import file_lock
    from polar_trial import DaemonError, ensure_installed, needed_libraries

    node = shutil.which("node")
    if node is None:
        raise HarnessRuntimeError("node is not on this host's PATH: the Node harnesses bring the host's Node "
                                  "into the task's image (scripts/setup.sh installs Node 20)")
    fd = shutil.which("fdfind") or shutil.which("fd")
    rg = vendored_rg()
    bun = _bun_binaries()
    key = hashlib.sha256("|".join([str(LAYOUT), _stat_key(node), _stat_key(fd), _stat_key(rg), *bun]).encode()).hexdigest()[:16]
    if key in _CACHE:
        return _CACHE[key]
    if shutil.which("patchelf") is None:
        try:
            ensure_installed(("patchelf",), "patchelf")
        except DaemonError as e:
            raise HarnessRuntimeError(str(e)) from None
    root = root or paths.polar_home() / "harness-runtime"
    root.mkdir(parents=True, exist_ok=True)
    out = root / key
    with file_lock(root / f".{key}.lock"):
        if not (out / ".ready").exists():
            shutil.rmtree(out, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
            for sub in ("bin", "lib", "tools"):
                (tmp / sub).mkdir()
            libs = needed_libraries([os.path.realpath(node), *([os.path.realpath(fd)] if fd else []), *bun])
            loaders = [lib for lib in libs if lib.startswith("ld-linux")]
            if len(loaders) != 1:
                raise HarnessRuntimeError(f"{node}: expected one dynamic loader, ldd named {loaders or 'none'}")
            for soname, real in libs.items():
                shutil.copy2(real, tmp / "lib" / soname)
            shutil.copy2(os.path.realpath(node), tmp / "bin" / "node")
            _patch(tmp / "bin" / "node", loaders[0])
            if fd:
                shutil.copy2(os.path.realpath(fd), tmp / "tools" / "fd")
                _patch(tmp / "tools" / "fd", loaders[0])
            if rg:
                shutil.copy2(rg, tmp / "tools" / "rg")
            (tmp / ".ready").write_text(loaders[0])
            for d in (tmp, tmp / "bin", tmp / "lib", tmp / "tools"):
                os.chmod(d, 0o755)
            tmp.rename(out)
    rt = HarnessRuntime(out, (out / ".ready").read_text().strip(),
                        tuple(sorted(p.name for p in (out / "tools").iterdir())))
    _CACHE[key] = rt
    return rt


def runs_in_image(backend: object) -> bool:
    """Whether a backend runs phases in the task's image (docker, podman, apptainer): there the
    harness brings this runtime; bubblewrap runs the host's own file system, where it is not needed."""
    from polar_trial import DockerSandbox

    return isinstance(backend, DockerSandbox)


def bring_runtime(inv, spec, backend) -> str | None:
    """Make a harness invocation (``harnesses.Invocation``) run in the task's image: the runtime
    bound into ``spec``, argv and env adapted. A sentence for the sample's notes, or None when the
    backend needs nothing (bubblewrap, host) or the invocation is no packaged harness. Every
    invocation in an image (the oracle's solve.sh, nop, a generic command too) starts from the
    image's PATH, not the caller's: a task image's tools (``/opt/venv/bin``) come first, as under
    ``docker run``; a task's own ENV PATH is kept."""
    if not runs_in_image(backend):
        return None
    if inv.env.get("PATH") == os.environ.get("PATH"):  # the caller's, passed through: none of the image's dirs
        inv.env["PATH"] = image_path(spec.image, getattr(backend, "runtime", "docker"))
    if not inv.argv or not str(inv.argv[0]).startswith(str(paths.harnesses_dir())):
        return None
    rt = harness_runtime()
    spec.ro_binds.extend(rt.binds())
    inv.argv, inv.env = rt.adapt(list(inv.argv), inv.env)
    how = "the host's node, patched" if inv.argv[0] == rt.node else "the host's loader" \
        if inv.argv[0].startswith(f"{INSIDE}/lib/") else "as it is (static)"
    home = "; its HOME copied into the image user's own, not bound" if move_home(spec, backend) else ""
    return (f"harness runtime bound read-only at {INSIDE} ({how}); "
            f"{', '.join(rt.tools) or 'no rg/fd'} after the image's PATH{home}")


#: the PATH Docker gives a container whose image sets none
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def image_path(image: str | None, runtime: str = "docker") -> str:
    """The PATH of ``image``'s config (what ``docker run`` gives its processes: a golang image's
    ``/usr/local/go/bin``, a conda image's ``/opt/conda/bin``), or Docker's default. The harness's
    PATH, and so its tools' and the model's commands', starts from it, our ``tools/`` after it;
    the preset's own was the caller's, which names the host's dirs (a venv's ``bin``), not the image's."""
    import json

    if image:
        try:
            r = subprocess.run([runtime, "image", "inspect", "--format", "{{json .Config.Env}}", image],
                               capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            env = json.loads(r.stdout) if r.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            env = None
        for e in env if isinstance(env, list) else []:
            if isinstance(e, str) and e.startswith("PATH="):
                return e[5:]
    return DEFAULT_PATH


def move_home(spec, backend) -> bool:
    """On a backend that copies HOME (``copies_home``: docker and podman, per-phase containers and
    the live trial alike; ``polar_trial/sandbox/harnesshome.py``) the sample's host HOME, where the
    preset wrote its config, becomes ``spec.home_copy``: copied into the phase user's passwd HOME
    in the image and read back after the phase, instead of bound at its host path. The paths the
    preset set under it (HOME, XDG_*, CODEX_HOME, OPENCODE_CONFIG, PI_CODING_AGENT_DIR,
    CLAUDE_CONFIG_DIR) are moved there by the container's init, which alone knows that HOME.
    Apptainer (no container left to copy back from) and bubblewrap keep the host HOME bound."""
    if not getattr(backend, "copies_home", False) or spec.home_host is None:
        return False
    spec.home_copy, spec.home_host = spec.home_host, None
    return True
