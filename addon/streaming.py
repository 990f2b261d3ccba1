"""Streamed answers: the loopback relay, SSE framing, and streams that arrived whole.

A true stream is not answered in the ``request`` hook: the flow is pointed at the loopback relay
(``to_relay``), which copies the upstream's SSE bytes as they come (``pump``); in
``responseheaders`` the addon installs ``SSEStream`` as ``flow.response.stream``, which frames
the chat SSE events (split anywhere across chunks), collects token ids and logprobs from every
chunk and hands each chunk to the provider's stream translator: the harness gets its own wire
format, token by token. When the whole stream has arrived before the proxy first looks (the proxy
is behind), it is translated and answered in one piece instead (``answer_finished_stream``,
``polar_stream_at_once``). The record is written when ``[DONE]`` or an error arrives, before the
closing bytes go out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import aiohttp
import orjson

from . import flows
from .budget import mark_cut
from .calls import Call, finalize, is_context_error
from .httputil import make_response
from .state import ProxyState
from .upstreams import RELAY_ERROR_EVENT, RELAY_TICKET_HEADER, relay_error_event

log = logging.getLogger("polar")

_RELAY_TICKET_HEADER_BYTES = RELAY_TICKET_HEADER.encode()


class SSEStream:
    """``flow.response.stream`` callable: upstream chat SSE bytes -> the provider's SSE bytes.

    Events may be split anywhere across chunks (even inside ``\\r\\n``), so bytes are buffered
    until a blank line ends an event. The capture record is written when ``[DONE]`` (or an error)
    arrives, before the closing bytes are returned to mitmproxy.

    With ``keep``, the bytes handed to the harness are also kept (up to ``polar_flow_body_limit``)
    and become the flow's response body when the stream ends: mitmproxy keeps no streamed body.
    """

    def __init__(self, state: ProxyState, call: Call, keep: bool = True):
        self.state = state
        self.call = call
        self.buf = bytearray()
        if keep and state.flow_body_limit > 0:
            call.body_kept = bytearray()

    def __call__(self, data: bytes) -> list[bytes]:
        # A list, never b"": mitmproxy would send an empty bytes chunk to an HTTP/1 client as
        # "0\r\n\r\n", the end of a chunked body, and the harness would stop reading.
        call = self.call
        if data:
            self.buf += data
            out = self._drain()
        else:
            out = self._drain(final=True)
            if not call.stream_done:
                call.stream_done = True
                out += stream_failed(self.state, call, "upstream_error", "upstream stream ended before [DONE]")
        kept = call.body_kept
        if kept is not None:
            call.body_sent += len(out)
            room = self.state.flow_body_limit - len(kept)
            if room > 0 and out:
                kept += out if len(out) <= room else out[:room]
            if not data:  # the end: the flow (saved right after this) shows what the harness got
                flows.keep_body(call.flow, kept, call.body_sent)
                call.body_kept = None
        return [out] if out else []

    def _drain(self, final: bool = False) -> bytes:
        # Scan from an offset and cut the consumed prefix once: deleting each event from the
        # front moved the rest of the buffer every time (quadratic on a 60 kB first chunk).
        out = bytearray()
        buf = self.buf
        pos = 0
        while True:
            end, sep_len = _event_end(buf, pos)
            if end < 0:
                break
            out += self._event(bytes(buf[pos:end]))
            pos = end + sep_len
        if pos:
            del buf[:pos]
        if final and buf.strip():
            event = bytes(buf)
            buf.clear()
            out += self._event(event)
        return bytes(out)

    def _event(self, event: bytes) -> bytes:
        call = self.call
        if call.stream_done:
            return b""
        name = b""
        if event.startswith(b"data:") and b"\n" not in event:  # the usual event: one data line
            payload = event[5:].lstrip(b" ").rstrip(b"\r")
        else:
            data_lines = []
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    data_lines.append(line[5:].lstrip(b" "))
                elif line.startswith(b"event:"):
                    name = line[6:].strip()
            if not data_lines:
                return b""
            payload = b"\n".join(data_lines)
        if name == RELAY_ERROR_EVENT:
            info = orjson.loads(payload)
            call.stream_done = True
            return stream_failed(self.state, call, info.get("kind", "upstream_error"), info.get("message", ""))
        if payload[:1] != b"{" and payload.strip() == b"[DONE]":
            call.stream_done = True
            return stream_finished(self.state, call)
        engine = self.state.engine
        try:
            chunk = engine.parse(payload, call.tokens)
        except orjson.JSONDecodeError:
            call.stream_done = True
            return stream_failed(self.state, call, "upstream_error", f"malformed upstream chunk: {payload[:200]!r}")
        if "error" in chunk and not chunk.get("choices"):
            err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            call.stream_done = True
            msg = str(err.get("message", "upstream error"))
            return stream_failed(self.state, call, "context_length" if is_context_error(msg) else "upstream_error", msg)
        engine.read_chunk(chunk, call.tokens)  # ids first: kept even if translation fails
        mark_cut(call, chunk)
        try:
            call.acc.feed_chunk(chunk)
            assert call.translator is not None
            return call.translator.feed(chunk)
        except Exception as exc:  # a translator bug must end this stream cleanly, not the proxy
            log.warning(f"polar: {call.provider.name} stream translation failed: {exc!r}")
            call.stream_done = True
            return stream_failed(self.state, call, "upstream_error", f"could not translate the stream: {exc}")


def _event_end(buf: bytearray, start: int = 0) -> tuple[int, int]:
    """Where the first event at or after ``start`` ends, and the length of the blank line after it
    (``\\n\\n``, ``\\r\\n\\r\\n`` or a mix); ``(-1, 0)`` while the event is incomplete.

    Looks for single ``\\n`` bytes (a memchr): a two-byte search is ~50x slower, and a first
    chunk carrying a 10k-token prompt's ids is 60 kB without one line break."""
    n = len(buf)
    i = buf.find(b"\n", start)
    while i >= 0:
        j = i + 1
        if j < n and buf[j] == 13:  # \r
            j += 1
        if j >= n:
            return -1, 0
        if buf[j] == 10:  # \n: a blank line
            end = i - 1 if i > start and buf[i - 1] == 13 else i
            return end, j + 1 - end
        i = buf.find(b"\n", j)
    return -1, 0


# -- stream endings (called from SSEStream, inside mitmproxy's layer) ------------------------------

def stream_finished(s: ProxyState, call: Call) -> bytes:
    assert call.translator is not None
    try:
        out = call.translator.finish()
    except Exception as exc:
        log.warning(f"polar: stream finish failed: {exc!r}")
        return stream_failed(s, call, "upstream_error", f"could not translate the end of the stream: {exc}")
    call.record.http_status = 200
    if call.record.t_upstream_end is None:  # [DONE] read before the relay saw the body end
        call.record.t_upstream_end = time.time()
    finalize(s, call)
    return out


def stream_failed(s: ProxyState, call: Call, kind: str, message: str) -> bytes:
    rec = call.record
    rec.status, rec.error_kind, rec.error = "error", kind, message
    rec.http_status = 200  # headers were already sent
    try:
        out = call.translator.fail(kind, message) if call.translator else b""
    except Exception as exc:
        log.warning(f"polar: stream fail translation failed: {exc!r}")
        out = b""
    s.stats["errors"] += 1
    finalize(s, call)
    return out


# -- a stream that has wholly arrived --------------------------------------------------------------

def answer_finished_stream(s: ProxyState, call: Call, resp: aiohttp.ClientResponse) -> None:
    """The whole stream had arrived before the proxy got to it (it is behind: a loaded proxy,
    a short answer): translate it at once and answer in one piece. Nothing is held back that
    could have gone out earlier, and the relay hop is saved when the proxy needs it most."""
    try:
        data = resp.content.read_nowait(-1)
    except (aiohttp.ClientError, OSError) as exc:  # the body broke: what arrived, then the error
        data = _salvage(resp.content) + relay_error_event("upstream_error", f"upstream stream broken: {exc}")
    finally:
        resp.release()
    call.record.t_upstream_end = time.time()
    s.stats["streamed_at_once"] += 1
    translate = SSEStream(s, call, keep=False)  # the whole answer becomes the body anyway
    out = b"".join(translate(data)) + b"".join(translate(b""))
    if 0 < s.flow_body_limit < len(out):
        # a body set here is saved whole; the relay's stream keeps the first polar_flow_body_limit
        # bytes, as for every streamed answer (the hop costs < 1 ms)
        relay_translated(s, call, out)
        return
    call.flow.response = make_response(200, out, {"content-type": "text/event-stream", "cache-control": "no-cache"})
    flows.note_body(call.flow, len(out), len(out))


def relay_translated(s: ProxyState, call: Call, out: bytes) -> None:
    """Send ``out`` (the harness's bytes, already translated and recorded) through the relay."""
    from .exact_stream import ExactResponse  # the relay reads it as it reads aiohttp's response

    call.upstream_response = ExactResponse(200, out)
    call.translated = True
    call.ticket = os.urandom(16).hex()
    s.tickets[call.ticket] = call
    s.relayed_whole[call.flow.id] = call  # finalized: no longer among the calls in flight
    to_relay(s, call)


class KeptStream:
    """``flow.response.stream`` for bytes already translated: passed on, the first
    ``polar_flow_body_limit`` of them kept as the flow's response body."""

    def __init__(self, state: ProxyState, call: Call):
        self.state, self.call = state, call
        call.body_kept = bytearray()

    def __call__(self, data: bytes) -> list[bytes]:
        call, kept = self.call, self.call.body_kept
        if kept is not None:
            call.body_sent += len(data)
            kept += data[: max(0, self.state.flow_body_limit - len(kept))]
            if not data:
                flows.keep_body(call.flow, kept, call.body_sent)
                call.body_kept = None
        return [data] if data else []


# -- the loopback relay ------------------------------------------------------------------------------

def to_relay(s: ProxyState, call: Call) -> None:
    """Point the flow at the loopback relay, which serves this call's upstream stream.

    The relay needs only the ticket, so the body is not sent again (a harness request can be
    80 kB); ``responseheaders`` puts the harness's own request back for saved flows."""
    assert s.relay is not None and call.ticket is not None
    data = call.flow.request.data
    restore = (data.scheme, data.host, data.port, data.content, data.headers.fields)
    data.scheme, data.host, data.port = b"http", "127.0.0.1", s.relay.port
    data.content = b""
    # Only what the relay reads: mitmproxy assembles and the relay parses a short head.
    data.headers.fields = ((b"host", b"127.0.0.1"), (b"content-length", b"0"),
                           (_RELAY_TICKET_HEADER_BYTES, call.ticket.encode()))
    call.relay_restore = restore


async def pump(s: ProxyState, ticket: str, write: Any) -> bool:
    """Relay side: copy the upstream's SSE bytes; on stall or break, end with an error event.

    ``write(data, end)`` sends the relay's response head with the first write and the chunked
    terminator with ``end``: what is already buffered goes to mitmproxy as one piece (one read
    and one pass through its layers instead of three)."""
    call = s.tickets.pop(ticket, None)
    if call is None or call.upstream_response is None:
        await write(relay_error_event("upstream_error", "polar: unknown relay ticket"), True)
        return True
    resp = call.upstream_response
    content = resp.content
    error: bytes | None = None
    try:
        try:
            data = content.read_nowait(-1)  # usually the whole answer under load
        except (aiohttp.ClientError, OSError, RuntimeError):
            data = b""  # readany below raises it again, with the salvage logic
        end = bool(data) and content.at_eof()
        if end:  # set before the bytes go out: the record is written when mitmproxy reads [DONE]
            call.record.t_upstream_end = time.time()
        await write(data, end)  # the head goes out now, whatever the upstream has sent so far
        while not end:
            try:
                data = await content.readany()
            except asyncio.TimeoutError:
                if s.pool and call.upstream and not call.cancelled:
                    s.pool.mark_failed(call.upstream, "stream stalled")
                error = relay_error_event("timeout", f"upstream stalled for {s.timeout:g}s mid-stream")
                break
            except (aiohttp.ClientError, OSError) as exc:
                if call.cancelled:
                    return False
                rest = _salvage(content)
                if rest:  # bytes that arrived together with the break: never drop sampled tokens
                    await write(rest)
                if s.pool and call.upstream:
                    s.pool.mark_failed(call.upstream, f"stream broken: {exc}")
                error = relay_error_event("upstream_error", f"upstream stream broken: {exc}")
                break
            end = not data or content.at_eof()
            if end:
                call.record.t_upstream_end = time.time()
            await write(data, end)
        if call.record.t_upstream_end is None:
            call.record.t_upstream_end = time.time()
        if error is not None:
            await write(error, True)
        return True
    except (ConnectionError, RuntimeError):
        return False  # the harness side is gone; closing resp aborts the generation
    finally:
        resp.close()
        call.upstream_response = None


def _salvage(reader: aiohttp.StreamReader) -> bytes:
    """Bytes aiohttp had received when the connection broke: its ``readany`` raises the stored
    exception before returning buffered data, so read the buffer directly (private API, guarded)."""
    try:
        if getattr(reader, "_buffer", None):
            return reader._read_nowait(-1)
    except Exception:  # noqa: BLE001 - best effort on an aiohttp internal
        pass
    return b""
