"""Harness presets: each writes an isolated config and a command line that reaches the proxy both ways.

Unit tests: nothing is executed here (binaries are faked), so they run in milliseconds and hold
even on a machine without the npm installs.
"""

from __future__ import annotations

import json
import time
import tomllib
from pathlib import Path

import pytest

from polar_runtime import harnesses as h

SID = "fix-add.st0.s3"


@pytest.fixture(autouse=True)
def fake_binaries(monkeypatch, tmp_path):
    monkeypatch.setattr(h.Preset, "binary", lambda self: Path("/opt/bin") / (self.package or "x"))
    # A user's real keys / proxies / CA overrides must never reach a harness.
    for k, v in {"OPENAI_API_KEY": "sk-real", "HTTPS_PROXY": "http://corp:3128",
                 "NODE_EXTRA_CA_CERTS": "/etc/ssl/certs/ca-certificates.crt",
                 "ANTHROPIC_BASE_URL": "https://elsewhere"}.items():
        monkeypatch.setenv(k, v)


def endpoint(mode: str, tmp_path: Path) -> h.Endpoint:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    return h.Endpoint(mode=mode, base_url="http://127.0.0.1:4100/", proxy_url="http://127.0.0.1:4200", ca_cert=ca)


def session(mode: str, tmp_path: Path, **kw) -> h.Session:
    return h.Session(session_id=SID, task="make hello.txt", workdir=tmp_path / "w", home=tmp_path / "home",
                     model="qwen-local", endpoint=endpoint(mode, tmp_path), **kw)


ALL = sorted(h.presets())


def test_every_issue_harness_has_a_preset():
    names = set(h.presets())
    assert {"codex", "claude-code", "qwen-code", "gemini", "opencode"} <= names
    assert {f"pi-{v}" for v in ("chat", "responses", "anthropic", "google")} <= names
    assert {p.wire for p in h.presets().values()} == {"openai_chat", "openai_responses", "anthropic", "google"}
    assert h.get_preset("pi").name == "pi-chat" and h.get_preset("claude").name == "claude-code"
    with pytest.raises(KeyError):
        h.get_preset("no-such-harness")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("mode", h.MODES)
def test_env_is_isolated_and_carries_the_session(name, mode, tmp_path):
    inv = h.get_preset(name).prepare(session(mode, tmp_path))
    env = inv.env
    assert env["HOME"] == str(tmp_path / "home") and env["POLAR_SESSION"] == SID
    assert inv.cwd == tmp_path / "w" and inv.cwd.is_dir()
    assert "OPENAI_API_KEY" not in env or env["OPENAI_API_KEY"] == "polar-" + SID
    assert env.get("ANTHROPIC_BASE_URL") in (None, "http://127.0.0.1:4100")
    assert "polar-" + SID in json.dumps(env) + " ".join(inv.argv) + _configs(tmp_path) or name.startswith("pi-")
    if mode == "proxy":
        assert env["HTTPS_PROXY"] == f"http://{SID}:polar@127.0.0.1:4200" == env["https_proxy"]
        assert env["NODE_EXTRA_CA_CERTS"] == str(tmp_path / "ca.pem") == env["SSL_CERT_FILE"]
        assert env["NO_PROXY"] == ""
        # unmodified: nothing points at the proxy's reverse-mode address
        assert "127.0.0.1:4100" not in " ".join(inv.argv) + _configs(tmp_path) + _env_urls(env)
    else:
        assert not any(k.lower().endswith("_proxy") and v for k, v in env.items())
        assert env.get("NODE_EXTRA_CA_CERTS") is None


def _configs(tmp_path: Path) -> str:
    home = tmp_path / "home"
    return "".join(p.read_text() for p in sorted(home.rglob("*")) if p.is_file())


def _env_urls(env: dict[str, str]) -> str:
    return " ".join(v for k, v in env.items() if "URL" in k and k != "POLAR_BASE_URL")


def test_codex_config(tmp_path):
    inv = h.get_preset("codex").prepare(session("base_url", tmp_path))
    cfg = tomllib.loads((tmp_path / "home" / ".codex" / "config.toml").read_text())
    prov = cfg["model_providers"][cfg["model_provider"]]
    assert prov["base_url"] == "http://127.0.0.1:4100/v1" and prov["wire_api"] == "responses"
    assert inv.env[prov["env_key"]] == "polar-" + SID
    assert inv.env["CODEX_HOME"] == str(tmp_path / "home" / ".codex")
    assert inv.argv[1:3] == ["exec", "--skip-git-repo-check"] and inv.argv[-1] == "make hello.txt"
    assert "multi_agent" in inv.argv and 'web_search="disabled"' in inv.argv
    untrimmed = h.get_preset("codex").prepare(session("proxy", tmp_path, trim=False))
    assert "multi_agent" not in untrimmed.argv
    cfg = tomllib.loads((tmp_path / "home" / ".codex" / "config.toml").read_text())
    assert cfg["model_providers"]["polar"]["base_url"] == h.OPENAI_HOSTED


@pytest.mark.parametrize("variant,api,base,proxy_base", [
    ("chat", "openai-completions", "http://127.0.0.1:4100/v1", h.OPENAI_HOSTED),
    ("responses", "openai-responses", "http://127.0.0.1:4100/v1", h.OPENAI_HOSTED),
    ("anthropic", "anthropic-messages", "http://127.0.0.1:4100", h.ANTHROPIC_HOSTED),
    ("google", "google-generative-ai", "http://127.0.0.1:4100/v1beta", h.GOOGLE_HOSTED + "/v1beta"),
])
def test_pi_models_json(variant, api, base, proxy_base, tmp_path):
    for mode, want in (("base_url", base), ("proxy", proxy_base)):
        inv = h.get_preset(f"pi-{variant}").prepare(session(mode, tmp_path))
        models = json.loads((tmp_path / "home" / ".pi" / "agent" / "models.json").read_text())
        prov = models["providers"]["polar"]
        assert prov["api"] == api and prov["baseUrl"] == want
        assert inv.env[prov["apiKey"]] == "polar-" + SID  # Pi resolves an env var name
        assert [m["id"] for m in prov["models"]] == ["qwen-local"]
        assert inv.argv[inv.argv.index("--model") + 1] == "polar/qwen-local"
        assert inv.env["PI_CODING_AGENT_DIR"] == str(tmp_path / "home" / ".pi" / "agent")


def test_claude_gemini_qwen_opencode_point_at_the_proxy(tmp_path):
    s = session("base_url", tmp_path)
    claude = h.get_preset("claude-code").prepare(s)
    assert claude.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:4100"
    assert claude.env["ANTHROPIC_API_KEY"] == "polar-" + SID and "--bare" in claude.argv
    assert claude.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    gem = h.get_preset("gemini").prepare(s)
    assert gem.env["GOOGLE_GEMINI_BASE_URL"] == "http://127.0.0.1:4100" and gem.argv[1:3] == ["-m", "qwen-local"]
    settings = json.loads((tmp_path / "home" / ".gemini" / "settings.json").read_text())
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    qwen = h.get_preset("qwen-code").prepare(s)
    assert qwen.env["OPENAI_BASE_URL"] == "http://127.0.0.1:4100/v1" and qwen.env["OPENAI_MODEL"] == "qwen-local"
    oc = h.get_preset("opencode").prepare(s)
    cfg = json.loads(Path(oc.env["OPENCODE_CONFIG"]).read_text())
    assert cfg["provider"]["polar"]["options"] == {"baseURL": "http://127.0.0.1:4100/v1", "apiKey": "polar-" + SID,
                                                   "headers": {"x-polar-session": SID}}
    assert cfg["model"] == cfg["small_model"] == "polar/qwen-local"
    assert not list((tmp_path / "w").iterdir())  # the work dir stays the task's


def test_generic_preset_quotes_placeholders(tmp_path):
    s = session("base_url", tmp_path)
    s.task = "say 'hi'; rm -rf /"
    inv = h.get_preset("generic", command="printf %s {task} > out.txt; echo {session} {base_url}").prepare(s)
    assert inv.argv[:2] == ["bash", "-c"]
    res = h.run_invocation(inv, timeout=10, log_dir=tmp_path / "logs")
    assert res.returncode == 0 and not res.timed_out
    assert (tmp_path / "w" / "out.txt").read_text() == "say 'hi'; rm -rf /"
    assert res.stdout_path.read_text().strip() == f"{SID} http://127.0.0.1:4100"
    with pytest.raises(ValueError):
        h.get_preset("generic").prepare(s)


def test_timeout_kills_the_whole_process_group(tmp_path):
    s = session("base_url", tmp_path)
    # The child forks a grandchild that would outlive a plain kill of the direct child.
    inv = h.get_preset("generic", command="(sleep 60; touch late.txt) & echo $! > pid.txt; sleep 60").prepare(s)
    res = h.run_invocation(inv, timeout=1.0, log_dir=tmp_path / "logs")
    assert res.timed_out and res.returncode is None and res.wall_s < 15
    grandchild = int((tmp_path / "w" / "pid.txt").read_text())
    deadline = time.monotonic() + 10  # the signal is sent; on a loaded machine delivery takes a moment
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_install_is_idempotent_and_fast_when_present(monkeypatch, tmp_path):
    monkeypatch.setenv("POLAR_HOME", str(tmp_path))
    pkg = h.PACKAGES["pi"]
    pkg.bin_path.parent.mkdir(parents=True)
    pkg.bin_path.write_text("#!/bin/sh\n")
    calls = []

    def fake_npm(*a, **k):
        calls.append(a)
        return h.subprocess.CompletedProcess(a[0], 1, "", "registry unreachable")

    monkeypatch.setattr(h.subprocess, "run", fake_npm)
    with pytest.raises(RuntimeError):  # a stale install without the stamp is redone; the fake npm fails
        h.install("pi", log=lambda _: None)
    assert len(calls) == 1 and calls[0][0][1:4] == ["install", "--prefix", str(pkg.prefix)]
    assert calls[0][0][-1] == "@mariozechner/pi-coding-agent@0.73.1"
    pkg.stamp.write_text(pkg.spec + "\n")
    assert h.install("pi", log=lambda _: None) == pkg.bin_path and len(calls) == 1
    pkg.stamp.write_text("@mariozechner/pi-coding-agent@0.0.1\n")  # another pin -> reinstall
    with pytest.raises(RuntimeError):
        h.install("pi", log=lambda _: None)
    assert len(calls) == 2


def test_trim_flags(tmp_path):
    """Trimming uses each harness's own switches, and --no-trim leaves the harness as shipped."""
    s = session("base_url", tmp_path)
    qwen = h.get_preset("qwen-code").prepare(s)
    assert qwen.argv[-1] == "make hello.txt" and "--safe-mode" in qwen.argv
    # the greedy array flag comes before every option that ends the list
    i = qwen.argv.index("--exclude-tools")
    assert qwen.argv[i + 1 : i + 1 + len(h.QWEN_EXCLUDED_TOOLS)] == list(h.QWEN_EXCLUDED_TOOLS)
    h.get_preset("gemini").prepare(s)
    gem = json.loads((tmp_path / "home" / ".gemini" / "settings.json").read_text())
    assert "run_shell_command" not in gem["tools"]["exclude"] and "google_web_search" in gem["tools"]["exclude"]
    oc = h.get_preset("opencode").prepare(s)
    assert json.loads(Path(oc.env["OPENCODE_CONFIG"]).read_text())["tools"] == {"task": False, "skill": False,
                                                                                "todowrite": False}
    (tmp_path / "full").mkdir()
    full = session("base_url", tmp_path / "full", trim=False)
    assert "--exclude-tools" not in h.get_preset("qwen-code").prepare(full).argv
    assert "--bare" not in h.get_preset("claude-code").prepare(full).argv
    h.get_preset("gemini").prepare(full)
    assert "tools" not in json.loads((tmp_path / "full" / "home" / ".gemini" / "settings.json").read_text())
    assert "--no-context-files" not in h.get_preset("pi-chat").prepare(full).argv


@pytest.mark.parametrize("name", ALL)
def test_resume_continues_the_harness_own_last_conversation(name, tmp_path):
    """A follow-up turn (``Session.resume``) adds the harness's own continue flag, still ends with
    the instruction where it was, and changes nothing else of the command line; a first turn has no such flag."""
    fresh = h.get_preset(name).prepare(session("base_url", tmp_path))
    again = h.get_preset(name).prepare(session("base_url", tmp_path, resume=True))
    assert "make hello.txt" in fresh.argv and again.argv.count("make hello.txt") == 1
    flags = {"codex": ["resume", "--last"], "gemini": ["--resume", "latest"]}.get(name, ["--continue"])
    assert not set(flags) & set(fresh.argv[1:])
    assert all(f in h.get_preset(name).resume_flags for f in flags)  # what `polar harness list` tells
    assert again.env["POLAR_RESUME"] == "1" and "POLAR_RESUME" not in fresh.env
    if name == "codex":  # `codex exec resume` takes no --cd: it resumes the newest session of its cwd
        assert again.argv[1:4] == ["exec", "resume", "--last"] and "--cd" not in again.argv
        assert again.cwd == fresh.cwd == tmp_path / "w"
        assert [a for a in again.argv if a not in flags] == [a for a in fresh.argv if a not in ("--cd", str(tmp_path / "w"))]
    else:
        i = next(k for k in range(len(again.argv)) if again.argv[k : k + len(flags)] == flags)
        assert again.argv[:i] + again.argv[i + len(flags):] == fresh.argv
