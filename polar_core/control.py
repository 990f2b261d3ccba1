"""Client of the proxy's loopback control API (``/_polar/...``): status, pause (and drain), resume,
policy version, sessions.

The trainer (pausing the proxy while weights are swapped) and the rollout runner (registering
sessions) use it; neither needs the proxy's code, only its address and the run's control secret.

The control secret: the proxy answers ``/_polar/`` only with ``Authorization: Bearer <secret>``
(or ``x-polar-control-token``). The proxy takes it from its ``polar_control_token`` option, else
``$POLAR_CONTROL_TOKEN`` in its own environment, else generates one at start; it writes it, mode
0600, to ``<confdir>/polar-control-<port>.token`` (``token_file``), a directory no sandbox sees.
This client finds it in that order: the ``token`` argument, the tokens of proxies this process
started (``remember_token``), ``$POLAR_CONTROL_TOKEN``, the token file of the URL's port under
``$POLAR_HOME/mitmproxy`` then ``~/.mitmproxy`` (plain ``mitmdump``'s confdir).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from polar_core import paths
from polar_core.net import http_request

#: Header names the control API reads its secret from (besides ``Authorization: Bearer``).
TOKEN_HEADER = "x-polar-control-token"
TOKEN_ENV = "POLAR_CONTROL_TOKEN"

_known: dict[str, str] = {}  # base URL -> token, for the proxies this process started


def token_file(port: int, confdir: str | os.PathLike[str] | None = None) -> Path:
    """Where a proxy listening on ``port`` writes its control secret (mode 0600)."""
    return Path(confdir if confdir is not None else paths.mitmproxy_confdir()) / f"polar-control-{port}.token"


def remember_token(base_url: str, token: str) -> None:
    """Let every ``ProxyControl(base_url)`` of this process use ``token`` (``ProxyProcess`` calls this)."""
    _known[base_url.rstrip("/")] = token


def find_token(base_url: str, confdirs: Iterable[str | os.PathLike[str]] = ()) -> str | None:
    """The control secret of the proxy at ``base_url`` (see the module docstring), or None.
    ``confdirs``: where else to look first (a proxy started with its own confdir)."""
    base = base_url.rstrip("/")
    if base in _known:
        return _known[base]
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    try:
        u = urlsplit(base if "://" in base else f"http://{base}")
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return None
    for confdir in (*confdirs, paths.mitmproxy_confdir(), Path.home() / ".mitmproxy"):
        try:
            text = token_file(port, confdir).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return None


class ProxyControl:
    """Client of the loopback control API: status, pause (and drain), resume, policy version, sessions."""

    def __init__(self, base_url: str, timeout: float = 30.0, token: str | None = None):
        self.base = base_url.rstrip("/")
        self.timeout = timeout
        self._token = token

    @property
    def token(self) -> str | None:
        return self._token or find_token(self.base)

    def _call(self, method: str, name: str, body: Any = None, timeout: float | None = None) -> dict[str, Any]:
        token = self.token
        status, payload = http_request(f"{self.base}/_polar/{name}", body, method=method,
                                       timeout=timeout or self.timeout,
                                       headers={"Authorization": f"Bearer {token}"} if token else None)
        if 200 <= status < 300:
            return orjson.loads(payload)
        try:
            return {"http_status": status, **orjson.loads(payload)}
        except orjson.JSONDecodeError:
            raise RuntimeError(f"control API {name}: HTTP {status}: {payload[:200]!r}") from None

    def status(self) -> dict[str, Any]:
        answer = self._call("GET", "status")
        if answer.get("http_status") in (401, 403):  # a proxy is there, but not ours to control
            raise PermissionError(f"control API of {self.base}: {answer.get('error')}")
        return answer

    def pause(self, drain: bool = True, timeout: float = 300.0) -> dict[str, Any]:
        """Hold new calls; with ``drain`` also wait until in-flight calls are done."""
        return self._call("POST", "pause", {"drain": drain, "timeout": timeout}, timeout=timeout + 10)

    def resume(self, policy_version: int | None = None) -> dict[str, Any]:
        return self._call("POST", "resume", {"policy_version": policy_version} if policy_version is not None else {})

    def set_policy_version(self, version: int) -> dict[str, Any]:
        return self._call("POST", "policy_version", {"policy_version": version})

    def register_sessions(self, sessions: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        """Tell the proxy task/group/sample ids of sessions: ``[{session_id, task_id, group_id, sample_index}]``
        (and ``harness``, the name records carry instead of the one read from the user agent).
        The answer's ``keys`` maps each session to the secret the proxy issued for it: the API key
        (or proxy password) its harness must use; the session's calls are bound to it."""
        return self._call("POST", "sessions", {"sessions": list(sessions)})

    def sessions(self) -> dict[str, Any]:
        return self._call("GET", "sessions")

    def forget_session(self, session_id: str) -> dict[str, Any]:
        return self._call("DELETE", "sessions", {"session_id": session_id})
