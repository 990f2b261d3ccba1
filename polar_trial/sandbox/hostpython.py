"""The host's Python, runnable inside any container image: what runs the sandbox's init there.

The init (``_init.py``: the model proxy's relay, the leftover sweep, the report) is Python. A
task's image need not have Python at all (``FROM ubuntu:24.04``, ``FROM debian``; tini then said
``exec python3 failed``), and an image's own Python is the task's, not ours (any version, or a
planted one). So the container backends run the *host's* ``/usr/bin/python3`` through the host's
own dynamic loader, from a small directory bound read-only at ``/run/polar-host``::

    bin/python3.X           a copy of the host's interpreter
    libs/                   copies of the shared libraries it and its extension modules need
                            (libc, libm, libz, libexpat, libffi, ...) and the loader itself
    lib/python3.X/          mount point: the host's standard library is bound here, read-only

and started as ``/run/polar-host/libs/ld-linux-*.so.2 --library-path /run/polar-host/libs
/run/polar-host/bin/python3.X -I -S init.py``. Nothing of the image is used (not its loader, libc
or PATH); ``-I`` ignores every PYTHON* variable of the phase's environment, and the interpreter
finds its standard library from its own location. The children it ``exec``s (the phase's command)
are the image's, with the image's loader: ``--library-path`` is an argument of the loader, never
an ``LD_LIBRARY_PATH`` that a child would inherit.

The loader's copy reads no ``/etc/ld.so.preload``: glibc's loader reads that file even when run
explicitly, and in a container it is the image's, which the task (or, in a live trial, the agent
as root) writes. Measured: a library named there ran inside our init, with SYS_ADMIN, at the next
phase's start (``test_trial_live.py``). The copy names a path in our read-only dir instead, of
the same length, that does not exist (``NO_PRELOAD``).

The directory is built once per host interpreter under ``$POLAR_HOME/init-runtime/`` (about 15 MB).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from polar_core import paths

#: where the runtime directory is seen inside a container
INSIDE = "/run/polar-host"
HOST_PYTHON = "/usr/bin/python3"


class HostPythonError(RuntimeError):
    """The host's Python cannot be packed for use inside a container."""


@dataclass(frozen=True)
class HostPython:
    dir: Path  # the runtime directory on the host
    stdlib: Path  # the host's standard library (bound at lib/python3.X inside)
    version: str  # "3.11"
    loader: str  # the loader's file name in libs/

    def binds(self) -> list[tuple[str, str]]:
        """(host, inside) read-only binds, in mount order."""
        return [(str(self.dir), INSIDE), (str(self.stdlib), f"{INSIDE}/lib/python{self.version}")]

    def argv(self) -> list[str]:
        """The command prefix that runs this Python inside (then the script and its arguments)."""
        return [f"{INSIDE}/libs/{self.loader}", "--library-path", f"{INSIDE}/libs",
                f"{INSIDE}/bin/python{self.version}", "-I", "-S"]


#: the loader's preload file and the path its copy reads instead (same length; never created)
PRELOAD, NO_PRELOAD = b"/etc/ld.so.preload\0", f"{INSIDE}/np".encode() + b"\0"
#: in the cache key: a directory built before a change of what is copied is built again
LAYOUT = "3"
#: libraries glibc itself dlopens, which ``ldd`` does not name: libgcc_s for the unwinding of a
#: thread's exit or cancellation. Not in libs/, it came from the image's /lib or ld.so.cache
DLOPENED = ("libgcc_s.so.1",)


def patch_loader(path: Path) -> None:
    """Make the loader copy at ``path`` read ``NO_PRELOAD`` for ``/etc/ld.so.preload``."""
    data = path.read_bytes()
    if len(PRELOAD) != len(NO_PRELOAD) or data.count(PRELOAD) != 1:
        raise HostPythonError(f"{path}: /etc/ld.so.preload not found once in the loader; not patched")
    path.write_bytes(data.replace(PRELOAD, NO_PRELOAD))


def _ldconfig(names: tuple[str, ...]) -> dict[str, str]:
    """{name: the host's file} for those of ``names`` that ``ldconfig -p`` lists for this machine."""
    r = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    out: dict[str, str] = {}
    for line in r.stdout.splitlines():
        m = re.match(r"\s*(\S+) \(libc6,(?:x86-64|AArch64)[^)]*\) => (/\S+)$", line)
        if m and m[1] in names and m[1] not in out:
            out[m[1]] = os.path.realpath(m[2])
    return out


_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x")


def needed_libraries(files: list[str]) -> dict[str, str]:
    """The shared libraries ``ldd`` names for ``files``, the loader included: {the name they are
    loaded by (the soname, e.g. libexpat.so.1): the real file}."""
    out: dict[str, str] = {}
    for f in files:
        r = subprocess.run(["ldd", f], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        for line in r.stdout.splitlines():
            m = _LDD_LINE.match(line)
            if m:
                out[os.path.basename(m[1])] = os.path.realpath(m[1])
    return out


def _probe(python: str) -> tuple[str, Path, Path]:
    code = ("import sys, sysconfig; p = sysconfig.get_paths(); "
            "print('%d.%d' % sys.version_info[:2]); print(p['stdlib']); print(p['platstdlib'])")
    r = subprocess.run([python, "-I", "-S", "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise HostPythonError(f"{python} does not run: {r.stderr.strip()[-300:]}")
    version, stdlib, plat = r.stdout.split("\n")[:3]
    return version, Path(stdlib), Path(plat) / "lib-dynload"


_CACHE: dict[str, HostPython] = {}


def host_python(python: str = HOST_PYTHON, root: Path | None = None) -> HostPython:
    """The runtime directory of ``python`` (built on first use, then reused)."""
    from polar_core.processes import file_lock

    exe = os.path.realpath(python)
    if not os.path.isfile(exe):
        raise HostPythonError(f"{python} is missing (the sandbox's init runs on the host's Python)")
    st = os.stat(exe)
    key = hashlib.sha256(f"{exe}:{st.st_size}:{st.st_mtime_ns}:{LAYOUT}".encode()).hexdigest()[:16]
    if key in _CACHE:
        return _CACHE[key]
    version, stdlib, dynload = _probe(exe)
    if (stdlib / "lib-dynload") != dynload and not dynload.is_relative_to(stdlib):
        raise HostPythonError(f"{exe}: lib-dynload {dynload} lies outside the standard library {stdlib}")
    root = root or paths.polar_home() / "init-runtime"
    out = root / key
    with file_lock(root / f".{key}.lock"):
        if not (out / ".ready").exists():
            shutil.rmtree(out, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
            (tmp / "bin").mkdir()
            (tmp / "libs").mkdir()
            (tmp / "lib" / f"python{version}").mkdir(parents=True)
            shutil.copy2(exe, tmp / "bin" / f"python{version}")
            libs = needed_libraries([exe, *map(str, sorted(dynload.glob("*.so")))])
            libs.update(_ldconfig(DLOPENED))
            loaders = [lib for lib in libs if lib.startswith("ld-linux")]
            if len(loaders) != 1:
                raise HostPythonError(f"{exe}: expected one dynamic loader, ldd named {loaders or 'none'}")
            for soname, real in libs.items():
                shutil.copy2(real, tmp / "libs" / soname)
            patch_loader(tmp / "libs" / loaders[0])
            (tmp / ".ready").write_text(loaders[0])
            os.chmod(tmp, 0o755)
            tmp.rename(out)
    hp = HostPython(out, stdlib, version, (out / ".ready").read_text().strip())
    _CACHE[key] = hp
    return hp
