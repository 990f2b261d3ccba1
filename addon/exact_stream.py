"""Exact history's answer to the addon: generate's output as if vLLM's chat endpoint had answered
(a chat.completion, or chat SSE chunks with ``prompt_token_ids`` and per-chunk ``token_ids`` and
logprobs), so the provider translators, the relay and the capture path stay unchanged.

The stream view (``stream_view``): streaming stays true streaming without the streaming derender
(which replays the parser from the start on every chunk). Text deltas come from the engine's
detokenizer and are split here. Reasoning goes out as ``reasoning`` deltas: from the start when the
prompt itself opened a think block, or after a ``<think>`` the model wrote first; text that may
still turn out to be reasoning is never sent as answer. Answer text is forwarded while it cannot be
part of a tool call or markup; the rest is held back and the whole answer is derendered once at
the end, whose remaining reasoning, content and tool calls close the stream. Should the parser
disagree with what was already streamed, a field nothing was streamed of is sent whole, a field
already streamed gets the rest of the engine's own text (never the derendered text again after
it), and the call is not offered for splicing (the harness holds other text than its ids).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

from . import jsonutil
from .exact_template import DERENDER_PATH, ExactError

#: markup after which streamed text is held back until the whole answer is derendered
HOLD_MARKERS = ("<tool_call>", "<think>", "</think>", "<|")
#: prompt ids sent along with a derender (it seeds detokenization and the parsers from the tail)
DERENDER_PROMPT_TAIL = 64
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: the label of a record whose ids were sampled by other weights than its policy_version
WEIGHT_VERSION_MISMATCH = "weight_version_mismatch"


class FeedReader:
    """The part of ``aiohttp.StreamReader`` the addon's relay reads, fed by a producer task."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def feed(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        self._exc = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def is_eof(self) -> bool:
        return self._eof and not self._chunks

    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    def read_nowait(self, n: int = -1) -> bytes:
        out = b"".join(self._chunks)
        self._chunks.clear()
        return out

    async def readany(self) -> bytes:
        """Buffered bytes; at the end b""; a failure (timeout, broken upstream) raises once the
        bytes before it were read, as aiohttp's reader does."""
        while not self._chunks and not self._eof and self._exc is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if not self._chunks and self._exc is not None:
            raise self._exc
        return self.read_nowait()

class ExactResponse:
    """What the addon's exchange reads from ``aiohttp.ClientResponse``."""

    def __init__(self, status: int, body: bytes = b"", *, stream: bool = False, task: asyncio.Task | None = None):
        self.status = status
        self.headers: dict[str, str] = {"content-type": "text/event-stream" if stream else "application/json"}
        self.content = FeedReader()
        self._body = body
        self.task = task
        if not stream:
            self.content.feed(body)
            self.content.feed_eof()

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        pass

    def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

class _Ctx:
    """One call's generate/derender state."""

    def __init__(self, owner: Any, base_url: str, chat: dict[str, Any], rec: Any, ids: list[int],
                 timeout: Any, headers: dict[str, str]):
        self.owner, self.base_url, self.chat, self.rec, self.ids = owner, base_url, chat, rec, ids
        self.timeout, self.headers = timeout, headers
        self.created = int(time.time())
        self.id = f"chatcmpl-{rec.call_id}"

    async def derender(self, sampled: list[int], finish: str | None, stop_reason: Any) -> dict[str, Any]:
        """The chat message for the sampled ids, through the server's tool and reasoning parsers."""
        ids = list(sampled)
        if finish == "stop" and not isinstance(stop_reason, str) and ids:
            ids = ids[:-1]  # the stop token: the engine's detokenizer leaves it out of the text
        if not ids:
            return {"role": "assistant", "content": ""}
        body = {
            "model": self.chat.get("model"),
            "generate_response": {"request_id": self.id, "choices": [
                {"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": stop_reason}],
                "prompt_token_ids": self.ids[-DERENDER_PROMPT_TAIL:]},
            "prompt_token_ids": self.ids[-DERENDER_PROMPT_TAIL:],
            "chat_request": {**self.chat, "stream": False, "stream_options": None},
        }
        t0 = time.perf_counter()
        out = await self.owner._call(self.base_url + DERENDER_PATH, body, self.timeout, self.headers)
        self.owner.stats["derender_ms"] += (time.perf_counter() - t0) * 1000
        choice = (out.get("choices") or [{}])[0]
        return choice.get("message") or {"role": "assistant", "content": ""}

    def _lp(self, lp: Any) -> Any:
        """Generate's logprobs in the chat shape: as many top_logprobs as the request asked for
        (generate always lists the sampled token among them)."""
        if not lp or not lp.get("content"):
            return lp
        k = int(self.chat.get("top_logprobs") or 0)
        for e in lp["content"]:
            tops = e.get("top_logprobs")
            if tops is not None and len(tops) > k:
                e["top_logprobs"] = tops[:k]
        return lp

    def _finish(self, message: dict[str, Any], finish: str | None) -> str | None:
        if message.get("tool_calls") and finish == "stop":
            return "tool_calls"  # as vLLM's chat endpoint reports an answer with tool calls
        return finish

    def check_versions(self, spans: list[Any]) -> None:
        """Generate's ``weight_versions`` (which weights sampled which output ids) against the
        policy_version the call was admitted under: a mismatch is labelled on the record and counted."""
        expected = getattr(self.rec, "policy_version", None)
        versions = sorted({str(s.get("version")) for s in spans if isinstance(s, dict) and s.get("version") is not None})
        if expected is None or not versions or versions == [str(expected)]:
            return
        self.rec.translation_notes.append(f"{WEIGHT_VERSION_MISMATCH}: sampled by weights {', '.join(versions)}, "
                                          f"policy_version {expected}")
        stats = self.owner.stats
        stats["weight_version_mismatch"] = stats.get("weight_version_mismatch", 0) + 1

    def _note_stop(self, stop_reason: Any) -> None:
        self.rec.stop_reason = stop_reason  # recorded: the ledger reads it back after a restart
        if isinstance(stop_reason, str):  # a stop string: the sampled ids do not end the turn
            p = self.owner.pending.get(self.rec.call_id)
            if p is not None:
                p.stop_string = True

    async def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        choice = (answer.get("choices") or [{}])[0]
        sampled = choice.get("token_ids") or []
        finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        self._note_stop(stop_reason)
        self.check_versions(choice.get("weight_versions") or [])
        message = await self.derender(sampled, finish, stop_reason)
        message = {"role": "assistant", "content": message.get("content"),
                   "reasoning": message.get("reasoning") or message.get("reasoning_content"),
                   "tool_calls": message.get("tool_calls") or []}
        if not message["tool_calls"]:
            message.pop("tool_calls")
        n = len(sampled)
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.chat.get("model"),
            "choices": [{"index": 0, "message": message, "logprobs": self._lp(choice.get("logprobs")),
                         "finish_reason": self._finish(message, finish), "stop_reason": stop_reason,
                         "token_ids": sampled}],
            "usage": {"prompt_tokens": len(self.ids), "completion_tokens": n, "total_tokens": len(self.ids) + n},
            "prompt_token_ids": self.ids,
        }

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        d = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
             "model": self.chat.get("model"), "choices": choices, **extra}
        return b"data: " + jsonutil.dumps(d) + b"\n\n"

    def opened_think(self) -> bool:
        """Whether the answer starts inside a think block: the template opened it in the prompt, or
        the server's parser takes unmarked text as reasoning (then it is reasoning until ``</think>``)."""
        think = self.owner.think_ids.get(self.base_url)
        if not think:
            return False
        if self.owner.unmarked_reasoning.get(self.base_url):
            return True
        open_id, close_id = think
        tail = self.ids[-DERENDER_PROMPT_TAIL:]
        last_open = max((i for i, t in enumerate(tail) if t == open_id), default=-1)
        last_close = max((i for i, t in enumerate(tail) if t == close_id), default=-1)
        return last_open > last_close

    async def stream(self, resp: aiohttp.ClientResponse, out: FeedReader) -> None:
        """Generate SSE in, chat SSE out (see the module docstring for what is held back)."""
        tools = bool(self.chat.get("tools")) and self.chat.get("tool_choice") != "none"
        opened = self.opened_think()
        sampled: list[int] = []
        text = ""  # the engine's text so far
        sent_r = sent_c = ""  # reasoning and content already sent
        finish = stop_reason = None
        usage = None
        spans: list[Any] = []  # generate's weight_versions, chunk by chunk
        try:
            out.feed(self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}], prompt_token_ids=self.ids))
            buf = b""
            async for data in resp.content.iter_any():
                buf += data
                *events, buf = buf.split(b"\n\n")
                pieces = []
                for ev in events:
                    ev = ev.strip()
                    if not ev.startswith(b"data:"):
                        continue
                    payload = ev[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    obj = orjson.loads(payload)
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if "error" in obj and not obj.get("choices"):
                        pieces.append(b"data: " + payload + b"\n\n")
                        continue
                    for c in obj.get("choices") or ():
                        ids = c.get("token_ids") or []
                        sampled.extend(ids)
                        spans.extend(c.get("weight_versions") or ())
                        text += c.get("text") or ""
                        if c.get("finish_reason"):
                            finish, stop_reason = c["finish_reason"], c.get("stop_reason")
                        delta: dict[str, Any] = {}
                        r, content = stream_view(text, opened=opened, tools=tools)
                        if len(r) > len(sent_r) and r.startswith(sent_r):
                            delta["reasoning"] = r[len(sent_r):]
                            sent_r = r
                        if len(content) > len(sent_c) and content.startswith(sent_c):
                            delta["content"] = content[len(sent_c):]
                            sent_c = content
                        if ids or delta:
                            pieces.append(self._chunk([{"index": 0, "delta": delta, "logprobs": self._lp(c.get("logprobs")),
                                                        "finish_reason": None, "token_ids": ids}]))
                if pieces:
                    out.feed(b"".join(pieces))
            self._note_stop(stop_reason)
            self.check_versions(spans)
            message = await self.derender(sampled, finish, stop_reason)
            tail: list[bytes] = []
            delta = {}
            differs = []
            engine = dict(zip(("reasoning", "content"), stream_view(text, opened=opened, tools=tools, complete=True)))
            for key, done in (("reasoning", sent_r), ("content", sent_c)):
                rest, same = _rest(message.get(key) or (message.get("reasoning_content") if key == "reasoning" else "")
                                   or "", done, engine[key])
                if rest:
                    delta[key] = rest
                if not same:
                    differs.append(key)
            if differs:
                # the harness holds the engine's text for that field (what vLLM's own stream sends),
                # never the derendered text again after it; the record keeps what was sent, and these
                # ids are not offered for splicing since the harness holds other text
                self.rec.translation_notes.append(
                    f"exact history: streamed {' and '.join(differs)} differs from the derendered answer; "
                    "the engine's text delivered, not spliced later")
                p = self.owner.pending.get(self.rec.call_id)
                if p is not None:
                    p.delivered_differs = True
            if delta:
                tail.append(self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]))
            for i, tc in enumerate(message.get("tool_calls") or ()):
                fn = tc.get("function") or {}
                tail.append(self._chunk([{"index": 0, "delta": {"tool_calls": [
                    {"index": i, "id": tc.get("id"), "type": "function",
                     "function": {"name": fn.get("name"), "arguments": fn.get("arguments") or ""}}]},
                    "logprobs": None, "finish_reason": None}]))
            tail.append(self._chunk([{"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": self._finish(message, finish) or "stop",
                                      "stop_reason": stop_reason}]))
            n = len(sampled)
            tail.append(self._chunk([], usage=usage or {"prompt_tokens": len(self.ids), "completion_tokens": n,
                                                         "total_tokens": len(self.ids) + n}))
            tail.append(b"data: [DONE]\n\n")
            out.feed(b"".join(tail))
            out.feed_eof()
        except asyncio.CancelledError:
            raise
        except ExactError as exc:
            out.set_exception(aiohttp.ClientPayloadError(f"derender failed: HTTP {exc.status} "
                                                         f"{exc.body[:200].decode('utf-8', 'replace')}"))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            out.set_exception(exc if isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError))
                              else aiohttp.ClientPayloadError(str(exc)))
        finally:
            resp.close()

def stream_view(text: str, *, opened: bool, tools: bool, complete: bool = False) -> tuple[str, str]:
    """(reasoning, content) of the engine's text so far that may be streamed now. Each grows only by
    appending as text arrives; what might still change role (text that may be reasoning, a marker
    or tool call beginning, whitespace a parser may strip) is held back. ``opened``: the prompt
    ended inside a think block, so the text is reasoning until ``</think>``. ``complete``: the
    engine's text is all there is, so a tail that could have begun a marker is not held."""
    lead = text.lstrip()
    if THINK_OPEN.startswith(lead) and not (complete and lead):
        return "", ""  # nothing yet, or the start of "<think>": may become reasoning
    if lead.startswith(THINK_OPEN):
        body = lead[len(THINK_OPEN):]  # the model opened the block (parsers drop the marker)
    elif opened:
        body = text
    else:
        return "", _content_view(text, tools)
    end = body.find(THINK_CLOSE)
    if end < 0:
        return _trim(body if complete else body[: _cut(body, (THINK_CLOSE,))]), ""
    return _trim(body[:end]), _content_view(body[end + len(THINK_CLOSE):], tools, complete)


def _content_view(text: str, tools: bool, complete: bool = False) -> str:
    """Answer text that cannot become a tool call or markup: up to the first marker (or the start
    of one); nothing when tools are offered and the text starts like a JSON tool call."""
    if tools and text.lstrip()[:1] in ("{", "[", "`"):
        return ""
    return _trim(text[: min(_first_marker(text), len(text) if complete else _safe_len(text))])


def _first_marker(text: str) -> int:
    return min((i for i in (text.find(m) for m in HOLD_MARKERS) if i >= 0), default=len(text))


def _trim(text: str) -> str:
    """Trailing whitespace waits for what follows it (a parser may strip it before a marker)."""
    return text.rstrip()


def _cut(text: str, markers: tuple[str, ...]) -> int:
    cut = len(text)
    for m in markers:
        for j in range(len(m) - 1, 0, -1):
            if text.endswith(m[:j]):
                cut = min(cut, len(text) - j)
                break
    return cut


def _rest(final: str, sent: str, engine: str) -> tuple[str, bool]:
    """What of the derendered ``final`` text is still to send after ``sent`` (compared without the
    leading whitespace parsers differ on), and whether ``final`` continues what was sent.

    When it does not (a special token the engine's text leaves out, measured: tiny-r1 sampled
    ``<|video_pad|>`` mid-reasoning), the rest of the engine's own text for the field goes out,
    as vLLM's stream would have sent it: sending ``final`` whole after what was streamed gave the
    harness that reasoning twice (8,016 characters for 4,015). A field nothing was streamed of
    gets ``final`` whole."""
    if not sent:
        return final, True
    body, head = final.lstrip(), sent.lstrip()
    if body.startswith(head):
        return body[len(head):], True
    return (engine[len(sent):] if engine.startswith(sent) else ""), False


def _must_hold(text: str, tools: bool) -> bool:
    """Whether streamed text must stop here: it may become a tool call or reasoning markup."""
    stripped = text.lstrip()
    if tools and stripped[:1] in ("{", "[", "`"):  # a JSON tool call (or a fenced one) may start here
        return True
    return any(m in text for m in HOLD_MARKERS)


def _safe_len(text: str) -> int:
    """How much of ``text`` can go out: not a tail that could be the start of a marker."""
    cut = len(text)
    for m in HOLD_MARKERS:
        for j in range(len(m) - 1, 0, -1):
            if text.endswith(m[:j]):
                cut = min(cut, len(text) - j)
                break
    return cut
