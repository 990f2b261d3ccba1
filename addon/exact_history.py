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

Where each part lives (split by concern): this module holds the exchange (render, splice,
generate, derender, in that order) and the ledger's upkeep; ``exact_template.py`` the server's
endpoints and the questions asked of its template (the end-of-turn id, the think markers, whether
it drops a re-sent answer's reasoning); ``exact_splice.py`` how the splice follows the template
(``template_dropped_reasoning``, Qwen3's empty think block); ``exact_stream.py`` the answer handed
to the addon, whole or streamed, and the stream view (what of the engine's text may go out now).
The names they define are re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from . import jsonutil, sampling
from .exact_splice import MEDIA_RENDERED, TEMPLATE_DROPPED_REASONING, follow_template, without_empty_think
from .exact_stream import (
    DERENDER_PROMPT_TAIL,
    HOLD_MARKERS,
    THINK_CLOSE,
    THINK_OPEN,
    WEIGHT_VERSION_MISMATCH,
    ExactResponse,
    FeedReader,
    _Ctx,
    _must_hold,
    _safe_len,
    stream_view,
)
from .exact_template import (
    DERENDER_PATH,
    GENERATE_PATH,
    RENDER_PATH,
    SCALE_OUT_HINT,
    ExactError,
    TemplateQuestions,
)
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

__all__ = [
    "DERENDER_PATH", "DERENDER_PROMPT_TAIL", "GENERATE_PATH", "HOLD_MARKERS", "MEDIA_RENDERED", "RENDER_PATH",
    "SCALE_OUT_HINT", "TEMPLATE_DROPPED_REASONING", "THINK_CLOSE", "THINK_OPEN", "WEIGHT_VERSION_MISMATCH",
    "ExactError", "ExactHistory", "ExactResponse", "FeedReader", "Pending", "_Ctx", "_must_hold", "_safe_len",
    "follow_template", "stream_view", "without_empty_think",
]

log = logging.getLogger("polar")


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

class ExactHistory(TemplateQuestions):
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
