"""Terminal-Bench 2's verifier bootstrap, offline, with no edit to the task: ``curl -LsSf
https://astral.sh/uv/0.9.5/install.sh | sh`` answered by a local installer of the same uv.

82 of TB2's 89 tasks grade with the same ``tests/test.sh``: ``apt-get install -y curl``, then
``curl -LsSf https://astral.sh/uv/<version>/install.sh | sh``, ``source $HOME/.local/bin/env``,
``uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf ... -rA``, and the reward
from pytest's exit code. Here astral.sh (and GitHub, where its installer downloads uv from) is
unreachable; PyPI answers. So, in the verifier phase of a container backend only:

* uv is taken from its PyPI wheel (``uv==<version>``: the wheel carries the same static ``uv`` and
  ``uvx`` binaries the installer would fetch), downloaded on the host once and cached under
  ``$POLAR_HOME/uv/<version>/`` (21 MB wheel; ~3 s here), bound read-only at /run/polar-uv;
* a ``curl`` shim is first on the verifier's PATH (/run/polar-uv/bin). For exactly the URL
  ``https://astral.sh/uv[/<version>]/install.sh`` it prints a local installer that copies that uv
  into ``$HOME/.local/bin`` and writes ``$HOME/.local/bin/env`` as astral's does; any other
  argument list goes to the real curl (the one test.sh just apt-installed), unchanged;
* every run where the shim was bound says so in its notes (``STAND-IN UV INSTALLER``), and the
  installer says so on the verifier's output.

This was chosen over serving astral.sh through the egress proxy (a TLS interception with a
private CA, which test.sh's curl would have to trust) as the less magical: one visible file on
PATH, one URL answered. ``uvx [options] pytest ...`` (with plain ``-w`` requirements) runs pytest
on Polar's own Python from read-only binds, isolated from the image's Python and site dirs, which
the agent of a live trial could have changed (``pytestboot.py``: pytest and the ``-w`` packages
installed on the host from PyPI's wheels). Any other ``uvx -w`` gets its packages from PyPI through
the egress proxy and runs on the image's Python; ``-p 3.13`` then needs a Python 3.13 in the
image (the python:3.13 stand-in is trixie's), since uv's own interpreter downloads come from GitHub.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from polar_core import paths

MOUNT = "/run/polar-uv"
#: the installer URL test.sh pipes into sh (``/uv/install.sh``: the newest; not served)
INSTALLER_URL = re.compile(r"https://astral\.sh/uv/(?P<version>\d+\.\d+\.\d+)/install\.sh")
NOTE = ("STAND-IN UV INSTALLER: `curl {url}` answered by Polar's local installer of uv {version} "
        "(from its PyPI wheel; astral.sh is unreachable here)")

CURL_SHIM = r"""#!/bin/sh
# Polar's stand-in (sandbox/uvstandin.py): `curl https://astral.sh/uv/<v>/install.sh` prints a local
# installer of uv <v> taken from its PyPI wheel; every other curl call goes to the real curl.
url="" out=""
prev=""
for a in "$@"; do
  case "$a" in https://astral.sh/uv/*/install.sh) url=$a ;; esac
  [ "$prev" = "-o" ] || [ "$prev" = "--output" ] && out=$a
  prev=$a
done
if [ -n "$url" ]; then
  v=${url#https://astral.sh/uv/}; v=${v%/install.sh}
  f=/run/polar-uv/$v/install.sh
  if [ ! -f "$f" ]; then echo "curl (polar stand-in): no local uv $v for $url" >&2; exit 22; fi
  echo "polar: STAND-IN for $url: a local installer of uv $v (from its PyPI wheel)" >&2
  if [ -n "$out" ]; then cat "$f" > "$out"; else cat "$f"; fi
  exit 0
fi
oldifs=$IFS; IFS=:
for d in $PATH; do
  [ "$d" = /run/polar-uv/bin ] && continue
  if [ -x "$d/curl" ]; then IFS=$oldifs; exec "$d/curl" "$@"; fi
done
echo "curl: command not found" >&2
exit 127
"""

#: ``uvx`` as the stand-in installer puts it: the real one (``uvx-real``, which finds ``uv`` beside
#: it), except that a ``--python X`` no interpreter here satisfies, which uv would download from
#: GitHub (unreachable: ``tunnel error``), is served by the image's own python3, said on stderr.
#: Measured: 22 of 87 tasks of a public TB2-format set grade with ``uvx --python 3.12`` on a
#: ``python:3.12-slim`` base, whose stand-in has Debian's 3.13 (no Debian release has 3.12).
UVX_WRAPPER = r"""#!/bin/sh
# Polar's stand-in uvx (sandbox/uvstandin.py): the real uvx, but a --python no interpreter here
# satisfies (uv would download it from GitHub, unreachable) is served by the image's python3.
here=$(dirname "$0")
# `uvx [options] pytest ...` with plain -w requirements: pytest on Polar's Python, from read-only
# binds and isolated from the image's site dirs (sandbox/pytestboot.py), where the host prepared it
ws="" take="" n=0 cmd="" odd=""
for a in "$@"; do
  n=$((n+1))
  if [ -n "$take" ]; then [ "$take" = w ] && ws="$ws+$a"; take=""; continue; fi
  case "$a" in
    -w|--with) take=w ;;
    --with=*) ws="$ws+${a#*=}" ;;
    --from|--with-editable|--with-requirements|--from=*|--with-editable=*|--with-requirements=*) odd=1; take=o ;;
    -p|--python|-i|--index|--index-url|--extra-index-url|--default-index|-f|--find-links|-c|--constraints|\
    --overrides|-b|--build-constraints|--env-file|--directory|--project|--config-file|--cache-dir|--index-strategy|\
    --keyring-provider|--resolution|--prerelease|--exclude-newer|--link-mode|-P|--upgrade-package|\
    --reinstall-package|-C|--config-setting|--python-preference|--python-platform|--color|--allow-insecure-host) take=o ;;
    -*) ;;
    *) cmd=$a; break ;;
  esac
done
k=${ws#+}; [ -n "$k" ] || k=-
if [ "$cmd" = pytest ] && [ -z "$odd" ] && [ -x /run/polar-uv/pytest/run ] && /run/polar-uv/pytest/run --has "$k"; then
  shift $n
  exec /run/polar-uv/pytest/run "$k" "$@"
fi
# uvx [OPTIONS] COMMAND [ARGS]: only uvx's own options count (`pytest -p no:x` is pytest's)
want="" take=0 skip=0
for a in "$@"; do
  if [ $take = 1 ]; then want=$a; take=0; continue; fi
  if [ $skip = 1 ]; then skip=0; continue; fi
  case "$a" in
    -p|--python) take=1 ;;
    --python=*|-p=*) want=${a#*=} ;;
    -w|--with|--from|--with-editable|--with-requirements|--index|--index-url|-i|--extra-index-url|\
    --default-index|-f|--find-links|-c|--constraints|--overrides|-b|--build-constraints|--env-file|\
    --directory|--project|--config-file|--cache-dir|--index-strategy|--keyring-provider|--resolution|\
    --prerelease|--exclude-newer|--link-mode|-P|--upgrade-package|--reinstall-package|-C|\
    --config-setting|--python-preference|--python-platform|--color|--allow-insecure-host) skip=1 ;;
    -*) ;;
    *) break ;;
  esac
done
if [ -n "$want" ] && ! UV_PYTHON_DOWNLOADS=never "$here/uv" python find "$want" >/dev/null 2>&1; then
  py=$(command -v python3)
  if [ -n "$py" ]; then
    echo "polar: STAND-IN: uvx --python $want: no Python $want here and uv's downloads (GitHub) are unreachable; the image's $("$py" -V 2>&1) ($py) instead" >&2
    first=1 take=0 done=0
    for a in "$@"; do  # the same walk: the first --python of uvx's options gets the image's python3
      [ $first = 1 ] && { set --; first=0; }
      if [ $done = 1 ]; then set -- "$@" "$a"; continue; fi
      if [ $take = 1 ]; then set -- "$@" "$py"; take=0; done=1; continue; fi
      case "$a" in
        -p|--python) take=1; set -- "$@" "$a" ;;
        --python=*) set -- "$@" "--python=$py"; done=1 ;;
        -p=*) set -- "$@" "-p=$py"; done=1 ;;
        *) set -- "$@" "$a" ;;
      esac
    done
  fi
fi
# uvx is `uv tool run`: a Dockerfile that copies only uv and uvx elsewhere (`cp ~/.local/bin/uv
# ~/.local/bin/uvx /usr/local/bin/`, public Kotlin tasks) leaves uvx-real behind
[ -x "$here/uvx-real" ] && exec "$here/uvx-real" "$@"
exec "$here/uv" tool run "$@"
"""

INSTALLER = r"""#!/bin/sh
# Polar's local stand-in for https://astral.sh/uv/{version}/install.sh (sandbox/uvstandin.py)
set -e
dest="${{UV_INSTALL_DIR:-${{XDG_BIN_HOME:-$HOME/.local/bin}}}}"
mkdir -p "$dest"
cp /run/polar-uv/{version}/uv "$dest/uv"
cp /run/polar-uv/{version}/uvx "$dest/uvx-real"
cp /run/polar-uv/uvx-wrapper "$dest/uvx"
chmod 755 "$dest/uv" "$dest/uvx" "$dest/uvx-real"
cat > "$dest/env" <<EOF
#!/bin/sh
case ":\${{PATH}}:" in *:"$dest":*) ;; *) export PATH="$dest:\$PATH" ;; esac
EOF
echo "installing to $dest"
echo "  uv, uvx {version} (Polar's STAND-IN installer: the PyPI wheel's binaries, astral.sh unreachable)"
# uv downloads a Python from GitHub (unreachable) for an image without one: Debian's python3 instead
if ! command -v python3 >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "polar: STAND-IN: no python3 in the image, and uv's Python downloads (GitHub) are unreachable: apt-get install python3" >&2
  (apt-get install -y -qq --no-install-recommends python3 >/dev/null 2>&1 ||
   {{ apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends python3 >/dev/null 2>&1; }}) ||
    echo "polar: apt-get install python3 failed" >&2
fi
"""


class UvStandInError(RuntimeError):
    """uv could not be fetched from PyPI."""


def versions_wanted(test_sh: str) -> list[str]:
    """The uv versions ``test_sh`` fetches an installer of."""
    return sorted({m["version"] for m in INSTALLER_URL.finditer(test_sh)})


def root() -> Path:
    return paths.polar_home() / "uv"


_NEWEST: list[str] = []


def newest_version() -> str:
    """The newest uv on PyPI (``ghcr.io/astral-sh/uv:latest`` is its release), asked once per process."""
    if not _NEWEST:
        r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "uv", "--only-binary=:all:"],
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        m = re.search(r"^uv \((\d+\.\d+\.\d+)\)", r.stdout, re.M)
        if r.returncode != 0 or m is None:
            raise UvStandInError(f"`pip index versions uv` failed: {(r.stderr or r.stdout).strip()[-300:]}")
        _NEWEST.append(m[1])
    return _NEWEST[0]


def ensure_uv(version: str, cache: Path | None = None) -> Path:
    """``<cache>/<version>/`` holding ``uv``, ``uvx`` and ``install.sh`` (pip-downloaded once)."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise UvStandInError(f"not a uv version: {version!r}")
    base = cache or root()
    d = base / version
    base.mkdir(parents=True, exist_ok=True)
    for shim, text in ((base / "bin" / "curl", CURL_SHIM), (base / "uvx-wrapper", UVX_WRAPPER)):
        if not shim.is_file() or shim.read_text() != text:
            shim.parent.mkdir(exist_ok=True)
            shim.write_text(text)
            os.chmod(shim, 0o755)
    if (d / "uvx").is_file() and (d / "install.sh").is_file():
        if (d / "install.sh").read_text() != INSTALLER.format(version=version):  # a newer installer of ours
            (d / "install.sh").write_text(INSTALLER.format(version=version))
        return d
    tmp = Path(tempfile.mkdtemp(prefix=f".uv-{version}-", dir=base))
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", f"uv=={version}", "--no-deps",
                            "--only-binary=:all:", "--platform", "manylinux_2_17_x86_64", "-d", str(tmp), "-q"],
                           capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        wheels = list(tmp.glob("uv-*.whl"))
        if r.returncode != 0 or not wheels:
            raise UvStandInError(f"pip download uv=={version} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        out = tmp / version
        out.mkdir()
        with zipfile.ZipFile(wheels[0]) as z:
            for name in ("uv", "uvx"):
                (out / name).write_bytes(z.read(f"uv-{version}.data/scripts/{name}"))
                os.chmod(out / name, 0o755)
        (out / "install.sh").write_text(INSTALLER.format(version=version))
        if d.exists():
            shutil.rmtree(d)
        os.replace(out, d)
        return d
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def verifier_binds(test_sh: str, cache: Path | None = None) -> tuple[list[tuple[Path, str]], list[str]]:
    """For a test.sh that fetches astral's uv installer: the read-only bind of the uv cache at
    /run/polar-uv and the notes saying so; ([], []) otherwise. Raises UvStandInError."""
    wanted = versions_wanted(test_sh)
    if not wanted:
        return [], []
    for v in wanted:
        d = ensure_uv(v, cache)
    base = d.parent
    notes = [NOTE.format(url=f"https://astral.sh/uv/{v}/install.sh", version=v) for v in wanted]
    from polar_trial.sandbox.pytestboot import prepare

    return [(base, MOUNT)], notes + prepare(test_sh, base)  # the bootstrap's pytest, under the same bind
