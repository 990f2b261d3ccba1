"""The host's Python as the container backends run it (``polar_trial/sandbox/hostpython.py``),
against what a task's image (or, in a live trial, the agent as root) can plant in the system files
its loader reads. Run here in a mount namespace of our own whose /etc is a copy with the plant."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from polar_trial.sandbox.hostpython import host_python

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("cc"), reason="needs root (a mount namespace) and cc")

PLANT = r"""
#include <unistd.h>
__attribute__((constructor)) static void planted(void) { (void)!write(2, "PLANTED-LIBRARY-RAN\n", 20); }
"""


def _run_with_etc(hp, etc: Path, code: str) -> subprocess.CompletedProcess:
    argv = [str(hp.dir / "libs" / hp.loader), "--library-path", str(hp.dir / "libs"),
            str(hp.dir / "bin" / f"python{hp.version}"), "-I", "-S", "-c", code]
    script = f'mount --bind {etc} /etc && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *argv], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin"})


def test_the_loader_reads_no_ld_so_preload_and_brings_the_libraries_glibc_dlopens(tmp_path):
    """An /etc/ld.so.preload naming the plant: glibc's loader reads it even when run explicitly
    (our init ran the plant, with SYS_ADMIN, in a live trial); our copy of the loader does not. And
    libgcc_s, which glibc dlopens itself (a thread's unwinding), is mapped from our libs/, not
    from the image's /lib. ~1 s."""
    hp = host_python(root=tmp_path / "rt")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "plant.so"), "-x", "c", "-"], input=PLANT,
                   text=True, check=True)
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "ld.so.preload").write_text(f"{tmp_path / 'plant.so'}\n")
    code = ("import ctypes; ctypes.CDLL('libgcc_s.so.1'); "
            "print([l.split()[-1] for l in open('/proc/self/maps') if 'libgcc_s' in l][0])")
    r = _run_with_etc(hp, etc, code)
    assert r.returncode == 0, r.stderr
    assert "PLANTED-LIBRARY-RAN" not in r.stderr
    assert r.stdout.strip().startswith(str(hp.dir / "libs")), r.stdout
    # the host's own loader, as the copy was before: the plant runs (what the test would catch)
    plain = subprocess.run(["unshare", "-m", "sh", "-c", f'mount --bind {etc} /etc && exec "$@"', "sh",
                            "/lib64/ld-linux-x86-64.so.2", "/bin/true"], capture_output=True, text=True, timeout=60)
    assert "PLANTED-LIBRARY-RAN" in plain.stderr
