"""Session resolution: which harness run a model call belongs to, and how we know.

Why an explicit precedence: the rollout runner can always say it best (a header or a proxy user
name it sets), a harness configured with an API key ``polar-<session>`` says it next, the
harness's own session header is a good fallback, and a client connection is the last resort.
Every id ends up as a file name, so anything that fails ``valid_session_id`` is refused, never
sanitized into something else.

Pure functions over a lower-cased header dict: no mitmproxy imports, unit-testable.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass

from polar_core.schema import harness_name, valid_session_id  # noqa: F401 - harness_name re-exported

#: Headers the rollout runner (or a user) sets to name the session explicitly.
SESSION_HEADERS = ("x-polar-session", "x-session-id")
#: Headers the harnesses send on their own (Codex, Claude Code). OpenCode's x-session-id is above.
HARNESS_SESSION_HEADERS = ("session-id", "x-claude-code-session-id")
#: Where an API key can travel, in the order we look.
API_KEY_HEADERS = ("x-api-key", "x-goog-api-key")
API_KEY_PREFIX = "polar-"

#: Headers whose values are secrets: never written to captures, scrubbed from flows.
SECRET_HEADERS = (
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "x-goog-api-key",
    "api-key",
    "cookie",
    "set-cookie",
    "openai-organization",
    "openai-project",
)
#: Query parameters that carry secrets (Google's ``?key=``).
SECRET_QUERY = ("key", "api_key", "apikey", "access_token")


class SessionError(Exception):
    """A session id was given but is not acceptable (answered as a provider-shaped 400)."""

    def __init__(self, message: str, source: str):
        super().__init__(message)
        self.message = message
        self.source = source


@dataclass(frozen=True)
class Session:
    id: str
    source: str  # header | proxy_auth | api_key | harness_header | connection


def basic_user(header_value: str | None) -> str | None:
    """The user name of a ``Basic`` Proxy-Authorization value, or None."""
    if not header_value:
        return None
    scheme, _, token = header_value.strip().partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    user = decoded.split(":", 1)[0]
    return user or None


def api_keys(headers: Mapping[str, str], query: Mapping[str, str]) -> list[str]:
    """Every API key the request carries, in precedence order (Bearer, x-api-key, x-goog-api-key, ?key=)."""
    keys: list[str] = []
    auth = headers.get("authorization", "")
    scheme, _, token = auth.strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    for h in API_KEY_HEADERS:
        if headers.get(h):
            keys.append(headers[h].strip())
    if query.get("key"):
        keys.append(query["key"].strip())
    return keys


def _checked(value: str, source: str, what: str) -> Session:
    value = value.strip()
    if not valid_session_id(value):
        raise SessionError(f"invalid session id in {what}: must match ^[A-Za-z0-9][A-Za-z0-9_.-]{{0,127}}$", source)
    return Session(value, source)


def resolve_session(
    headers: Mapping[str, str],
    query: Mapping[str, str] | None = None,
    *,
    proxy_auth: str | None = None,
    connection_id: str | None = None,
) -> Session:
    """Resolve the session of one request.

    ``headers`` must have lower-case keys. ``proxy_auth`` is the Proxy-Authorization value seen on
    this request or on the CONNECT that opened its tunnel. ``connection_id`` is the client
    connection's id (the last resort). Raises SessionError for an invalid id from any source.
    """
    query = query or {}
    for h in SESSION_HEADERS:
        if headers.get(h):
            return _checked(headers[h], "header", h)
    user = basic_user(proxy_auth or headers.get("proxy-authorization"))
    if user:
        return _checked(user, "proxy_auth", "proxy user name")
    for key in api_keys(headers, query):
        if key.startswith(API_KEY_PREFIX):
            return _checked(key[len(API_KEY_PREFIX):], "api_key", "API key")
    for h in HARNESS_SESSION_HEADERS:
        if headers.get(h):
            return _checked(headers[h], "harness_header", h)
    if connection_id:
        return Session(connection_session_id(connection_id), "connection")
    raise SessionError("no session and no connection", "connection")


def connection_session_id(connection_id: str) -> str:
    """A session id derived from a client connection id (a uuid): stable for the connection."""
    cleaned = "".join(c for c in connection_id if c.isalnum())[:32] or "unknown"
    return f"conn-{cleaned}"


def scrub_query_string(path: str) -> str:
    """``path`` with secret query values (``?key=...``) redacted."""
    base, sep, qs = path.partition("?")
    if not sep:
        return path
    parts = []
    for item in qs.split("&"):
        name, eq, _ = item.partition("=")
        parts.append(f"{name}=<redacted>" if eq and name.lower() in SECRET_QUERY else item)
    return base + "?" + "&".join(parts)
