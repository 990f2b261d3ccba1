"""Agent harness presets: install each CLI from npm (pinned) and run it headless through the proxy.

A preset knows, for one harness, how to install it, how to give one session an isolated HOME and
config, and which command line and environment make it reach the proxy either way:

* ``base_url`` mode: the harness's base URL points at the proxy in reverse mode;
* ``proxy`` mode: the harness is left pointing at its hosted API (api.openai.com, ...) and only gets
  ``HTTPS_PROXY=http://<session>@127.0.0.1:PORT`` plus the proxy's CA, which it must trust.

The session reaches the proxy twice over: as the API key (Bearer, ``x-api-key`` or
``x-goog-api-key`` depending on the wire format) and, in proxy mode, as the proxy-auth user and
password. In a rollout the key is the secret the proxy issued when the runner registered the
session (``Session.key``): the proxy binds every call to it, so a sample cannot speak for another
session; without one (``polar harness run`` against an open proxy) it is ``polar-<session>``. Telemetry and side calls are switched off where the CLI allows it.
Running and timing out is the caller's business (``run_invocation`` kills the whole process group).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from polar_core import paths
from polar_core.processes import file_lock, kill_group
from polar_core import cancel

Mode = Literal["base_url", "proxy"]
MODES: tuple[Mode, ...] = ("base_url", "proxy")

#: Hosted API roots the harnesses talk to when left unmodified (proxy mode intercepts these).
OPENAI_HOSTED = "https://api.openai.com/v1"
ANTHROPIC_HOSTED = "https://api.anthropic.com"
GOOGLE_HOSTED = "https://generativelanguage.googleapis.com"

API_KEY_PREFIX = "polar-"

#: Environment variables passed through from the caller; everything else is dropped so a user's
#: real API keys, proxy settings or CA bundles never leak into a harness run.
PASSTHROUGH_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")


# ---------------------------------------------------------------------------------------------
# npm packages


@dataclass(frozen=True)
class Package:
    """One npm-distributed CLI, pinned. Several presets may share one package (Pi's wire formats)."""

    name: str  # install directory name under paths.harnesses_dir()
    npm: str
    version: str
    bin: str  # executable under node_modules/.bin

    @property
    def spec(self) -> str:
        return f"{self.npm}@{self.version}"

    @property
    def prefix(self) -> Path:
        return paths.harnesses_dir() / self.name

    @property
    def bin_path(self) -> Path:
        return self.prefix / "node_modules" / ".bin" / self.bin

    @property
    def stamp(self) -> Path:
        return self.prefix / ".polar-installed"

    def installed(self) -> bool:
        try:
            return self.stamp.read_text().strip() == self.spec and self.bin_path.exists()
        except OSError:
            return False


PACKAGES: dict[str, Package] = {
    p.name: p
    for p in (
        Package("codex", "@openai/codex", "0.171.0", "codex"),
        Package("claude-code", "@anthropic-ai/claude-code", "2.1.332", "claude"),
        Package("qwen-code", "@qwen-code/qwen-code", "0.24.4", "qwen"),
        Package("pi", "@mariozechner/pi-coding-agent", "0.73.1", "pi"),
        Package("gemini", "@google/gemini-cli", "0.61.0", "gemini"),
        Package("opencode", "opencode-ai", "1.18.33", "opencode"),
    )
}


def _fix_vendored_binaries(prefix: Path) -> None:
    """Qwen Code ships ripgrep without the execute bit (its grep tool then falls back to a slow
    JavaScript search and warns on every run): restore it."""
    for rg in (prefix / "node_modules").glob("@qwen-code/*/vendor/ripgrep/*-linux/rg"):
        rg.chmod(rg.stat().st_mode | 0o111)


def install(name: str, *, force: bool = False, timeout: float = 900.0, log: Callable[[str], None] = print) -> Path:
    """Install one package into ``harnesses_dir()/<name>`` unless that exact version is there.

    Idempotent and fast when present (a stamp file records the installed spec). Returns the binary.
    """
    pkg = PACKAGES[name]
    if not force and pkg.installed():
        _fix_vendored_binaries(pkg.prefix)  # also for installs made before this fix
        return pkg.bin_path
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm not found: the harnesses need Node 20+ and npm on PATH")
    with file_lock(paths.harnesses_dir() / f".{name}.lock"):
        if not force and pkg.installed():  # another process finished it while we waited
            return pkg.bin_path
        pkg.prefix.mkdir(parents=True, exist_ok=True)
        pkg.stamp.unlink(missing_ok=True)
        t0 = time.monotonic()
        log(f"npm install {pkg.spec} -> {pkg.prefix}")
        proc = subprocess.run(
            [npm, "install", "--prefix", str(pkg.prefix), "--no-audit", "--no-fund",
             "--loglevel=error", "--no-update-notifier", pkg.spec],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0 or not pkg.bin_path.exists():
            raise RuntimeError(f"npm install {pkg.spec} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
        _fix_vendored_binaries(pkg.prefix)
        pkg.stamp.write_text(pkg.spec + "\n")
        log(f"installed {pkg.spec} in {time.monotonic() - t0:.0f} s")
    return pkg.bin_path


# ---------------------------------------------------------------------------------------------
# sessions and invocations


@dataclass
class Endpoint:
    """Where the proxy listens and how a harness should reach it."""

    mode: Mode
    base_url: str = ""  # reverse-mode root, e.g. http://127.0.0.1:8123 (no /v1)
    proxy_url: str = ""  # regular-mode address, e.g. http://127.0.0.1:8124
    ca_cert: Path | None = None  # mitmproxy CA (PEM) the harness must trust in proxy mode

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.mode == "base_url" and not self.base_url:
            raise ValueError("base_url mode needs the proxy's reverse-mode base URL")
        if self.mode == "proxy" and not (self.proxy_url and self.ca_cert):
            raise ValueError("proxy mode needs the proxy URL and its CA certificate")
        self.base_url = self.base_url.rstrip("/")
        self.ca_cert = paths.absolute(self.ca_cert) if self.ca_cert else None

    def proxy_url_with_session(self, session_id: str, key: str | None = None) -> str:
        """``http://<session>:<key>@host:port``: the proxy-auth user names the session, the password
        is its issued key (``polar`` when it has none). A password matters anyway: Bun (OpenCode)
        cannot connect through a proxy URL with a bare user name."""
        scheme, _, rest = self.proxy_url.partition("://")
        return f"{scheme}://{session_id}:{key or 'polar'}@{rest}"


@dataclass
class Session:
    """One harness run: its ids, task text, and the private directories it may write."""

    session_id: str
    task: str
    workdir: Path
    home: Path
    model: str  # the model name the harness asks for (the proxy swaps in the served one)
    endpoint: Endpoint
    trim: bool = True  # trim tools/system prompts through the harness's own flags
    extra_env: dict[str, str] = field(default_factory=dict)
    #: continue the harness's own last conversation in this work dir and HOME (``task`` is then the
    #: next user turn): the harness re-sends the whole history, with the model's earlier answers
    resume: bool = False
    #: in a sandbox ``workdir`` is the path the harness sees (the task's WORKDIR, /app) and this is
    #: the host directory bound there; None when both are the same
    host_workdir: Path | None = None
    #: the task's reference solution (host directory with solve.sh), for the ``oracle`` preset only
    solution_dir: Path | None = None
    #: the secret the proxy issued for this session when it was registered (the harness's API key)
    key: str | None = None

    def __post_init__(self) -> None:
        # The harness runs with ``workdir`` as its cwd: a relative HOME would point inside it.
        self.workdir, self.home = paths.absolute(self.workdir), paths.absolute(self.home)
        if self.host_workdir is not None:
            self.host_workdir = paths.absolute(self.host_workdir)

    @property
    def api_key(self) -> str:
        return self.key or API_KEY_PREFIX + self.session_id


@dataclass
class Invocation:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    #: extra read-only (host path, path inside) binds the sandbox must add (the oracle's /solution)
    binds: list[tuple[Path, str]] = field(default_factory=list)

    def shell(self) -> str:
        """The command as one copy-pasteable line (for logs and `polar harness run --dry-run`)."""
        keys = sorted(k for k in self.env if k not in PASSTHROUGH_ENV)
        env = " ".join(f"{k}={shlex.quote(self.env[k])}" for k in keys)
        return f"cd {shlex.quote(str(self.cwd))} && env {env} {shlex.join(self.argv)}"


def base_env(s: Session) -> dict[str, str]:
    """A clean environment: isolated HOME/XDG dirs, no inherited keys, proxies or CA overrides."""
    env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    home = s.home
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        XDG_CACHE_HOME=str(home / ".cache"),
        TERM="dumb",
        NO_COLOR="1",
        FORCE_COLOR="0",
        NO_UPDATE_NOTIFIER="1",
        NPM_CONFIG_UPDATE_NOTIFIER="false",
        DO_NOT_TRACK="1",
        POLAR_SESSION=s.session_id,
        POLAR_API_KEY=s.api_key,
        POLAR_MODEL=s.model,
        POLAR_MODE=s.endpoint.mode,
        POLAR_WORKDIR=str(s.workdir),
    )
    if s.resume:
        env["POLAR_RESUME"] = "1"  # a generic harness continues its last conversation
    if os.geteuid() == 0:
        env["IS_SANDBOX"] = "1"  # Claude Code refuses --dangerously-skip-permissions as root otherwise
    ep = s.endpoint
    if ep.base_url:
        env["POLAR_BASE_URL"] = ep.base_url
    if ep.mode == "proxy":
        proxy = ep.proxy_url_with_session(s.session_id, s.key)
        env["POLAR_PROXY_URL"] = proxy
        for k in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy"):
            env[k] = proxy
        env["NO_PROXY"] = env["no_proxy"] = ""  # also proxy 127.0.0.1 (some harnesses tunnel it)
        ca = str(ep.ca_cert)
        env.update(NODE_EXTRA_CA_CERTS=ca, SSL_CERT_FILE=ca, CODEX_CA_CERTIFICATE=ca,
                   REQUESTS_CA_BUNDLE=ca, CURL_CA_BUNDLE=ca)
    env.update(s.extra_env)
    return env


def _write_home(home: Path, path: Path, text: str) -> None:
    """Write a harness's config file under its isolated HOME. HOME is the sample's: on a follow-up
    turn any dir or file on the way may be a link the last turn planted (``~/.codex`` ->
    ``/root/.ssh``); ``hostfs`` walks it without following one and replaces, never writes through."""
    from polar_trial import hostfs

    hostfs.write_bytes(home, path, text.encode())


def _write_json(home: Path, path: Path, data: object) -> None:
    _write_home(home, path, json.dumps(data, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# presets


class Preset:
    """How to run one harness headless. Subclasses fill ``prepare`` (config files, argv, env)."""

    name: str = ""
    package: str | None = None  # key of PACKAGES; None for the generic preset
    wire: str = ""  # provider wire format the harness speaks (schema.PROVIDERS)
    description: str = ""
    needs_model: bool = True  # False: runs without a model server (oracle, nop)
    trim_flags: str = ""  # documentation of what ``trim`` does for this harness
    resume_flags: str = ""  # documentation of how ``Session.resume`` continues the last conversation

    def binary(self) -> Path:
        pkg = PACKAGES[self.package]  # type: ignore[index]
        if not pkg.installed():
            raise FileNotFoundError(f"{pkg.spec} is not installed: run `polar harness install {pkg.name}`")
        return pkg.bin_path

    def installed(self) -> bool:
        return self.package is None or PACKAGES[self.package].installed()

    def prepare(self, s: Session) -> Invocation:
        raise NotImplementedError

    def _dirs(self, s: Session) -> None:
        (s.host_workdir or s.workdir).mkdir(parents=True, exist_ok=True)
        s.home.mkdir(parents=True, exist_ok=True)


class Codex(Preset):
    name, package, wire = "codex", "codex", "openai_responses"
    description = "OpenAI Codex CLI (`codex exec`), Responses API"
    trim_flags = '`--disable multi_agent --disable goals -c web_search="disabled"` (4 function tools left)'
    resume_flags = "`codex exec resume --last`"

    def prepare(self, s: Session) -> Invocation:
        self._dirs(s)
        codex_home = s.home / ".codex"
        base = f"{s.endpoint.base_url}/v1" if s.endpoint.mode == "base_url" else OPENAI_HOSTED
        # A provider of our own (not the built-in "openai" one) so that no login or ChatGPT auth
        # flow starts; in proxy mode it still names the hosted URL, so the wire is unchanged.
        _write_home(s.home, codex_home / "config.toml",
            f'model = {json.dumps(s.model)}\n'
            'model_provider = "polar"\n'
            'approval_policy = "never"\n'
            'sandbox_mode = "danger-full-access"\n'
            'check_for_update_on_startup = false\n'
            '[analytics]\nenabled = false\n'
            '[feedback]\nenabled = false\n'
            '[otel]\nexporter = "none"\n'
            '[model_providers.polar]\n'
            'name = "polar"\n'
            f'base_url = {json.dumps(base)}\n'
            'env_key = "POLAR_API_KEY"\n'
            'wire_api = "responses"\n'
            'request_max_retries = 1\n'
            'stream_max_retries = 1\n'
        )
        env = base_env(s)
        env["CODEX_HOME"] = str(codex_home)
        # ``exec resume`` has no --cd: its --last picks the newest session of the cwd (the work dir)
        argv = [str(self.binary()), "exec", *(["resume", "--last"] if s.resume else []), "--skip-git-repo-check",
                "--json", "--dangerously-bypass-approvals-and-sandbox",
                *([] if s.resume else ["--cd", str(s.workdir)]), "--model", s.model]
        if s.trim:
            argv += ["--disable", "multi_agent", "--disable", "goals", "-c", 'web_search="disabled"']
        argv.append(s.task)
        return Invocation(argv, env, s.workdir)


class ClaudeCode(Preset):
    name, package, wire = "claude-code", "claude-code", "anthropic"
    description = "Anthropic Claude Code (`claude -p`), Messages API"
    trim_flags = "`--bare` (no CLAUDE.md/hooks/MCP, short system prompt, no in-message system reminder)"
    resume_flags = "`--continue`"

    def prepare(self, s: Session) -> Invocation:
        self._dirs(s)
        cfg = s.home / ".claude"
        _write_json(s.home, cfg / "settings.json", {"autoUpdates": False, "includeCoAuthoredBy": False})
        env = base_env(s)
        env.update(
            ANTHROPIC_API_KEY=s.api_key,  # sent as x-api-key
            CLAUDE_CONFIG_DIR=str(cfg),
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_TELEMETRY="1",
            DISABLE_ERROR_REPORTING="1",
            DISABLE_AUTOUPDATER="1",
            DISABLE_BUG_COMMAND="1",
            CLAUDE_CODE_DISABLE_TERMINAL_TITLE="1",
        )
        if s.endpoint.mode == "base_url":
            env["ANTHROPIC_BASE_URL"] = s.endpoint.base_url
        argv = [str(self.binary()), "-p", s.task, "--output-format", "stream-json", "--verbose",
                "--dangerously-skip-permissions", "--model", s.model]
        if s.trim:
            argv.append("--bare")
        if s.resume:
            argv.append("--continue")
        return Invocation(argv, env, s.workdir)


#: Tools a headless coding run does not need (sub-agents, goals, skills, notebooks, tool search).
QWEN_EXCLUDED_TOOLS = ("agent", "list_agents", "get_goal", "update_goal", "skill", "notebook_edit")
GEMINI_EXCLUDED_TOOLS = ("web_fetch", "google_web_search", "enter_plan_mode", "invoke_agent", "activate_skill",
                         "update_topic", "list_background_processes", "read_background_output")


class QwenCode(Preset):
    name, package, wire = "qwen-code", "qwen-code", "openai_chat"
    description = "Qwen Code (`qwen --yolo`), Chat Completions"
    trim_flags = f"`--safe-mode --exclude-tools {','.join(QWEN_EXCLUDED_TOOLS)}`"
    resume_flags = "`--continue`"

    def prepare(self, s: Session) -> Invocation:
        self._dirs(s)
        settings: dict = {
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True, "checkpointing": {"enabled": False}},
        }
        _write_json(s.home, s.home / ".qwen" / "settings.json", settings)
        env = base_env(s)
        env.update(
            OPENAI_BASE_URL=f"{s.endpoint.base_url}/v1" if s.endpoint.mode == "base_url" else OPENAI_HOSTED,
            OPENAI_API_KEY=s.api_key,
            OPENAI_MODEL=s.model,
        )
        env["QWEN_CODE_SUPPRESS_YOLO_WARNING"] = "1"
        argv = [str(self.binary())]
        if s.trim:  # an array flag swallows the positionals after it: it goes first, the task last
            argv += ["--exclude-tools", *QWEN_EXCLUDED_TOOLS, "--safe-mode"]
        argv += ["--auth-type", "openai", "--yolo", "-o", "json", "--model", s.model,
                 *(["--continue"] if s.resume else []), s.task]
        return Invocation(argv, env, s.workdir)


#: Pi's four wire formats: (preset suffix, Pi `api` name, provider wire, hosted base URL).
PI_APIS = {
    "chat": ("openai-completions", "openai_chat", OPENAI_HOSTED),
    "responses": ("openai-responses", "openai_responses", OPENAI_HOSTED),
    "anthropic": ("anthropic-messages", "anthropic", ANTHROPIC_HOSTED),
    "google": ("google-generative-ai", "google", GOOGLE_HOSTED + "/v1beta"),
}


class Pi(Preset):
    package = "pi"
    trim_flags = "`--no-context-files --no-extensions --no-skills --no-prompt-templates` (tools: read, bash, edit, write)"
    resume_flags = "`--continue`"

    def __init__(self, variant: str):
        self.variant = variant
        self.api, self.wire, self.hosted = PI_APIS[variant]
        self.name = f"pi-{variant}"
        self.description = f"Pi coding agent (`pi -p`), {self.api}"

    def base(self, s: Session) -> str:
        if s.endpoint.mode == "proxy":
            return self.hosted
        if self.variant in ("chat", "responses"):
            return f"{s.endpoint.base_url}/v1"
        if self.variant == "google":
            return f"{s.endpoint.base_url}/v1beta"
        return s.endpoint.base_url

    def prepare(self, s: Session) -> Invocation:
        self._dirs(s)
        agent_dir = s.home / ".pi" / "agent"
        provider = {
            "api": self.api,
            "baseUrl": self.base(s),
            "apiKey": "POLAR_API_KEY",  # an env var name: Pi resolves it
            "models": [{"id": s.model, "name": s.model, "reasoning": False, "input": ["text"],
                        "contextWindow": 32768, "maxTokens": 4096,
                        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}],
        }
        if self.variant == "chat":
            provider["compat"] = {"supportsDeveloperRole": False}
        _write_json(s.home, agent_dir / "models.json", {"providers": {"polar": provider}})
        _write_json(s.home, agent_dir / "settings.json", {"defaultProvider": "polar", "defaultModel": s.model})
        env = base_env(s)
        env["PI_CODING_AGENT_DIR"] = str(agent_dir)
        env.update(PI_OFFLINE="1", PI_SKIP_VERSION_CHECK="1", PI_TELEMETRY="0")
        argv = [str(self.binary()), "-p", "--model", f"polar/{s.model}"]
        if s.trim:  # nothing from the machine leaks into the prompt; tools stay the default four
            argv += ["--no-context-files", "--no-extensions", "--no-skills", "--no-prompt-templates"]
        if s.resume:
            argv.append("--continue")
        argv.append(s.task)
        return Invocation(argv, env, s.workdir)


class Gemini(Preset):
    name, package, wire = "gemini", "gemini", "google"
    description = "Google Gemini CLI (`gemini -p`), streamGenerateContent"
    trim_flags = f"settings.json `tools.exclude`: {', '.join(GEMINI_EXCLUDED_TOOLS)} (no CLI flag for it)"
    resume_flags = "`--resume latest`"

    def prepare(self, s: Session) -> Invocation:
        self._dirs(s)
        settings = {
            "security": {"auth": {"selectedType": "gemini-api-key"}},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True, "checkpointing": {"enabled": False}},
        }
        if s.trim:
            settings["tools"] = {"exclude": list(GEMINI_EXCLUDED_TOOLS)}
        _write_json(s.home, s.home / ".gemini" / "settings.json", settings)
        env = base_env(s)
        env["GEMINI_API_KEY"] = s.api_key  # sent as x-goog-api-key
        if s.endpoint.mode == "base_url":
            env["GOOGLE_GEMINI_BASE_URL"] = s.endpoint.base_url
        # Always pass -m: without it a model-router call runs first and retries for ~85 s.
        argv = [str(self.binary()), "-m", s.model, *(["--resume", "latest"] if s.resume else []),
                "-p", s.task, "--yolo", "--skip-trust", "-o", "json"]
        return Invocation(argv, env, s.workdir)


OPENCODE_DISABLED_TOOLS = ("task", "skill", "todowrite")


class OpenCode(Preset):
    name, package, wire = "opencode", "opencode", "openai_chat"
    description = "OpenCode (`opencode run`), Chat Completions via @ai-sdk/openai-compatible"
    trim_flags = f"opencode.json `tools`: {', '.join(OPENCODE_DISABLED_TOOLS)} off (no CLI flag for it)"
    resume_flags = "`run --continue`"

    def prepare(self, s: Session) -> Invocation:
        self._dirs(s)
        base = f"{s.endpoint.base_url}/v1" if s.endpoint.mode == "base_url" else OPENAI_HOSTED
        cfg = {
            "$schema": "https://opencode.ai/config.json",
            "autoupdate": False,
            "share": "disabled",
            "provider": {
                "polar": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "polar",
                    # OpenCode sends its own x-session-id header, which a proxy reads before the API
                    # key; x-polar-session outranks it, so the capture lands under our session id.
                    "options": {"baseURL": base, "apiKey": s.api_key, "headers": {"x-polar-session": s.session_id}},
                    "models": {s.model: {"name": s.model}},
                }
            },
            "model": f"polar/{s.model}",
            "small_model": f"polar/{s.model}",
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny", "external_directory": "allow"},
        }
        if s.trim:
            cfg["tools"] = {t: False for t in OPENCODE_DISABLED_TOOLS}
        # Outside the work dir (OPENCODE_CONFIG) so the task's files stay the task's.
        cfg_path = s.home / ".config" / "opencode" / "opencode.json"
        _write_json(s.home, cfg_path, cfg)
        # OpenCode npm-installs @opencode-ai/plugin into every config dir in the background at
        # start: a registry side call per fresh HOME. npm's offline mode makes it fail at once.
        _write_home(s.home, s.home / ".npmrc", "offline=true\naudit=false\nfund=false\nupdate-notifier=false\n")
        env = base_env(s)
        env["npm_config_offline"] = "true"
        env.update(OPENCODE_CONFIG=str(cfg_path), OPENCODE_DISABLE_MODELS_FETCH="1",
                   OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_LSP_DOWNLOAD="1",
                   OPENCODE_DISABLE_SHARE="1", OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
                   OPENCODE_DISABLE_CLAUDE_CODE="1", OPENCODE_DISABLE_EXTERNAL_SKILLS="1")
        argv = [str(self.binary()), "run", "--model", f"polar/{s.model}", *(["--continue"] if s.resume else []), s.task]
        return Invocation(argv, env, s.workdir)


class Generic(Preset):
    """Any shell command. Placeholders are substituted shell-quoted: {task} {workdir} {home}
    {session} {api_key} {model} {base_url} {proxy_url}; the same facts are in the environment
    (POLAR_SESSION, POLAR_API_KEY, POLAR_MODEL, POLAR_BASE_URL, POLAR_PROXY_URL, POLAR_WORKDIR, and
    POLAR_RESUME=1 on a task's follow-up turns, when the command should continue its conversation)."""

    name, package, wire = "generic", None, ""
    description = "any command template: bring your own harness"

    def __init__(self, command: str = ""):
        self.command = command

    def prepare(self, s: Session) -> Invocation:
        if not self.command:
            raise ValueError("the generic preset needs a command template (--command)")
        self._dirs(s)
        env = base_env(s)
        values = {
            "task": s.task, "workdir": str(s.workdir), "home": str(s.home), "session": s.session_id,
            "api_key": s.api_key, "model": s.model, "base_url": s.endpoint.base_url,
            "proxy_url": env.get("POLAR_PROXY_URL", ""),
        }
        # Only the known placeholders are replaced, so shell braces (${VAR}, awk '{print}') survive.
        cmd = re.sub(r"\{(" + "|".join(values) + r")\}", lambda m: shlex.quote(values[m[1]]), self.command)
        return Invocation(["bash", "-c", cmd], env, s.workdir)


class Oracle(Preset):
    """Harbor's ``oracle`` agent: runs the task's ``solution/solve.sh`` (bound read-only at
    /solution) in exactly the sandbox an agent gets, with task.toml's ``[solution] env``. A task
    whose oracle does not score 1 has a broken verifier or solution (``polar tasks check``)."""

    name, package, wire = "oracle", None, ""
    description = "the task's reference solution (solution/solve.sh); no model"
    needs_model = False

    def prepare(self, s: Session) -> Invocation:
        if s.solution_dir is None or not (s.solution_dir / "solve.sh").is_file():
            raise FileNotFoundError("the task has no solution/solve.sh for the oracle")
        self._dirs(s)
        return Invocation(["bash", "/solution/solve.sh"], base_env(s), s.workdir,
                          binds=[(s.solution_dir, "/solution")])


class Nop(Preset):
    """Harbor's ``nop`` agent: does nothing, so the verifier judges the untouched environment. A
    task whose nop scores as high as its oracle does not test anything (``polar tasks check``)."""

    name, package, wire = "nop", None, ""
    description = "does nothing (the untouched environment); no model"
    needs_model = False

    def prepare(self, s: Session) -> Invocation:
        self._dirs(s)
        return Invocation(["true"], base_env(s), s.workdir)


#: Presets that need no model server and no npm package.
NO_MODEL_PRESETS: dict[str, type[Preset]] = {"oracle": Oracle, "nop": Nop}


def presets() -> dict[str, Preset]:
    ps: list[Preset] = [Codex(), ClaudeCode(), QwenCode(), *(Pi(v) for v in PI_APIS), Gemini(), OpenCode()]
    return {p.name: p for p in ps}


#: Short aliases accepted wherever a preset name is.
ALIASES = {"pi": "pi-chat", "claude": "claude-code", "qwen": "qwen-code", "gemini-cli": "gemini"}


def get_preset(name: str, command: str = "") -> Preset:
    if name == "generic" or command:
        return Generic(command)
    if name in NO_MODEL_PRESETS:
        return NO_MODEL_PRESETS[name]()
    name = ALIASES.get(name, name)
    table = presets()
    if name not in table:
        raise KeyError(f"unknown harness {name!r}; known: {', '.join([*table, 'generic', *NO_MODEL_PRESETS])}")
    return table[name]


# ---------------------------------------------------------------------------------------------
# running


@dataclass
class RunResult:
    returncode: int | None  # None when it was killed for the timeout
    timed_out: bool
    wall_s: float
    stdout_path: Path
    stderr_path: Path
    notes: list[str] = field(default_factory=list)  # what the sandbox enforced or contained

    def tail(self, n: int = 2000) -> str:
        out = []
        for p in (self.stdout_path, self.stderr_path):
            with contextlib.suppress(OSError), open(p, "rb") as fh:
                fh.seek(max(0, fh.seek(0, 2) - 4 * n))  # only the end: the output may be large
                out.append(fh.read().decode(errors="replace")[-n:])
        return "\n".join(out)


#: Harness processes running now (each leads its own process group), for ``terminate_all``.
_ACTIVE: set[subprocess.Popen] = set()
_ACTIVE_LOCK = threading.Lock()


def terminate_all() -> int:
    """Kill every running harness's process group (Ctrl-C of a rollout: they do not get the
    terminal's SIGINT, being in groups of their own). Returns how many were running."""
    with _ACTIVE_LOCK:
        procs = list(_ACTIVE)
    for proc in procs:
        kill_group(proc, grace=2.0)
    return len(procs)


def run_invocation(inv: Invocation, timeout: float, log_dir: Path, name: str = "harness",
                   sandbox: object | None = None, spec: object | None = None) -> RunResult:
    """Run headless (stdin closed) in its own process group; a hard timeout kills the whole group.

    With ``sandbox`` (a polar_trial.sandbox.Sandbox) and its ``spec``, the invocation runs in it:
    argv and env as prepared, the timeout the spec's; ``RunResult.notes`` are the sandbox's."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_p, err_p = log_dir / f"{name}.stdout", log_dir / f"{name}.stderr"
    t0 = time.monotonic()
    if sandbox is not None:
        spec.env, spec.timeout_s = dict(inv.env), timeout  # type: ignore[attr-defined]
        with open(out_p, "wb") as out, open(err_p, "wb") as err:
            res = sandbox.run(spec, list(inv.argv), stdout=out, stderr=err)  # type: ignore[attr-defined]
        return RunResult(None if res.timed_out else res.returncode, res.timed_out, time.monotonic() - t0,
                         out_p, err_p, list(res.notes))
    with open(out_p, "wb") as out, open(err_p, "wb") as err:
        proc = subprocess.Popen(inv.argv, env=inv.env, cwd=inv.cwd, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, start_new_session=True)
        with _ACTIVE_LOCK:
            _ACTIVE.add(proc)
        cancel.track(proc)  # a dropped straggler group's harnesses are killed with it
        try:
            rc: int | None = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        finally:
            # On timeout the whole group goes; after a clean exit, whatever it left behind does.
            kill_group(proc, grace=5.0 if proc.returncode is None else 0.0)
            cancel.untrack(proc)
            with _ACTIVE_LOCK:
                _ACTIVE.discard(proc)
    return RunResult(rc, timed_out, time.monotonic() - t0, out_p, err_p)
