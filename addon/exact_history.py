"""Exact-history mode (``polar_exact_history``): the model is prompted with its own sampled tokens.

A harness re-sends each answer as text and the chat template re-renders it to other ids, so from
the second turn on vLLM would be prompted with a history it never sampled. In this mode a call
goes through vLLM 0.32's token-in/token-out endpoints instead of ``/v1/chat/completions``
(vLLM must be started with ``--enable-scale-out``):

1. ``POST /v1/chat/completions/render`` on the whole conversation: the ids vLLM's own template
   renders and the sampling parameters vLLM would apply (generation-config defaults included);
2. the ledger (``ledger.py``) finds the earlier call whose history and re-sent answer match and
   splices: that call's prompt ids + its sampled ids + the rendered ids of what came after the
   answer (tool results, new turns, the generation prompt);
3. ``POST /inference/v1/generate`` with those ids (``output_mode: text``: token ids, logprobs with
   token strings and, when streaming, the engine's own incremental text);
4. ``POST /v1/chat/completions/derender`` on the sampled ids (the final stop token left out, as the
   engine's detokenizer does): content, reasoning and tool calls through the server's parsers.

The result is handed to the addon as if vLLM's chat endpoint had answered (``ExactResponse``: a
chat.completion, or chat SSE chunks carrying ``prompt_token_ids`` and per-chunk ``token_ids`` and
logprobs), so the provider translators, the relay and the capture path are unchanged.

Streaming stays true streaming without the streaming derender (which replays the parser from the
start on every chunk): text deltas come from the engine's detokenizer and are split here
(``stream_view``). Reasoning goes out as ``reasoning`` deltas: from the start when the prompt itself
opened a think block (DeepSeek-R1 distills, QwQ, Qwen3 Thinking-2507: the prompt's last ``<think>``
id comes after its last ``</think>`` id), or after a ``<think>`` the model wrote first (Qwen3
hybrid); text that may still turn out to be reasoning is never sent as answer. Answer text is
forwarded while it cannot be part of a tool call or markup (no tools in the request; or text that
does not start like a JSON tool call and holds no ``<tool_call>``/``<think>`` marker yet); the rest is
held back and the whole answer is derendered once at the end, whose remaining reasoning, content
and tool calls close the stream. Should the parser disagree with what was already streamed, the
answer is still sent whole, and the call is not offered for splicing (the harness holds other
text than its ids).
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from . import jsonutil, sampling
from .ledger import (
    Answer,
    new_entry,
    Ledger,
    TEMPLATE_NOT_PREFIX,
    Splice,
    context_digest,
    message_digests,
    read_session_records,
    rendered_diff,
    splice,
)

log = logging.getLogger("polar")

RENDER_PATH = "/v1/chat/completions/render"
GENERATE_PATH = "/inference/v1/generate"
DERENDER_PATH = "/v1/chat/completions/derender"
#: markup after which streamed text is held back until the whole answer is derendered
HOLD_MARKERS = ("<tool_call>", "<think>", "</think>", "<|")
#: prompt ids sent along with a derender (it seeds detokenization and the parsers from the tail)
DERENDER_PROMPT_TAIL = 64
SCALE_OUT_HINT = ("polar_exact_history needs vLLM's render/generate/derender endpoints: "
                  "start vLLM 0.32+ with --enable-scale-out (polar serve --exact-history)")


class ExactError(Exception):
    """The upstream answered a step with an error: (status, body) go to the harness as usual."""

    def __init__(self, status: int, body: bytes, step: str = ""):
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body
        self.step = step


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


class Pending:
    """What a call in flight needs for its ledger entry once its record is final."""

    __slots__ = ("context", "digests", "rendered", "stop_string", "delivered_differs")

    def __init__(self, context: bytes, digests: list[bytes], rendered: list[int]):
        self.context = context
        self.digests = digests
        self.rendered = rendered
        self.stop_string = False
        #: the stream sent text the parser later put elsewhere: its ids are not what the harness holds
        self.delivered_differs = False


class ExactHistory:
    def __init__(self, http: aiohttp.ClientSession, *, capture_path: Any = None, max_sessions: int = 512):
        self.http = http
        self.capture_path = capture_path  # session id -> Path of its capture file
        self.ledger = Ledger(max_sessions=max_sessions, loader=self._load)
        self.pending: dict[str, Pending] = {}
        #: call id -> (the ledger entry it was spliced after, its model): the entry is stored as a
        #: difference from that one
        self.bases: dict[str, tuple[Any, str]] = {}
        self.loading: dict[str, Any] = {}  # session id -> its rebuild in a thread
        self.probed_eot: dict[str, int | None] = {}
        #: upstream URL -> the (``<think>``, ``</think>``) ids of its tokenizer; None: no such single ids
        self.think_ids: dict[str, tuple[int, int] | None] = {}
        #: upstream URL -> whether its reasoning parser takes text without think markers as reasoning
        #: (vLLM's deepseek_r1 does: "models that may not generate the start token")
        self.unmarked_reasoning: dict[str, bool] = {}
        self.unavailable: dict[str, str] = {}  # upstream URL -> why it has no render/generate/derender  # upstream URL -> its end-of-turn id (None: unknown)
        self.stats = {"exact": 0, "spliced": 0, "rendered": 0, "render_ms": 0.0, "derender_ms": 0.0,
                      "weight_version_mismatch": 0, "media_rendered": 0}

    async def ensure_session(self, sid: str) -> None:
        """Hold the session's ledger, rebuilding it from its capture file in a thread when it is not
        held (a restart, an LRU eviction): parsing a 100-call session's 14 MB capture stalled every
        other stream for 443 ms when it ran on the event loop (benchmarks/bench_ledger.py). The
        session's own calls wait for the one rebuild; other sessions go on."""
        if sid in self.ledger.sessions:
            self.ledger.sessions.move_to_end(sid)
            return
        task = self.loading.get(sid)
        if task is None:
            task = self.loading[sid] = asyncio.get_running_loop().run_in_executor(None, self.ledger.load, sid)
            task.add_done_callback(lambda _t: self.loading.pop(sid, None))
        self.ledger.install(sid, await asyncio.shield(task))  # install: once, whoever wakes first

    def _load(self, sid: str) -> list[dict[str, Any]]:
        if self.capture_path is None:
            return []
        try:
            path = self.capture_path(sid)
        except Exception:  # noqa: BLE001 - an invalid id has no file
            return []
        return read_session_records(path) if path is not None and path.exists() else []

    # -- the exchange ----------------------------------------------------------------------------
    async def post(self, base_url: str, chat: dict[str, Any], rec: Any, *, stream: bool, timeout: Any,
                   max_model_len: int | None, headers: dict[str, str]) -> ExactResponse | None:
        """Render, splice, generate (and derender): a chat answer for the addon, or an error
        response with the upstream's status; None when this upstream lacks the endpoints (the
        addon then takes the normal path). Connection errors and timeouts raise as aiohttp's."""
        if base_url in self.unavailable:
            rec.translation_notes.append(f"exact history unavailable: {self.unavailable[base_url]}")
            return None
        try:
            return await self._post(base_url, chat, rec, stream=stream, timeout=timeout,
                                    max_model_len=max_model_len, headers=headers)
        except ExactError as exc:
            if exc.status in (403, 404, 405, 501) and exc.step == RENDER_PATH:
                # no token-in/token-out here (vLLM without --enable-scale-out, another server):
                # this upstream gets the normal path, and the records say so
                self.unavailable[base_url] = f"{exc.status} {exc.body[:200].decode('utf-8', 'replace')}"
                log.warning(f"polar: exact history off for {base_url}: {SCALE_OUT_HINT}")
                self.pending.pop(rec.call_id, None)
                return None
            return ExactResponse(exc.status, exc.body)

    async def _call(self, url: str, body: Any, timeout: Any, headers: dict[str, str]) -> Any:
        async with self.http.post(url, data=jsonutil.dumps(body), timeout=timeout,
                                  headers={"content-type": "application/json", **headers}) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise ExactError(resp.status, raw, urlsplit(url).path)
        return orjson.loads(raw)

    async def _post(self, base_url: str, chat: dict[str, Any], rec: Any, *, stream: bool, timeout: Any,
                    max_model_len: int | None, headers: dict[str, str]) -> ExactResponse:
        messages = chat.get("messages") or []
        t0 = time.perf_counter()
        render_body = {**chat, "stream": False}
        render_body.pop("stream_options", None)
        render_body["request_id"] = rec.call_id
        rendered_req = await self._call(base_url + RENDER_PATH, render_body, timeout, headers)
        self.stats["render_ms"] += (time.perf_counter() - t0) * 1000
        rendered: list[int] = rendered_req["token_ids"]
        context = context_digest(chat)
        digests = message_digests(messages)
        await self.ensure_session(rec.session_id)  # a rebuild from the capture runs in a thread
        match = self.ledger.find(rec.session_id, context, messages, digests)
        eot = self.ledger.eot(str(chat.get("model") or ""))
        if eot is None and match.entry is not None and not match.entry.ends_with_eot:
            eot = await self._probe_eot(base_url, chat.get("model"), timeout, headers)
        sp: Splice = splice(match, messages, rendered, eot)
        if sp.cause == TEMPLATE_NOT_PREFIX and (sp.detail or "").startswith("no end of turn"):
            # the answer stopped on an id the template does not close turns with: ask the template
            probed = await self._probe_eot(base_url, chat.get("model"), timeout, headers)
            if probed is not None and probed != eot:
                sp = splice(match, messages, rendered, probed)
        await self._probe_think(base_url, chat.get("model"), timeout, headers)
        think = self.think_ids.get(base_url)
        dropped = None
        if sp.matched_call is not None and match.entry is not None and match.entry.answer.reasoning:
            dropped = await self._drops_reasoning(base_url, chat, match.entry, timeout, headers)
        sp = follow_template(sp, match.entry, rendered, think, dropped)
        if rendered_req.get("features") and sp.ids != rendered:
            # the features' placeholder positions index the rendered ids, and the image goes to
            # generate with them: a splice would move the placeholders away from the image
            sp = Splice(list(rendered), "rendered", MEDIA_RENDERED, "image placeholders index the rendered ids")
            self.stats["media_rendered"] += 1
        rec.history, rec.history_cause = sp.history, sp.cause
        if sp.detail:
            rec.translation_notes.append(f"exact history: {sp.cause} ({sp.detail})")
        if sp.matched_call is not None:
            rec.translation_notes.append(f"exact history: spliced after call {sp.matched_call}")
        rec.rendered_prompt_diff = rendered_diff(sp.ids, rendered)
        key = "exact" if sp.history == "exact" else "rendered" if sp.history == "rendered" else "spliced"
        self.stats[key] += 1
        self.pending[rec.call_id] = Pending(context, digests, without_empty_think(rendered, think))
        self.bases[rec.call_id] = (match.entry if sp.matched_call is not None else None, str(chat.get("model") or ""))

        params = dict(rendered_req["sampling_params"])
        # vLLM 0.32's render leaves ``max_tokens`` out of the sampling parameters it returns (None),
        # and generate then samples until the context is full: the call's own limit (the harness's
        # or polar_max_tokens_cap, already in ``chat``) must be carried over here.
        asked = chat.get("max_completion_tokens") or chat.get("max_tokens")
        if asked and params.get("max_tokens") is None:
            params["max_tokens"] = int(asked)
        rec.sampling = sampling.confirm_from_render(rec.sampling, params)
        if max_model_len:
            room = max_model_len - len(sp.ids)
            if room < 1:
                raise ExactError(400, jsonutil.dumps({"error": {
                    "message": f"This model's maximum context length is {max_model_len} tokens. However, your "
                               f"prompt contains {len(sp.ids)} input tokens (exact history).",
                    "type": "BadRequestError", "code": 400}}))
            if params.get("max_tokens") is None or params["max_tokens"] > room:
                params["max_tokens"] = room
        # render's features (image hashes, placeholder positions, the processed pixels) go along:
        # without them generate would see placeholder ids and no image
        gen = {k: v for k, v in rendered_req.items() if k not in ("token_ids", "token_offsets")}
        if gen.get("features") is None:
            gen.pop("features", None)
        gen.update(token_ids=sp.ids, sampling_params=params, output_mode="text", stream=stream)
        if stream:
            gen["stream_options"] = {"include_usage": True}
        else:
            gen.pop("stream_options", None)
        ctx = _Ctx(self, base_url, chat, rec, sp.ids, timeout, headers)
        if not stream:
            answer = await self._call(base_url + GENERATE_PATH, gen, timeout, headers)
            response = await ctx.whole(answer)
            return ExactResponse(200, jsonutil.dumps(response))
        resp = await self.http.post(base_url + GENERATE_PATH, data=jsonutil.dumps(gen), timeout=timeout,
                                    headers={"content-type": "application/json", "accept": "text/event-stream",
                                             **headers})
        if resp.status != 200:
            try:
                raw = await resp.read()
            finally:
                resp.release()
            raise ExactError(resp.status, raw)
        out = ExactResponse(200, stream=True)
        out.task = asyncio.get_running_loop().create_task(ctx.stream(resp, out.content))
        return out

    async def _probe_eot(self, base_url: str, model: Any, timeout: Any, headers: dict[str, str]) -> int | None:
        """The id the template closes an assistant turn with (to close a ``length``-truncated turn
        when no answer of this proxy has ended on it yet): render [user] with the generation prompt
        and [user, assistant "ok"] without; the id after the answer's own ids is the end of turn."""
        if base_url in self.probed_eot:
            return self.probed_eot[base_url]
        eot = None
        try:
            user = [{"role": "user", "content": "hi"}]
            a = await self._call(base_url + RENDER_PATH, {"model": model, "messages": user}, timeout, headers)
            b = await self._call(base_url + RENDER_PATH, {"model": model, "add_generation_prompt": False,
                                                          "messages": user + [{"role": "assistant", "content": "ok"}]},
                                 timeout, headers)
            t = await self._call(base_url + "/tokenize", {"model": model, "prompt": "ok", "add_special_tokens": False},
                                 timeout, headers)
            head, full, ok = a["token_ids"], b["token_ids"], t["tokens"]
            n = len(head) + len(ok)
            if full[: len(head)] == head and full[len(head): n] == ok and len(full) > n:
                eot = full[n]
        except (ExactError, aiohttp.ClientError, OSError, asyncio.TimeoutError, KeyError, TypeError, ValueError):
            eot = None
        self.probed_eot[base_url] = eot
        return eot

    async def _drops_reasoning(self, base_url: str, chat: dict[str, Any], entry: Any, timeout: Any,
                               headers: dict[str, str]) -> bool | None:
        """Whether the template renders the re-sent answer the same with and without its reasoning
        (it drops it there): two renders of the conversation, only for answers that reasoned."""
        messages = chat.get("messages") or []
        k = entry.n_messages
        bare = {key: v for key, v in messages[k].items() if key not in ("reasoning", "reasoning_content")}
        # vLLM reads an assistant message's ``reasoning`` (and hands the template both ``reasoning``
        # and ``reasoning_content``); ``reasoning_content`` on input is ignored
        bodies = [{**chat, "stream": False, "messages": [*messages[:k], m, *messages[k + 1:]]}
                  for m in (bare, {**bare, "reasoning": entry.answer.reasoning})]
        for b in bodies:
            b.pop("stream_options", None)
        try:
            a, b = await asyncio.gather(*(self._call(base_url + RENDER_PATH, body, timeout, headers) for body in bodies))
            return a["token_ids"] == b["token_ids"]
        except (ExactError, KeyError, TypeError):
            return None  # unknown: the sampled ids stay spliced

    async def _probe_think(self, base_url: str, model: Any, timeout: Any, headers: dict[str, str]) -> None:
        """The ids of ``<think>`` and ``</think>`` (once per upstream): a stream must know whether its
        prompt opened a think block, and a template that does so ends the prompt on that id."""
        if base_url in self.think_ids:
            return
        found = None
        try:
            ids = []
            for marker in ("<think>", "</think>"):
                t = await self._call(base_url + "/tokenize", {"model": model, "prompt": marker,
                                                              "add_special_tokens": False}, timeout, headers)
                ids.append(t["tokens"])
            if all(isinstance(x, list) and len(x) == 1 for x in ids):
                found = (int(ids[0][0]), int(ids[1][0]))
            if found is not None:
                # what does this server's parser make of text without markers? (one derender, once)
                ok = (await self._call(base_url + "/tokenize", {"model": model, "prompt": "ok", "add_special_tokens": False},
                                       timeout, headers))["tokens"]
                probe = await self._call(base_url + DERENDER_PATH, {
                    "model": model, "prompt_token_ids": [found[1]],
                    "generate_response": {"request_id": "polar-probe", "prompt_token_ids": [found[1]], "choices": [
                        {"index": 0, "token_ids": ok, "finish_reason": "length", "stop_reason": None}]},
                    "chat_request": {"model": model, "messages": [{"role": "user", "content": "ok"}], "stream": False}},
                    timeout, headers)
                msg = (probe.get("choices") or [{}])[0].get("message") or {}
                self.unmarked_reasoning[base_url] = bool(msg.get("reasoning") or msg.get("reasoning_content")) \
                    and not msg.get("content")
        except (ExactError, aiohttp.ClientError, OSError, asyncio.TimeoutError, KeyError, TypeError, ValueError,
                IndexError, AttributeError):
            pass
        self.think_ids[base_url] = found

    # -- the ledger ------------------------------------------------------------------------------
    def observe(self, rec: Any) -> None:
        """The call's record is final: keep what it sampled for the next calls of its session."""
        p = self.pending.pop(rec.call_id, None)
        matched, model = self.bases.pop(rec.call_id, (None, ""))
        if p is None or rec.status != "ok" or not rec.sampled_token_ids or not rec.prompt_token_ids:
            return
        if p.delivered_differs:
            return  # the harness was sent other text than these ids decode to: never splice them
        finish = rec.finish_reason or ""
        stop_reason = getattr(rec, "stop_reason", None)
        entry = new_entry(
            rec.call_index, p.context, p.digests, rec.prompt_token_ids, p.rendered, rec.sampled_token_ids, finish,
            Answer.from_output(rec.output_text, rec.output_reasoning, rec.output_tool_calls),
            exact=rec.history == "exact", stop_reason="?" if p.stop_string and stop_reason is None else stop_reason,
            model=model)
        self.ledger.add(rec.session_id, entry, matched)

    def forget(self, sid: str) -> None:
        self.ledger.forget(sid)


class _Ctx:
    """One call's generate/derender state."""

    def __init__(self, owner: ExactHistory, base_url: str, chat: dict[str, Any], rec: Any, ids: list[int],
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
            for key, done in (("reasoning", sent_r), ("content", sent_c)):
                rest, same = _rest(message.get(key) or (message.get("reasoning_content") if key == "reasoning" else "")
                                   or "", done)
                if rest:
                    delta[key] = rest
                if not same:
                    differs.append(key)
            if differs:
                # the answer still goes out whole; the record keeps what was sent, and these ids
                # are not offered for splicing since the harness holds other text
                self.rec.translation_notes.append(
                    f"exact history: streamed {' and '.join(differs)} differs from the derendered answer; "
                    "sent whole, not spliced later")
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


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: the label of a record whose ids were sampled by other weights than its policy_version
WEIGHT_VERSION_MISMATCH = "weight_version_mismatch"
#: the cause of a record prompted with the rendered ids because an image's placeholders index them
MEDIA_RENDERED = "media_rendered"
#: the cause a record names when the template renders an answer without the reasoning it sampled
TEMPLATE_DROPPED_REASONING = "template_dropped_reasoning"


def follow_template(sp: Splice, entry: Any, rendered: list[int], think: tuple[int, int] | None,
                    dropped: bool | None = None) -> Splice:
    """Exact history follows the template about reasoning. Where the template keeps a re-sent
    answer's reasoning, the sampled ids are spliced (``sp`` as it is). Where it drops it (the
    DeepSeek-R1 distills drop every earlier turn's; Qwen3 those before the last user message), the
    model is trained and served on the template's rendering: the answer is taken as rendered, after
    the matched call's own prompt ids, and the record says ``template_dropped_reasoning``; a prefix
    check that failed because the template now drops reasoning it had kept says so too.
    ``dropped``: the template renders the answer the same without its reasoning (asked of the
    server by rendering it both ways, ``ExactHistory._drops_reasoning``)."""
    if entry is None:
        return sp
    if sp.matched_call is not None and entry.answer.reasoning:
        if dropped:
            return Splice(list(entry.prompt_ids) + rendered[entry.rendered_len:], f"spliced_at={entry.n_messages}",
                          TEMPLATE_DROPPED_REASONING, f"call {entry.call_index}", matched_call=entry.call_index)
        return sp
    if think is not None and sp.cause == TEMPLATE_NOT_PREFIX and sp.matched_call is None:
        if rendered.count(think[1]) < entry.prompt_ids.count(think[1]):
            return Splice(sp.ids, sp.history, TEMPLATE_DROPPED_REASONING, sp.detail)
    return sp


def without_empty_think(rendered: list[int], think: tuple[int, int] | None) -> list[int]:
    """The rendered prompt without an empty think block its generation prompt ends with (Qwen3 with
    ``enable_thinking=false``: ``<think>\\n\\n</think>\\n\\n``). The template re-renders the answer without
    it, so the next call's prefix check compares what precedes it (it failed on every call)."""
    if think is None:
        return rendered
    tail = rendered[-6:]
    if think[0] in tail:
        i = len(rendered) - len(tail) + tail.index(think[0])
        if think[1] in rendered[i + 1:]:
            return rendered[:i]
    return rendered


def stream_view(text: str, *, opened: bool, tools: bool) -> tuple[str, str]:
    """(reasoning, content) of the engine's text so far that may be streamed now. Each grows only by
    appending as text arrives; what might still change role (text that may be reasoning, a marker
    or tool call beginning, whitespace a parser may strip) is held back. ``opened``: the prompt
    ended inside a think block, so the text is reasoning until ``</think>``."""
    lead = text.lstrip()
    if THINK_OPEN.startswith(lead):
        return "", ""  # nothing yet, or the start of "<think>": may become reasoning
    if lead.startswith(THINK_OPEN):
        body = lead[len(THINK_OPEN):]  # the model opened the block (parsers drop the marker)
    elif opened:
        body = text
    else:
        return "", _content_view(text, tools)
    end = body.find(THINK_CLOSE)
    if end < 0:
        return _trim(body[: _cut(body, (THINK_CLOSE,))]), ""
    return _trim(body[:end]), _content_view(body[end + len(THINK_CLOSE):], tools)


def _content_view(text: str, tools: bool) -> str:
    """Answer text that cannot become a tool call or markup: up to the first marker (or the start
    of one); nothing when tools are offered and the text starts like a JSON tool call."""
    if tools and text.lstrip()[:1] in ("{", "[", "`"):
        return ""
    return _trim(text[: min(_first_marker(text), _safe_len(text))])


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


def _rest(final: str, sent: str) -> tuple[str, bool]:
    """What of the derendered ``final`` text is still to send after ``sent`` (compared without the
    leading whitespace parsers differ on), and whether ``final`` continues what was sent; when it
    does not, all of ``final`` goes out."""
    if not sent:
        return final, True
    body, head = final.lstrip(), sent.lstrip()
    if body.startswith(head):
        return body[len(head):], True
    return final, False


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
