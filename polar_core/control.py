"""Client of the proxy's loopback control API (``/_polar/...``): status, pause (and drain), resume,
policy version, sessions.

The trainer (pausing the proxy while weights are swapped) and the rollout runner (registering
sessions) use it; neither needs the proxy's code, only its address.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from polar_core.net import http_request


class ProxyControl:
    """Client of the loopback control API: status, pause (and drain), resume, policy version, sessions."""

    def __init__(self, base_url: str, timeout: float = 30.0):
        self.base = base_url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, name: str, body: Any = None, timeout: float | None = None) -> dict[str, Any]:
        status, payload = http_request(f"{self.base}/_polar/{name}", body, method=method,
                                       timeout=timeout or self.timeout)
        if 200 <= status < 300:
            return orjson.loads(payload)
        try:
            return {"http_status": status, **orjson.loads(payload)}
        except orjson.JSONDecodeError:
            raise RuntimeError(f"control API {name}: HTTP {status}: {payload[:200]!r}") from None

    def status(self) -> dict[str, Any]:
        return self._call("GET", "status")

    def pause(self, drain: bool = True, timeout: float = 300.0) -> dict[str, Any]:
        """Hold new calls; with ``drain`` also wait until in-flight calls are done."""
        return self._call("POST", "pause", {"drain": drain, "timeout": timeout}, timeout=timeout + 10)

    def resume(self, policy_version: int | None = None) -> dict[str, Any]:
        return self._call("POST", "resume", {"policy_version": policy_version} if policy_version is not None else {})

    def set_policy_version(self, version: int) -> dict[str, Any]:
        return self._call("POST", "policy_version", {"policy_version": version})

    def register_sessions(self, sessions: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        """Tell the proxy task/group/sample ids of sessions: ``[{session_id, task_id, group_id, sample_index}]``
        (and ``harness``, the name records carry instead of the one read from the user agent)."""
        return self._call("POST", "sessions", {"sessions": list(sessions)})

    def sessions(self) -> dict[str, Any]:
        return self._call("GET", "sessions")

    def forget_session(self, session_id: str) -> dict[str, Any]:
        return self._call("DELETE", "sessions", {"session_id": session_id})
