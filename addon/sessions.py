"""Session resolution: which harness run a model call belongs to, and how we know.

Why an explicit precedence: the rollout runner can always say it best (a header or a proxy user
name it sets), a harness configured with an API key ``polar-<session>`` says it next, the
harness's own session header is a good fallback, and a client connection is the last resort.
Every id ends up as a file name, so anything that fails ``valid_session_id`` is refused, never
sanitized into something else.

Bound sessions (the rule when the control API registered sessions, as ``polar rollout`` does):
registering a session issues it a secret key (``polarkey-...``, see ``control.issue_key``), which
the harness gets as its API key or proxy password. Then:

* a request that carries an issued key (Bearer, ``x-api-key``, ``x-goog-api-key``, ``?key=``, the
  proxy password or user) belongs to that key's session, whatever else it says; if it also names
  another session (``x-polar-session``, ``x-session-id`` unless ``x-polar-session`` is there too, the
  proxy user, a ``polar-<session>`` key, a body ``session_id``/``polar_session`` at the top or in
  ``metadata``) or carries the keys of two sessions, it is refused (403, in the provider's shape,
  counted as ``session_refused``);
* a request without an issued key that resolves (by the precedence above) to a bound session is
  refused the same way: only the key speaks for its session;
* with ``polar_require_session_key`` every model call without an issued key is refused.

Unbound sessions (nothing registered, or registered by hand and never given a key by anyone) work
as before: plain ``mitmdump -s addon/polar.py`` usage is unchanged.

Pure functions over a lower-cased header dict: no mitmproxy imports, unit-testable.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polar_core.schema import harness_name, valid_session_id  # noqa: F401 - harness_name re-exported

#: Headers the rollout runner (or a user) sets to name the session explicitly.
SESSION_HEADERS = ("x-polar-session", "x-session-id")
#: Headers the harnesses send on their own (Codex, Claude Code). OpenCode's x-session-id is above.
HARNESS_SESSION_HEADERS = ("session-id", "x-claude-code-session-id")
#: Where an API key can travel, in the order we look.
API_KEY_HEADERS = ("x-api-key", "x-goog-api-key")
API_KEY_PREFIX = "polar-"
#: Prefix of the keys the control API issues (never ``polar-``: those name a session openly).
SESSION_KEY_PREFIX = "polarkey-"
#: Body fields (top level or under ``metadata``) that name a session: checked against a bound key.
BODY_SESSION_FIELDS = ("polar_session", "session_id")

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
    """A session id was given but is not acceptable (answered as a provider-shaped 400), or claims a
    session the request may not speak for (403, ``kind`` ``permission``)."""

    def __init__(self, message: str, source: str, status: int = 400, kind: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.source = source
        self.status = status
        self.kind = kind


def _forbidden(message: str, source: str) -> SessionError:
    return SessionError(f"polar: {message}", source, 403, "permission")


@dataclass(frozen=True)
class Session:
    id: str
    source: str  # header | proxy_auth | api_key | harness_header | connection


def basic_credentials(header_value: str | None) -> tuple[str, str] | None:
    """(user, password) of a ``Basic`` Proxy-Authorization value, or None."""
    if not header_value:
        return None
    scheme, _, token = header_value.strip().partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    user, _, password = decoded.partition(":")
    return user, password


def basic_user(header_value: str | None) -> str | None:
    """The user name of a ``Basic`` Proxy-Authorization value, or None."""
    creds = basic_credentials(header_value)
    return (creds[0] or None) if creds else None


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
    keys: Mapping[str, str] | None = None,
    bound: Mapping[str, str] | None = None,
    body: Any = None,
    require_key: bool = False,
) -> Session:
    """Resolve the session of one request.

    ``headers`` must have lower-case keys. ``proxy_auth`` is the Proxy-Authorization value seen on
    this request or on the CONNECT that opened its tunnel. ``connection_id`` is the client
    connection's id (the last resort). ``keys``: issued key -> its session; ``bound``: session ->
    its key (see the module docstring); ``body``: the parsed request body. Raises SessionError for
    an invalid id from any source, and (403) for a session the request may not speak for.
    """
    query = query or {}
    proxy_auth = proxy_auth or headers.get("proxy-authorization")
    if keys or require_key:
        creds = basic_credentials(proxy_auth)
        offered = api_keys(headers, query) + ([creds[1], creds[0]] if creds else [])
        owners = {keys[k] for k in offered if keys and k in keys}
        if len(owners) > 1:
            raise _forbidden("this request carries the keys of more than one session", "api_key")
        if owners:
            sid = owners.pop()
            claim = _other_claim(sid, headers, offered, creds, body, keys or {})
            if claim is not None:
                raise _forbidden(f"this request's key is bound to session {sid}; it may not speak for "
                                 f"session {claim[0]!r} ({claim[1]})", claim[1])
            return Session(sid, "key")
        if require_key:
            raise _forbidden("this proxy serves registered sessions only: the request carries no session "
                             "key issued by the control API", "api_key")
    session = _resolve_open(headers, query, proxy_auth, connection_id)
    if bound and session.id in bound:
        raise _forbidden(f"session {session.id!r} is bound to a key this request does not carry", session.source)
    return session


def _other_claim(sid: str, headers: Mapping[str, str], offered: list[str], creds: tuple[str, str] | None,
                 body: Any, keys: Mapping[str, str]) -> tuple[str, str] | None:
    """The first session other than ``sid`` that a keyed request names, with where: or None."""
    claims: list[tuple[str, str]] = []
    if headers.get("x-polar-session"):
        claims.append((headers["x-polar-session"].strip(), "header x-polar-session"))
    elif headers.get("x-session-id"):  # with x-polar-session present it is the harness's own (OpenCode)
        claims.append((headers["x-session-id"].strip(), "header x-session-id"))
    if creds and creds[0] and creds[0] not in keys:
        claims.append((creds[0], "proxy user name"))
    claims += [(k[len(API_KEY_PREFIX):], "API key") for k in offered
               if k.startswith(API_KEY_PREFIX) and k not in keys]
    if isinstance(body, dict):
        for where in (body, body.get("metadata")):
            if isinstance(where, dict):
                claims += [(str(where[f]), f"body field {f}") for f in BODY_SESSION_FIELDS
                           if isinstance(where.get(f), (str, int)) and str(where[f])]
    return next((c for c in claims if c[0] != sid), None)


def _resolve_open(headers: Mapping[str, str], query: Mapping[str, str], proxy_auth: str | None,
                  connection_id: str | None) -> Session:
    """The precedence of the module docstring, for a request without an issued key."""
    for h in SESSION_HEADERS:
        if headers.get(h):
            return _checked(headers[h], "header", h)
    user = basic_user(proxy_auth)
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
