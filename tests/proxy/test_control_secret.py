"""The control secret is settled at ``configure``, before the listener accepts anything.

mitmproxy starts accepting connections before the addon's ``running`` hook. When the secret was
settled in ``running``, a control request in that window (a runner's readiness probe) was refused
401 "for want of a secret": seen once in the unit suite under load, never on a quiet machine. These
tests make the window deterministic: the addon is configured and never reaches ``running``.
"""

from __future__ import annotations

import asyncio

import orjson
from mitmproxy.test import taddons, tflow, tutils

from polar_core.control import TOKEN_ENV
from polar_proxy import control
from polar_proxy.addon import Polar


def _status_flow(token: str | None) -> tflow.HTTPFlow:
    flow = tflow.tflow(req=tutils.treq(host="127.0.0.1", port=8080, path="/_polar/status", method=b"GET",
                                       content=b""))
    flow.client_conn.peername = ("127.0.0.1", 40000)
    if token is not None:
        flow.request.headers["authorization"] = f"Bearer {token}"
    return flow


def _ask(addon: Polar, token: str | None) -> int:
    flow = _status_flow(token)
    asyncio.run(addon.request(flow))
    assert flow.response is not None
    return flow.response.status_code


def test_runner_secret_is_honoured_before_running(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "runner-secret")
    addon = Polar()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_capture_dir=str(tmp_path))
        # no ``running`` yet: the listener may already accept, and the probe must get through
        assert _ask(addon, "runner-secret") == 200
        assert _ask(addon, "wrong") == 401
        assert _ask(addon, None) == 401


def test_a_fresh_secret_is_settled_once_and_published_unchanged(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    addon = Polar()
    with taddons.context(addon) as tctx:
        token_file = tmp_path / "token"
        tctx.configure(addon, polar_capture_dir=str(tmp_path / "c"), polar_control_token_file=str(token_file))
        settled = addon.state.control_token
        assert settled and len(settled) >= 32
        assert _ask(addon, settled) == 200
        tctx.configure(addon, polar_pause=False)  # a later configure keeps the secret
        assert addon.state.control_token == settled
        control.publish_token(addon.state, tctx.options)  # what ``running`` does
        assert token_file.read_text().strip() == settled


def test_an_explicit_option_wins_over_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    addon = Polar()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_capture_dir=str(tmp_path), polar_control_token="from-option")
        assert _ask(addon, "from-option") == 200
        assert _ask(addon, "from-env") == 401
        body = orjson.loads(_status_body(addon, "from-option"))
        assert "paused" in body


def _status_body(addon: Polar, token: str) -> bytes:
    flow = _status_flow(token)
    asyncio.run(addon.request(flow))
    assert flow.response is not None
    return flow.response.content or b""
