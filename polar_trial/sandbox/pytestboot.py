"""The verifier bootstrap's pytest on Polar's own Python, from read-only binds: what the sample
changed in the image's Python cannot reach it.

Terminal-Bench 2's test.sh runs its tests as ``uvx -p 3.13 -w pytest==8.4.1 -w
pytest-json-ctrf==0.3.5 pytest --ctrf ... /tests/test_outputs.py``. With uv's own interpreter
downloads unreachable (GitHub), that ``uvx`` ran the *image's* python: in a live trial, the one
the agent just had root on. A ``sitecustomize.py`` the agent dropped into that Python's standard
library (``atexit: os._exit(0)`` once pytest is imported) turned a failing test run into reward 1
(watched: ``test_trial_live.py``), and a replaced interpreter or libc would do the same.

So, for exactly that form (``uvx [options] pytest ...``, each ``-w``/``--with`` a plain
requirement), the stand-in ``uvx`` (``uvstandin.UVX_WRAPPER``) runs pytest on the host's Python
instead, as the sandbox's init runs (``hostpython.py``: the host's interpreter, libraries and
loader, bound read-only at /run/polar-host; its loader patched to read no ``/etc/ld.so.preload``
of the image), started ``-I -S``: no PYTHON* variable, no user site, no ``site`` of the image,
hence no ``sitecustomize``, ``usercustomize`` or ``.pth`` of the image's site dirs. pytest and
the ``-w`` packages are installed on the host (``pip install --target``, wheels only: a task's
requirement never runs code on the host) once per requirement list into
``$POLAR_HOME/uv/pytest/py<X.Y>/<list>/`` (pytest 8.4.1 with the ctrf plugin: ~3 s, 3 MB), which
is under the uv stand-in's read-only bind (/run/polar-uv).

What differs from uvx: the Python is the host's (3.11 here) whatever ``-p`` asks, said on the
verifier's output and in the run's notes. A test that imports the sample's compiled extension
for another Python fails here. Any other form (``uv run``, ``uvx --from``, the image's own
``pytest`` or ``python3 -m pytest``) runs the image's tools, as under Harbor: ``docs/tasks.md``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: a requirement we install: a name, extras, version clauses; nothing pip would read as an option,
#: a path or a URL
REQUIREMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?"
                         r"((===?|~=|!=|<=?|>=?)[A-Za-z0-9.*+!_-]+(,(===?|~=|!=|<=?|>=?)[A-Za-z0-9.*+!_-]+)*)?")
#: uvx options that take a value (the value is not the command)
VALUE_OPTIONS = frozenset("""-p --python -w --with --from --with-editable --with-requirements --index --index-url -i
--extra-index-url --default-index -f --find-links -c --constraints --overrides -b --build-constraints --env-file
--directory --project --config-file --cache-dir --index-strategy --keyring-provider --resolution --prerelease
--exclude-newer --link-mode -P --upgrade-package --reinstall-package -C --config-setting --python-preference
--python-platform --color --allow-insecure-host""".split())
NOTE = ("BOOTSTRAP PYTEST on Polar's Python {version} (read-only binds, started -I -S): `uvx ... pytest` "
        "with {reqs} runs isolated from the image's Python and site dirs{asked}; the verifier's output "
        "says `polar: BOOTSTRAP PYTEST` where it did")

#: run inside as ``python -I -S boot.py <site dir> <pytest args>``: our dir's own .pth files only
BOOT = '''"""Polar's bootstrap pytest (polar_trial/sandbox/pytestboot.py)."""
import site
import sys

site.addsitedir(sys.argv.pop(1))
sys.argv[0] = "pytest"
import pytest  # noqa: E402

sys.exit(pytest.console_main())
'''

#: ``run --has KEY``: whether KEY's site is here; ``run KEY ARGS``: pytest ARGS on our Python
RUN = r"""#!/bin/sh
# Polar's bootstrap pytest (polar_trial/sandbox/pytestboot.py): the host's Python, read-only, -I -S
here=/run/polar-uv/pytest
if [ "$1" = --has ]; then
  [ -f "$here/py{version}/$2/.ready" ] && [ -x {inside}/bin/python{version} ]
  exit $?
fi
key=$1; shift
echo "polar: BOOTSTRAP PYTEST: $key on Polar's Python {version} (read-only, isolated from the image's)" >&2
unset LD_PRELOAD LD_AUDIT LD_LIBRARY_PATH GLIBC_TUNABLES
exec {argv} "$here/boot.py" "$here/py{version}/$key" "$@"
"""


class BootstrapError(RuntimeError):
    """The requirement list could not be installed for our Python (no wheel, PyPI unreachable)."""


def pytest_requirements(test_sh: str) -> list[list[str]]:
    """The ``-w`` lists of each ``uvx [options] pytest ...`` in ``test_sh`` whose requirements are
    all plain (``REQUIREMENT``), in the order written (the stand-in uvx joins them so)."""
    out: list[list[str]] = []
    for line in test_sh.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, w in enumerate(words):
            if w != "uvx" and not w.endswith("/uvx"):
                continue
            reqs, take, odd, cmd = [], "", False, None
            for a in words[i + 1:]:
                if a.split("=", 1)[0] in ("--from", "--with-editable", "--with-requirements"):
                    odd = True  # another source of the command: uvx's own way
                if take:
                    if take in ("-w", "--with"):
                        reqs.append(a)
                    take = ""
                elif a in VALUE_OPTIONS:
                    take = a
                elif a.startswith("--with="):
                    reqs.append(a.split("=", 1)[1])
                elif a.startswith("-"):
                    continue
                else:
                    cmd = a
                    break
            ok = cmd == "pytest" and not odd and all(REQUIREMENT.fullmatch(r) for r in reqs)
            if ok and reqs not in out:
                out.append(reqs)
    return out


def key(reqs: list[str]) -> str:
    """The site dir's name: the list joined by ``+`` (as the stand-in uvx joins its ``-w`` values)."""
    return "+".join(reqs) or "-"


def ensure_site(base: Path, reqs: list[str], version: str) -> Path:
    """``<base>/pytest/py<version>/<key>/`` with pytest and ``reqs`` installed for our Python."""
    from polar_core.processes import file_lock

    d = base / "pytest" / f"py{version}" / key(reqs)
    d.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(d.parent / f".{key(reqs)}.lock"):
        if (d / ".ready").is_file():
            return d
        tmp = Path(tempfile.mkdtemp(prefix=".site-", dir=d.parent))
        try:
            wanted = reqs if any(re.match(r"pytest([<>=!~\[]|$)", r) for r in reqs) else ["pytest", *reqs]
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-input", "--isolated",
                                "--disable-pip-version-check", "--only-binary=:all:", "--python-version", version,
                                "--target", str(tmp), "--", *wanted],
                               capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
            if r.returncode != 0:
                raise BootstrapError(f"pip install {' '.join(wanted)} for Python {version}: "
                                     f"{(r.stderr or r.stdout).strip()[-300:]}")
            (tmp / ".ready").write_text(" ".join(wanted) + "\n")
            tmp.chmod(0o755)
            if d.exists():
                shutil.rmtree(d)
            tmp.rename(d)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def prepare(test_sh: str, base: Path) -> list[str]:
    """For each ``uvx ... pytest`` of ``test_sh``: its site under ``base`` (the uv stand-in's dir,
    bound read-only at /run/polar-uv), and the launcher; the notes to record."""
    from polar_trial.sandbox.hostpython import INSIDE, HostPythonError, host_python

    wanted = pytest_requirements(test_sh)
    if not wanted:
        return []
    try:
        hp = host_python()
    except HostPythonError as exc:
        return [f"bootstrap pytest on the image's Python: {exc}"]
    root = base / "pytest"
    root.mkdir(parents=True, exist_ok=True)
    argv = " ".join(shlex.quote(a) for a in hp.argv())
    for name, text, mode in (("boot.py", BOOT, 0o644),
                             ("run", RUN.format(version=hp.version, inside=INSIDE, argv=argv), 0o755)):
        if not (root / name).is_file() or (root / name).read_text() != text:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=root)  # one of its own per writer
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.chmod(tmp, mode)
            os.replace(tmp, root / name)
    notes = []
    asked = _asked_python(test_sh)
    for reqs in wanted:
        try:
            ensure_site(base, reqs, hp.version)
        except (BootstrapError, OSError, subprocess.TimeoutExpired) as exc:
            notes.append(f"bootstrap pytest on the image's Python (not isolated): {exc}")
            continue
        notes.append(NOTE.format(version=hp.version, reqs=" ".join(reqs) or "no -w",
                                 asked=f" (uvx asked for Python {asked})" if asked else ""))
    return notes


def _asked_python(test_sh: str) -> str:
    m = re.search(r"uvx\b[^\n]*?(?:-p|--python)[ =]+([0-9][0-9.]*)", test_sh.replace("\\\n", " "))
    return m[1] if m else ""
