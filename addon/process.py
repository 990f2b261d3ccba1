"""Run the Polar proxy as a child process: ``with ProxyProcess(upstream, capture_dir) as proxy: ...``.

Why a process and not an in-process master: the proxy is what harnesses, rollouts, benchmarks and
tests talk to over sockets, exactly as in production; a child ``mitmdump`` keeps its event loop,
its crash and its CPU separate from the caller. The client of the proxy's loopback control API
(``/_polar/...``) is ``polar_core.control.ProxyControl``: the trainer and the rollout runner use it
without importing the proxy. Each ``ProxyProcess`` makes its own control secret (``control_token``)
and hands it to mitmdump through the environment (never the command line, which every process can
read); ``self.control`` and every ``ProxyControl(self.url)`` of this process use it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from polar_core import paths
from polar_core.control import TOKEN_ENV, ProxyControl, remember_token
from polar_core.net import free_port
from polar_core.processes import kill_group

ENTRY_SCRIPT = Path(__file__).resolve().parent / "polar.py"


def mitmdump_path() -> str:
    """mitmdump next to the running interpreter (the project venv), else on PATH."""
    here = Path(sys.executable).parent / "mitmdump"
    if here.exists():
        return str(here)
    found = shutil.which("mitmdump")
    if not found:
        raise FileNotFoundError("mitmdump not found: install mitmproxy==11.0.2 into this environment")
    return found


class ProxyProcess:
    """Start ``mitmdump -s addon/polar.py`` on a free loopback port, wait until it serves, stop it.

    ``mode``: ``"reverse"`` (harness base URL = ``proxy.url``) or ``"regular"`` (harness keeps its
    hosted-API URLs and gets ``proxy.harness_env()``: HTTPS_PROXY and the CA bundle).
    """

    def __init__(
        self,
        upstream: str | Iterable[str],
        capture_dir: str | os.PathLike[str],
        *,
        mode: str = "reverse",
        host: str = "127.0.0.1",
        port: int | None = None,
        confdir: str | os.PathLike[str] | None = None,
        served_model: str | None = None,
        engine: str = "vllm",
        stream_mode: str = "passthrough",
        intercept_hosts: Iterable[str] | None = None,
        upstream_timeout: float | None = None,
        passthrough: bool = True,
        options: Mapping[str, Any] | None = None,
        log_file: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
        web: bool = False,
        env: Mapping[str, str] | None = None,
        control_token: str | None = None,
    ):
        if mode not in ("reverse", "regular"):
            raise ValueError("mode must be 'reverse' or 'regular'")
        self.upstreams = [upstream] if isinstance(upstream, str) else list(upstream)
        self.upstreams = [u for part in self.upstreams for u in part.split(",") if u.strip()]
        if not self.upstreams:
            raise ValueError("at least one upstream URL is needed")
        self.capture_dir = paths.absolute(capture_dir)  # mitmdump gets it as an option
        self.mode = mode
        self.host = host
        self.port = port
        self.confdir = paths.absolute(confdir) if confdir else paths.mitmproxy_confdir()
        self.served_model = served_model
        self.engine = engine
        self.stream_mode = stream_mode
        self.intercept_hosts = list(intercept_hosts) if intercept_hosts is not None else None
        self.upstream_timeout = upstream_timeout
        self.passthrough = passthrough
        self.options = dict(options or {})
        self.log_file = paths.absolute(log_file) if log_file else None
        self.startup_timeout = startup_timeout
        self.web = web
        self.env = dict(env) if env is not None else None
        self.control_token = control_token or self.options.get("polar_control_token") or secrets.token_urlsafe(32)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._own_log: Path | None = None

    # -- addresses ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The proxy as a server: base URL for reverse mode and for the control API."""
        return f"http://{self.host}:{self.port}"

    @property
    def proxy_url(self) -> str:
        return self.url

    @property
    def ca_cert(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    @property
    def control(self) -> ProxyControl:
        return ProxyControl(self.url, token=self.control_token)

    def harness_env(self, session: str | None = None) -> dict[str, str]:
        """Environment a harness needs to go through this proxy (regular mode) or to it (reverse)."""
        if self.mode == "reverse":
            return {"OPENAI_BASE_URL": f"{self.url}/v1", "ANTHROPIC_BASE_URL": self.url,
                    "GOOGLE_GEMINI_BASE_URL": self.url}
        auth = f"{session}@" if session else ""
        proxy = f"http://{auth}{self.host}:{self.port}"
        ca = str(self.ca_cert)
        return {"HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy, "http_proxy": proxy,
                "NO_PROXY": "", "no_proxy": "", "NODE_EXTRA_CA_CERTS": ca, "SSL_CERT_FILE": ca,
                "REQUESTS_CA_BUNDLE": ca, "CODEX_CA_CERTIFICATE": ca}

    # -- lifecycle ----------------------------------------------------------------------------
    def command(self) -> list[str]:
        dump = Path(mitmdump_path())
        cmd = [str(dump.with_name("mitmweb")), "--no-web-open-browser"] if self.web else [str(dump)]
        cmd += ["-s", str(ENTRY_SCRIPT), "--listen-host", self.host, "--listen-port", str(self.port)]
        if self.mode == "reverse":
            cmd += ["--mode", f"reverse:{self.upstreams[0]}"]
        opts: dict[str, Any] = {
            "flow_detail": 0,
            "termlog_verbosity": "warn",
            "confdir": self.confdir,
            "connection_strategy": "lazy",
            "polar_capture_dir": self.capture_dir,
            "polar_upstream": ",".join(self.upstreams),
            "polar_engine": self.engine,
            "polar_stream_mode": self.stream_mode,
            "polar_passthrough": self.passthrough,
        }
        if self.served_model:
            opts["polar_served_model"] = self.served_model
        if self.upstream_timeout is not None:
            opts["polar_upstream_timeout"] = f"{self.upstream_timeout:g}"
        if self.intercept_hosts is not None:
            opts["polar_intercept_hosts"] = list(self.intercept_hosts)
        opts.update(self.options)  # the caller's options win
        for key, value in opts.items():
            if isinstance(value, bool):
                value = "true" if value else "false"
            for v in value if isinstance(value, (list, tuple)) else [value]:
                cmd += ["--set", f"{key}={v}"]
        return cmd

    def start(self) -> "ProxyProcess":
        self.capture_dir.mkdir(parents=True, exist_ok=True)
        self.confdir.mkdir(parents=True, exist_ok=True)
        fixed_port = self.port is not None
        last_error = ""
        for _ in range(1 if fixed_port else 4):
            if not fixed_port:
                self.port = free_port(self.host)
            if self.log_file is None:
                fd, name = tempfile.mkstemp(prefix="polar-proxy-", suffix=".log")
                os.close(fd)
                self._own_log = Path(name)
            log_path = self.log_file or self._own_log
            assert log_path is not None
            self._log = open(log_path, "ab")
            env = dict(os.environ if self.env is None else self.env)
            for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
                env.pop(k, None)
            env[TOKEN_ENV] = self.control_token  # unless polar_control_token is set in options
            remember_token(self.url, self.control_token)
            self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            if self._wait_ready():
                return self
            last_error = self.log_tail()
            self.stop()
            if "address already in use" not in last_error.lower():
                break
        raise RuntimeError(f"polar proxy did not start:\n{last_error}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        ctl = ProxyControl(self.url, timeout=2, token=self.control_token)
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                ctl.status()
                return True
            except (OSError, RuntimeError, ValueError):
                time.sleep(0.05)
        return False

    def log_tail(self, n: int = 4000) -> str:
        path = self.log_file or self._own_log
        if path is None or not path.exists():
            return ""
        return path.read_bytes()[-n:].decode("utf-8", "replace")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            kill_group(proc, timeout)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._own_log is not None and proc is not None and proc.returncode in (0, -signal.SIGTERM):
            self._own_log.unlink(missing_ok=True)
            self._own_log = None

    def __enter__(self) -> "ProxyProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort: never leave a mitmdump behind
        try:
            self.stop(timeout=2)
        except Exception:
            pass
