"""The exchange of one model call: from the harness's request to the upstream and back.

``model_call`` reads the request (body, provider, session), builds the call's record, translates
the request to chat (the provider's translator), waits at the pause gate, then ``exchange`` performs
the upstream call itself (aiohttp, not mitmproxy) so that refused connections, 5xx, 429 and
timeouts become errors in the harness's own shape: it picks an upstream (sticky per session), asks
it what it serves, ``prepare``s the chat request (served model, max_tokens within the context,
streaming options, the engine's token fields) and posts it, trying the next upstream while
connections are refused. Non-streaming and ``synthetic`` answers are translated and set on the
flow right here; a true stream goes to ``streaming`` (the relay, or at once when it has wholly
arrived). Status errors from the upstream are mapped to the provider's error kinds
(``upstream_status_error``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import aiohttp
import orjson
from mitmproxy import http

from polar_core.schema import CallRecord
from polar_proxy import jsonutil

from . import budget, sampling
from .accumulate import synthetic_chunks
from .calls import Call, answer_error, fail, finalize, guess_provider, is_context_error
from .flows import harness_url
from .httputil import header_dict, make_response, scrub
from .providers import detect_provider, media
from .providers.base import NormalizedCall, ProviderError
from .sessions import SessionError, harness_name, resolve_session, scrub_query_string
from .side_calls import provider_side_call, side_call
from .state import ProxyState
from .streaming import answer_finished_stream, to_relay
from .upstreams import SESSION_MOVED, Upstream, model_info

log = logging.getLogger("polar")


async def model_call(s: ProxyState, flow: http.HTTPFlow) -> None:
    """An intercepted request that is not for the control API: a side call, or a model call."""
    t_in = time.time()
    req = flow.request
    headers = header_dict(req.headers)
    query = dict(req.query.items(multi=False)) if "?" in req.path else {}
    native_path = scrub_query_string(req.path)
    path_only = req.path.split("?", 1)[0]
    scrub(flow)

    try:  # no content-encoding (nearly always): the bytes as they are, without get_content's header lookups
        raw = (req.get_content(strict=False) if "content-encoding" in headers else req.raw_content) or b""
    except ValueError:
        raw = req.raw_content or b""
    body: Any = None
    body_error = None
    if raw:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            body_error = f"malformed JSON body: {exc}"

    if await side_call(s, flow, req.method, path_only, headers):
        return
    provider = None
    if body_error is None:
        try:
            provider = detect_provider(req.method, path_only, headers, body)
        except Exception as exc:  # a translator bug must not take the proxy down
            log.warning(f"polar: provider detection failed: {exc!r}")
    if provider is None and body_error is not None:
        provider = guess_provider(path_only, headers)
    if provider is not None and body_error is None and provider.side_call(req.method, path_only):
        await provider_side_call(s, flow, provider, provider.side_call(req.method, path_only), body,
                                 path_only, query)
        return

    try:
        session = resolve_session(headers, query, proxy_auth=s.conn_proxy_auth.get(flow.client_conn.id),
                                  connection_id=flow.client_conn.id, keys=s.session_keys, bound=s.key_of,
                                  body=body, require_key=s.require_session_key)
    except SessionError as exc:
        s.stats["errors"] += 1
        if exc.status == 403:
            s.stats["session_refused"] += 1  # spoke for a session not its own: nothing written
        answer_error(flow, provider or guess_provider(path_only, headers), exc.status, exc.kind, exc.message)
        flow.metadata["polar"] = {"error": "invalid_session" if exc.status != 403 else "session_refused"}
        return

    if provider is None:
        s.stats["errors"] += 1
        guess = guess_provider(path_only, headers)
        answer_error(flow, guess, 404, "not_found", f"polar: no model API at {req.method} {path_only}")
        flow.metadata["polar"] = {"error": "not_found", "session": session.id}
        return

    sid = session.id
    rec = CallRecord(
        call_id=os.urandom(16).hex(),
        session_id=sid,
        session_source=session.source,
        call_index=s.next_call_index(sid),
        provider=provider.name,
        engine=s.engine.name,
        harness=harness_name(headers),
        user_agent=headers.get("user-agent", ""),
        policy_version=s.policy_version,
        native_path=native_path,
        native_request=(jsonutil.raw_json(raw, body) or body) if isinstance(body, dict) else None,
        stream_mode=s.stream_mode,
        t_request_in=t_in,
        proxy_id=s.proxy_id,
    )
    reg = s.registry.get(sid) or {}
    if reg.get("harness") and not headers.get("x-polar-harness"):
        rec.harness = reg["harness"]  # the runner knows; the user agent may only name an SDK
    if session.source == "key":  # a bound session: its labels are the runner's, never the sample's
        headers = {}
    rec.task_id = headers.get("x-polar-task") or reg.get("task_id")
    rec.group_id = headers.get("x-polar-group") or reg.get("group_id")
    sample = headers.get("x-polar-sample", reg.get("sample_index"))
    try:
        rec.sample_index = int(sample) if sample is not None else None
    except ValueError:
        rec.sample_index = None
    call = Call(rec, provider, flow)
    call.native_size = len(raw)
    s.stats["calls"] += 1
    flow.metadata["polar"] = {"session": sid, "provider": provider.name, "call_index": rec.call_index,
                              "call_id": rec.call_id, "native_url": harness_url(flow, native_path)}

    if body_error is not None:
        fail(s, call, 400, "invalid_request", body_error)
        return
    try:
        normalized = provider.to_chat(body, path_only, query)
    except ProviderError as exc:
        fail(s, call, exc.status, exc.kind, exc.message)
        return
    except Exception as exc:  # translator bug: answer, record, keep serving
        log.warning(f"polar: {provider.name}.to_chat failed: {exc!r}")
        fail(s, call, 400, "invalid_request", f"could not translate request: {exc}")
        return
    media.settle(normalized, s.media_mode)  # images: placeholders for a text-only model
    call.normalized = normalized
    rec.requested_model = normalized.requested_model or ""
    rec.stream = bool(normalized.stream)
    rec.translation_notes = list(normalized.notes)

    if not await s.gate.wait_open(s.pause_timeout):
        fail(s, call, 503, "overloaded", "proxy paused (weights update) longer than polar_pause_timeout")
        return
    rec.policy_version = s.policy_version  # the weights that will serve it (after the gate)
    s.calls[flow.id] = call
    s.gate.call_started()
    try:
        await exchange(s, call, normalized)
    except Exception as exc:  # keep serving whatever happens in one call
        log.exception("polar: call failed")
        if not call.finalized and flow.response is None and call.relay_restore is None:
            if call.ticket is not None:  # failed before the flow was pointed at the relay
                s.tickets.pop(call.ticket, None)
                call.ticket = None
            fail(s, call, 502, "upstream_error", f"proxy error: {exc!r}")


def prepare(s: ProxyState, call: Call, normalized: NormalizedCall, up: Upstream, stream_upstream: bool) -> dict[str, Any]:
    """The chat request for ``up``: its served model, the output budget (budget.py), stream options."""
    chat = dict(normalized.chat_request)
    chat["model"] = up.served_model
    requested = chat.pop("max_completion_tokens", None)
    requested = chat.pop("max_tokens", None) or requested
    # No guess at the prompt length: the engine knows it (see budget.py).
    call.max_tokens_sent = budget.output_budget(requested, s.max_tokens_cap, up.max_model_len)
    if call.max_tokens_sent is not None:
        chat["max_tokens"] = call.max_tokens_sent
    if s.sampling:
        sampling.apply(chat, s.sampling, call.record.session_id, call.record.call_index)
    call.record.sampling = sampling.effective(chat, up.sampling_server, s.sampling)
    if stream_upstream:
        chat["stream"] = True
        chat["stream_options"] = {**(chat.get("stream_options") or {}), "include_usage": True}
    else:
        chat["stream"] = False
        chat.pop("stream_options", None)
    s.engine.prepare(chat)
    return chat


async def exchange(s: ProxyState, call: Call, normalized: NormalizedCall) -> None:
    """Post the call to an upstream (the next one while connections are refused) and answer it."""
    rec = call.record
    if s.pool is None or s.http is None:
        fail(s, call, 502, "upstream_refused", "polar: no upstream configured (polar_upstream)")
        return
    stream_upstream = rec.stream and s.stream_mode == "passthrough"
    tried: set[str] = set()
    resp: aiohttp.ClientResponse | None = None
    last_error = "no upstream"
    moved = None  # the server this session was pinned to, when it had to leave it
    while len(tried) < len(s.pool.upstreams):
        up = s.pool.pick(rec.session_id, exclude=tried)
        moved = moved or s.pool.moved_from
        tried.add(up.url)
        try:
            await model_info(s.http, up, s.served_model, s.client_timeout())
        except asyncio.TimeoutError:
            s.pool.mark_failed(up, "timeout on /v1/models")
            last_error = f"upstream {up.url} did not answer /v1/models within {s.timeout:g}s"
            continue
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            s.pool.mark_failed(up, str(exc))
            how = "refused the connection" if isinstance(exc, aiohttp.ClientConnectorError) else "failed"
            last_error = f"upstream {up.url} {how}: {exc}"
            continue
        chat = prepare(s, call, normalized, up, stream_upstream)
        upstream_body = jsonutil.dumps(chat)
        rec.normalized_request = jsonutil.raw_json(upstream_body, chat) or chat  # written as sent
        rec.served_model = up.served_model or ""
        rec.upstream = up.url
        call.upstream = up
        s.pool.acquire(up)
        rec.t_upstream_sent = time.time()
        try:
            if s.exact is not None:  # render, splice, generate, derender (exact_history.py)
                resp = await s.exact.post(up.url, chat, rec, stream=stream_upstream, max_model_len=up.max_model_len,
                                          timeout=s.client_timeout(), headers={"x-polar-session": rec.session_id})
                if resp is not None:
                    break
            resp = await post_chat(s, call, up.url, upstream_body, stream_upstream)
            break
        except asyncio.TimeoutError:
            s.pool.mark_failed(up, "timeout")
            fail(s, call, 504, "timeout", f"upstream {up.url} did not answer within {s.timeout:g}s")
            return
        except aiohttp.ClientConnectorError as exc:  # refused: nothing ran, try another server
            s.pool.release(up)
            call.upstream = None
            s.pool.mark_failed(up, str(exc))
            last_error = f"upstream {up.url} refused the connection: {exc.os_error or exc}"
            continue
        except (aiohttp.ClientError, OSError) as exc:
            s.pool.mark_failed(up, str(exc))
            fail(s, call, 502, "upstream_refused", f"upstream {up.url} failed: {exc}")
            return
    if resp is None:
        fail(s, call, 502, "upstream_refused", last_error)
        return
    if moved is not None and moved is not call.upstream and rec.call_index:  # a first call had no cache there
        s.stats["session_moves"] += 1
        rec.translation_notes.append(f"{SESSION_MOVED} from {moved.url} ({moved.last_error or 'out'}) to {up.url}: "
                                     "its prefix cache there is lost")
    if call.finalized:  # the harness hung up while the upstream was working
        resp.close()
        return
    rec.t_upstream_first_byte = time.time()
    up = call.upstream
    assert up is not None
    if resp.status == 400 and call.max_tokens_sent is not None:
        resp = await budget_retry(s, call, resp, chat, stream_upstream)
        if resp is None:
            return
    if resp.status != 200:
        await upstream_status_error(s, call, resp)
        return
    s.pool.mark_ok(up)
    if stream_upstream:
        call.translator = call.provider.new_stream(rec.requested_model, call.normalized)
        s.stats["streamed"] += 1
        if s.stream_at_once and resp.content.is_eof():
            answer_finished_stream(s, call, resp)
            return
        call.upstream_response = resp
        call.ticket = os.urandom(16).hex()
        s.tickets[call.ticket] = call
        to_relay(s, call)
        return
    try:
        raw = await resp.read()
    except asyncio.TimeoutError:
        s.pool.mark_failed(up, "timeout")
        fail(s, call, 504, "timeout", f"upstream {up.url} stalled for {s.timeout:g}s")
        return
    except (aiohttp.ClientError, OSError) as exc:
        s.pool.mark_failed(up, str(exc))
        fail(s, call, 502, "upstream_error", f"upstream {up.url} broke the answer: {exc}")
        return
    finally:
        resp.release()
    if call.finalized:  # the harness hung up meanwhile: its record is written
        return
    rec.t_upstream_end = time.time()
    try:
        answer = s.engine.parse(raw, call.tokens)
    except orjson.JSONDecodeError:
        fail(s, call, 502, "upstream_error", f"upstream sent malformed JSON: {raw[:200]!r}")
        return
    s.engine.read_response(answer, call.tokens)
    budget.mark_cut(call, answer)
    call.acc.feed_whole(answer)
    try:
        if rec.stream:  # synthetic stream mode
            translator = call.provider.new_stream(rec.requested_model, call.normalized)
            out = b"".join(translator.feed(c) for c in synthetic_chunks(answer)) + translator.finish()
            content, ctype = out, "text/event-stream"
        else:
            native = call.provider.from_chat(answer, rec.requested_model, call.normalized)
            content, ctype = jsonutil.dumps(native), "application/json"
    except Exception as exc:
        log.warning(f"polar: {call.provider.name} answer translation failed: {exc!r}")
        fail(s, call, 502, "upstream_error", f"could not translate the answer: {exc}")
        return
    rec.http_status = 200
    finalize(s, call)
    headers = {"content-type": ctype}
    if ctype == "text/event-stream":
        headers["cache-control"] = "no-cache"
    call.flow.response = make_response(200, content, headers)


async def post_chat(s: ProxyState, call: Call, base_url: str, body: bytes,
                    stream_upstream: bool) -> aiohttp.ClientResponse:
    """POST the chat request; once more on a fresh connection when the server closed the one
    taken from the pool before answering anything (``ServerDisconnectedError``). The race is an
    idle keep-alive connection the server closes as it is reused (addon.UPSTREAM_KEEPALIVE_S
    makes it rare with vLLM, other servers keep connections for less): nothing was sampled, so
    the request is sent again, and the record notes it."""
    assert s.http is not None
    rec = call.record
    headers = {"content-type": "application/json", "x-polar-session": rec.session_id,
               "x-request-id": rec.call_id,
               "accept": "text/event-stream" if stream_upstream else "application/json"}
    url = base_url + "/v1/chat/completions"
    try:
        return await s.http.post(url, data=body, headers=headers, timeout=s.client_timeout())
    except aiohttp.ServerDisconnectedError as exc:
        rec.translation_notes.append(f"sent again on a fresh connection: the server closed the first ({exc})")
        log.info(f"polar: {base_url} closed a connection before answering; sending the call again")
        return await s.http.post(url, data=body, headers=headers, timeout=s.client_timeout())


async def budget_retry(s: ProxyState, call: Call, resp: aiohttp.ClientResponse, chat: dict[str, Any],
                       stream_upstream: bool) -> aiohttp.ClientResponse | None:
    """An engine that refuses a ``max_tokens`` above the room its real prompt leaves (older
    vLLM) says how long the prompt is: ask once more with exactly that room."""
    raw = await _read_quietly(resp)
    room = budget.room_from_error(_error_message(raw))
    up = call.upstream
    if room is None or call.finalized or s.http is None or up is None:
        if not call.finalized:
            await upstream_status_error(s, call, resp, raw)
        return None
    rec = call.record
    chat["max_tokens"] = call.max_tokens_sent = room[0]
    rec.translation_notes.append(f"max_tokens lowered to the {room[0]} tokens the {room[1]}-token prompt leaves")
    body = jsonutil.dumps(chat)
    rec.normalized_request = jsonutil.raw_json(body, chat) or chat
    try:
        return await post_chat(s, call, up.url, body, stream_upstream)
    except asyncio.TimeoutError:
        fail(s, call, 504, "timeout", f"upstream {up.url} did not answer within {s.timeout:g}s")
    except (aiohttp.ClientError, OSError) as exc:
        fail(s, call, 502, "upstream_refused", f"upstream {up.url} failed: {exc}")
    return None


async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes:
    """An error answer's body (empty if it cannot be read); the connection is released."""
    try:
        return await resp.read()
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
        return b""
    finally:
        resp.release()


def _error_message(raw: bytes) -> str:
    try:
        err = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return raw.decode("utf-8", "replace")
    if isinstance(err, dict):
        return str(err.get("message") or "")
    return err if isinstance(err, str) else raw.decode("utf-8", "replace")


async def upstream_status_error(s: ProxyState, call: Call, resp: aiohttp.ClientResponse,
                                raw: bytes | None = None) -> None:
    """A non-200 answer from the upstream, as the error kind and status the harness understands."""
    up = call.upstream
    assert up is not None
    if raw is None:
        raw = await _read_quietly(resp)
    message = raw.decode("utf-8", "replace")[:2000]
    try:
        err = orjson.loads(raw).get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or message)
        elif isinstance(err, str):
            message = err
    except (orjson.JSONDecodeError, AttributeError):
        pass
    extra: dict[str, str] = {}
    if resp.status == 429:
        kind, status = "rate_limited", 429
        if resp.headers.get("retry-after"):
            extra["retry-after"] = resp.headers["retry-after"]
    elif resp.status >= 500:
        if s.pool is not None:
            s.pool.mark_failed(up, f"HTTP {resp.status}")
        kind, status = "upstream_error", resp.status if resp.status in (500, 502, 503, 504) else 502
    elif resp.status in (400, 413, 422) and is_context_error(message):
        kind, status = "context_length", 400
    elif resp.status in (400, 422):
        kind, status = "invalid_request", 400
    elif resp.status == 404:
        kind, status = "upstream_error", 502
        up.served_model = None  # the served model may have changed: ask again next time
    else:
        kind, status = "upstream_error", 502
    fail(s, call, status, kind, f"upstream answered {resp.status}: {message}", extra_headers=extra)
