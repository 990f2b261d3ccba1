"""The harness's HOME moved into the image user's own (issue 52): the path rewriting of every
preset's environment, and the init's copy in (``_homeinit.py``), each without a container (<1 s).
The copies through real containers (per-phase and live trial, a non-root image user, a hostile
read-back) are in test_harness_images.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from polar_runtime import harnesses as h
from polar_trial.sandbox import _homeinit as hi

HOST = "/srv/polar/run/work/t.st0.s0/home"


def test_moved_only_under_the_host_home_as_a_whole_component():
    assert hi.moved(HOST, HOST, "/home/agent") == "/home/agent"
    assert hi.moved(HOST + "/.codex", HOST, "/home/agent") == "/home/agent/.codex"
    assert hi.moved(HOST + "/.codex", HOST + "/", "/home/agent") == "/home/agent/.codex"
    assert hi.moved(HOST + "2/.codex", HOST, "/home/agent") == HOST + "2/.codex"  # a sibling, not under it
    assert hi.moved("/app", HOST, "/root") == "/app"
    assert hi.moved(f"x{HOST}", HOST, "/root") == f"x{HOST}"
    assert hi.moved(HOST + "/a", HOST, "/") == "/a"
    assert hi.moved("/anything", "/", "/root") == "/anything"  # a HOME of / moves nothing
    env, argv = hi.rewrite({"HOME": HOST, "A": "b"}, ["x", HOST + "/f"], HOST, "/root")
    assert env == {"HOME": "/root", "A": "b"} and argv == ["x", "/root/f"]


@pytest.mark.parametrize("name", ["codex", "claude-code", "qwen-code", "pi-chat", "gemini", "opencode"])
def test_every_presets_home_paths_follow_it(name, tmp_path, monkeypatch):
    """What each preset points into its HOME (CODEX_HOME, OPENCODE_CONFIG, PI_CODING_AGENT_DIR,
    CLAUDE_CONFIG_DIR, XDG_*) lands under the image user's HOME, and nothing names the host's."""
    monkeypatch.setattr(h.Preset, "binary", lambda self: Path("/opt/harness/bin") / self.name)
    home = tmp_path / "home"
    s = h.Session(session_id="t.st0.s0", task="do it", workdir=Path("/app"), home=home, model="m",
                  endpoint=h.Endpoint("base_url", base_url="http://127.0.0.1:9"), host_workdir=tmp_path / "w")
    inv = h.get_preset(name).prepare(s)
    env, argv = hi.rewrite(inv.env, inv.argv, str(home), "/home/agent")
    assert env["HOME"] == "/home/agent"
    leaked = {k: v for k, v in env.items() if str(home) in v} | {a: a for a in argv if str(home) in a}
    assert not leaked
    for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        assert env[k].startswith("/home/agent/.")
    want = {"codex": ("CODEX_HOME", "/home/agent/.codex"),
            "claude-code": ("CLAUDE_CONFIG_DIR", "/home/agent/.claude"),
            "pi-chat": ("PI_CODING_AGENT_DIR", "/home/agent/.pi/agent"),
            "opencode": ("OPENCODE_CONFIG", "/home/agent/.config/opencode/opencode.json")}.get(name)
    if want:
        assert env[want[0]] == want[1]
    # what the init copies: every file the preset wrote, read back by path under the new HOME
    files = {rel for rel, _, data in hi.read_tree(str(home)) if data is not None}
    assert files and all((home / f).is_file() for f in files)


def test_read_tree_takes_files_and_dirs_only(tmp_path):
    src, secret = tmp_path / "home", tmp_path / "secret"
    secret.write_text("host secret\n")
    (src / ".codex").mkdir(parents=True)
    (src / ".codex" / "config.toml").write_text("model = 'm'\n")
    os.symlink(secret, src / ".codex" / "auth.json")
    os.symlink(tmp_path, src / ".pi")
    os.mkfifo(src / ".codex" / "fifo")  # an open would block for good
    got = {rel: data for rel, _, data in hi.read_tree(str(src))}
    assert got == {".codex": None, ".codex/config.toml": b"model = 'm'\n"}
    with pytest.raises(OSError, match="passes 4 bytes"):
        hi.read_tree(str(src), limit=4)


def test_write_tree_replaces_links_never_writes_through_them(tmp_path):
    """A link the sample left in its own HOME on an earlier turn, at a directory or a file the
    copy writes, is replaced: its target keeps its content."""
    home, victim = tmp_path / "home", tmp_path / "victim"
    home.mkdir()
    victim.mkdir()
    (victim / "config.toml").write_text("theirs\n")
    (victim / "models.json").write_text("theirs\n")
    os.symlink(victim, home / ".codex")
    (home / ".pi" / "agent").mkdir(parents=True)
    os.symlink(victim / "models.json", home / ".pi" / "agent" / "models.json")
    files = [(".codex", 0o755, None), (".codex/config.toml", 0o644, b"ours\n"),
             (".pi", 0o755, None), (".pi/agent", 0o755, None), (".pi/agent/models.json", 0o644, b"{}\n")]
    assert hi.write_tree(str(home), files) == []
    assert (victim / "config.toml").read_text() == "theirs\n" and (victim / "models.json").read_text() == "theirs\n"
    assert not (home / ".codex").is_symlink() and (home / ".codex" / "config.toml").read_text() == "ours\n"
    assert not (home / ".pi/agent/models.json").is_symlink() and (home / ".pi/agent/models.json").read_text() == "{}\n"
    assert stat.S_IMODE((home / ".codex" / "config.toml").stat().st_mode) == 0o600  # it holds the session's key


def test_ensure_home_makes_the_users_dir(tmp_path):
    target = tmp_path / "home" / "agent"
    (tmp_path / "home").mkdir()
    hi.ensure_home(str(target), 4242, 4243)
    st = target.stat()
    assert (st.st_uid, st.st_gid) == (4242, 4243) and stat.S_IMODE(st.st_mode) == 0o700
    hi.ensure_home(str(target), 1, 1)  # there already: left as it is
    assert target.stat().st_uid == 4242


def test_bring_runtime_moves_home_and_starts_path_from_the_images(tmp_path, monkeypatch):
    """The rollout's switch (``bring_runtime``) on a container backend: HOME becomes a copy, not a
    bind; the caller's PATH, passed through by the preset, is replaced by the image's (a conda
    image's ``/opt/conda/bin`` first), our rg/fd after it; a task's own ENV PATH is kept."""
    from polar_core import paths
    from polar_runtime import harnessruntime as hr
    from polar_trial import SandboxSpec

    rt = hr.HarnessRuntime(tmp_path / "rt", "ld-linux-x86-64.so.2", ("fd", "rg"))
    monkeypatch.setattr(hr, "harness_runtime", lambda: rt)
    monkeypatch.setattr(hr, "runs_in_image", lambda backend: True)
    monkeypatch.setattr(hr, "image_path", lambda image, runtime="docker": "/opt/conda/bin:/usr/bin:/bin")
    backend = type("Backend", (), {"copies_home": True, "runtime": "docker"})()
    exe = str(paths.harnesses_dir() / "codex/node_modules/.bin/codex")
    for given, want in ((os.environ["PATH"], "/opt/conda/bin:/usr/bin:/bin"), ("/task/bin:/usr/bin", "/task/bin:/usr/bin")):
        spec = SandboxSpec(workdir_host=tmp_path / "w", home_host=tmp_path / "home", image="img")
        inv = h.Invocation([exe, "exec"], {"PATH": given, "HOME": str(tmp_path / "home")}, Path("/app"))
        note = hr.bring_runtime(inv, spec, backend)
        assert inv.env["PATH"] == f"{want}:{hr.INSIDE}/tools", inv.env["PATH"]
        assert spec.home_host is None and spec.home_copy == tmp_path / "home" and "HOME copied" in note
    bwrap = type("Backend", (), {})()  # no copies_home (bubblewrap, apptainer): the host HOME stays bound
    spec = SandboxSpec(workdir_host=tmp_path / "w", home_host=tmp_path / "home")
    assert not hr.move_home(spec, bwrap) and spec.home_host == tmp_path / "home" and spec.home_copy is None


def test_a_read_back_from_a_runtime_that_stops_answering_is_killed_and_said(tmp_path, monkeypatch):
    """A daemon that hangs mid-copy must not hold the sample: the copy is killed at the limit and the
    sample's notes say so (a fake ``docker`` that writes half a tar header, then hangs)."""
    import time

    from polar_trial.sandbox import harnesshome

    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\nprintf 'partial' ; exec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setattr(harnesshome, "READ_BACK_TIMEOUT_S", 1.0)
    home = tmp_path / "home"
    home.mkdir()
    t0 = time.monotonic()
    notes = harnesshome.read_back(str(fake), "c1", "/root", home, [".codex"])
    assert time.monotonic() - t0 < 15
    assert len(notes) == 1 and "timed out" in notes[0] and ".codex" in notes[0], notes


def test_an_oracle_in_an_image_starts_from_the_images_path(tmp_path, monkeypatch):
    """Not only packaged harnesses: the oracle's ``bash solve.sh`` (and nop, a generic command) in a
    task image gets the image's PATH instead of the caller's (which named host dirs such as
    ``~/.cargo/bin`` and missed an image's ``/opt/venv/bin``); a task's ENV PATH is kept; no
    runtime is bound for it."""
    from polar_runtime import harnessruntime as hr
    from polar_trial import SandboxSpec

    monkeypatch.setattr(hr, "runs_in_image", lambda backend: True)
    monkeypatch.setattr(hr, "image_path", lambda image, runtime="docker": "/opt/venv/bin:/usr/bin:/bin")
    backend = type("Backend", (), {"runtime": "docker"})()
    for given, want in ((os.environ["PATH"], "/opt/venv/bin:/usr/bin:/bin"), ("/task/bin:/usr/bin", "/task/bin:/usr/bin")):
        spec = SandboxSpec(workdir_host=tmp_path / "w", image="img")
        inv = h.Invocation(["bash", "/solution/solve.sh"], {"PATH": given}, Path("/app"))
        assert hr.bring_runtime(inv, spec, backend) is None
        assert inv.env["PATH"] == want and spec.ro_binds == []
