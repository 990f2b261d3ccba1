"""How a harness's command line is adapted to run in a task image (``polar_runtime/harnessruntime.py``),
without a daemon: which program starts it, where rg/fd go on PATH, which backends need it.
The same paths run live, in an image with no libc, in test_harness_images.py."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from polar_runtime.harnesses import Invocation
from polar_trial.sandbox import SandboxSpec
from polar_runtime.harnessruntime import INSIDE, HarnessRuntime, bring_runtime, elf_interpreter, resolve_in_place

RT = HarnessRuntime(Path("/nonexistent"), "ld-linux-x86-64.so.2", ("fd", "rg"))


def _exe(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_elf_interpreter_tells_dynamic_static_and_scripts_apart(tmp_path):
    sh = shutil.which("sh")
    assert elf_interpreter(os.path.realpath(sh)).startswith("/lib")  # the host's dynamically linked shell
    assert elf_interpreter(_exe(tmp_path / "s", b"#!/usr/bin/env node\n")) is None
    assert elf_interpreter(_exe(tmp_path / "junk", b"\x7fELF\x02" + b"\0" * 10)) is None  # truncated: no crash


def test_a_node_script_runs_on_our_node_and_the_tools_come_after_the_images_path(tmp_path):
    pkg = tmp_path / "harnesses" / "pi" / "node_modules"
    _exe(pkg / "@scope" / "pi" / "dist" / "cli.js", b"#!/usr/bin/env node\nconsole.log(1)\n")
    (pkg / ".bin").mkdir()
    os.symlink("../@scope/pi/dist/cli.js", pkg / ".bin" / "pi")
    argv, env = RT.adapt([str(pkg / ".bin" / "pi"), "-p", "task"], {"PATH": "/opt/task/bin:/usr/bin"})
    assert argv == [f"{INSIDE}/bin/node", str(pkg / "@scope" / "pi" / "dist" / "cli.js"), "-p", "task"]
    assert env["PATH"] == f"/opt/task/bin:/usr/bin:{INSIDE}/tools"  # the task's own programs first
    assert "USE_BUILTIN_RIPGREP" not in env


def test_links_are_followed_in_place_so_a_linked_prefix_stays_the_bound_one(tmp_path):
    real = tmp_path / "real"
    _exe(real / "pkg" / "cli.js", b"#!/usr/bin/env node\n")
    os.symlink(real, tmp_path / "home-link")  # $POLAR_HOME reached through a link on the host
    (real / "bin").mkdir()
    os.symlink("../pkg/cli.js", real / "bin" / "x")
    assert resolve_in_place(str(tmp_path / "home-link" / "bin" / "x")) == str(tmp_path / "home-link" / "pkg" / "cli.js")


def test_a_dynamic_binary_is_started_by_our_loader_and_a_static_one_as_it_is(tmp_path):
    bun = os.path.realpath(shutil.which("sh"))  # any dynamically linked ELF stands for claude.exe here
    argv, env = RT.adapt([bun, "-p", "x"], {})
    assert argv == [f"{INSIDE}/lib/ld-linux-x86-64.so.2", "--library-path", f"{INSIDE}/lib", bun, "-p", "x"]
    assert env["USE_BUILTIN_RIPGREP"] == "0"  # Claude Code's embedded rg would run execPath: the loader
    assert env["PATH"].endswith(f":{INSIDE}/tools")
    plain = _exe(tmp_path / "tool", b"\x7fELF-but-no")  # neither a script nor a parsable ELF: unchanged
    assert RT.adapt([plain], {})[0] == [plain]


def test_only_packaged_harnesses_on_container_backends_get_the_runtime(tmp_path):
    from polar_trial.sandbox.bubblewrap import BubblewrapSandbox

    spec = SandboxSpec(workdir_host=tmp_path / "w")
    inv = Invocation(["bash", "-c", "true"], {"PATH": "/usr/bin"}, tmp_path)
    assert bring_runtime(inv, spec, BubblewrapSandbox()) is None and spec.ro_binds == []
    from polar_trial.sandbox.docker import DockerSandbox

    assert bring_runtime(inv, spec, DockerSandbox()) is None  # the generic preset: the image's own bash
    assert inv.argv == ["bash", "-c", "true"] and spec.ro_binds == []


@pytest.mark.skipif(shutil.which("node") is None or shutil.which("patchelf") is None, reason="needs node and patchelf")
def test_the_built_node_is_patched_with_an_rpath_before_ld_library_path(tmp_path):
    import subprocess

    from polar_runtime.harnessruntime import harness_runtime

    rt = harness_runtime(root=tmp_path)
    node = rt.dir / "bin" / "node"
    assert elf_interpreter(node) == f"{INSIDE}/lib/{rt.loader}"
    dyn = subprocess.run(["readelf", "-d", str(node)], capture_output=True, text=True).stdout
    assert f"(RPATH)              Library rpath: [{INSIDE}/lib]" in dyn and "RUNPATH" not in dyn
    assert (rt.dir / "lib" / rt.loader).is_file() and (rt.dir / "lib" / "libc.so.6").is_file()
