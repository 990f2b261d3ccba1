"""A scripted stand-in for vLLM's OpenAI chat server: exact wire format, deterministic answers, faults.

Why: proxy tests and the proxy benchmark need an upstream that answers in milliseconds, says
exactly which token ids and logprobs it sent (so captures can be compared bit for bit), and can
fail on demand. It speaks vLLM's chat-completions dialect with ``return_token_ids``:

* non-streaming: top-level ``prompt_token_ids``, per-choice ``token_ids``,
  ``logprobs.content[{token, logprob, bytes, top_logprobs}]``, ``message.reasoning``;
* streaming: a first chunk with ``role`` and ``prompt_token_ids`` (only there), one chunk per
  sampled token with its ``token_ids`` delta and logprobs (empty ``delta`` for tool-call markup,
  like vLLM's tool parser), the finish chunk, a usage chunk when ``stream_options.include_usage``,
  then ``data: [DONE]``;
* ``GET /v1/models`` with ``max_model_len``, ``POST /tokenize``, ``GET /health``.

What to answer comes from a script: built-in scenarios (``text``, ``reasoning``, ``tool``,
``tools2``, ``length``, ``summary``, ``words:N``; a harness's compaction request, recognized by
``polar_core.compaction``, always gets ``summary``; a history that restarts from a summary gets
``resumed`` when one is given) or a JSON script file (a list of turns, or a dict of lists keyed
by session id with ``"*"`` as default). The turn is the number of assistant messages in the request.
Directives in the last user message override it: ``#scenario:NAME`` and ``#fault:KIND`` where KIND
is ``500``, ``429``, ``hang``, ``hang_stream``, ``cut``, ``refuse``, ``drop_once`` (``refuse``
for the first request of each ``x-request-id``) or ``context``; the header
``x-scripted-fault`` does the same for direct calls. ``#delay:MS`` sleeps per token.
``#send:burst`` sends a stream's head and every event in one piece (a stream that is complete
before its reader looks, as a loaded proxy sees a fast engine).

Prompt ids come from the real chat template when ``--tokenizer DIR`` is given, else from a cheap
deterministic tokenization (crc32 of words), cached per message so the benchmark stays fast.

Run: ``python -m polar_testing.scripted_upstream --port N [--tokenizer DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import re
import threading
import time
import uuid
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from polar_core.compaction import compaction_of

DEFAULT_SCENARIOS: dict[str, dict[str, Any]] = {
    "text": {"text": "Hello from the scripted upstream. The file is ready."},
    "reasoning": {"reasoning": "The user wants a number. 42 is a fine one.", "text": "The answer is 42."},
    "tool": {
        "reasoning": "I should create the file with the shell.",
        "tool_calls": [{"name": "bash", "arguments": {"command": "echo hi > hello.txt"}}],
    },
    "tools2": {
        "tool_calls": [
            {"name": "bash", "arguments": {"command": "ls -la"}},
            {"name": "read", "arguments": {"path": "README.md"}},
        ]
    },
    # What a harness's compaction (summary) request is answered with.
    "summary": {"text": "Summary: the task is under way; the steps so far ran and wrote their files. "
                        "Next: finish the remaining steps, then report."},
    # Sampled tokens but no visible content: a tool call cut by max_tokens (the parser hides it).
    "length": {"raw": '<tool_call>\n{"name": "bash", "arguments": {"command": "cat very', "finish_reason": "length"},
}

#: The default conversation when nothing selects a scenario: call a tool, then answer.
DEFAULT_SCRIPT = ["tool", "text"]

#: What vLLM's render puts in ``sampling_params`` when the request says nothing (0.32, no generation config).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0,
    "min_p": 0.0, "seed": None, "stop": [], "stop_token_ids": [], "max_tokens": 16, "logprobs": None,
    "skip_special_tokens": True, "output_kind": 2, "skip_clone": True, "bad_words": [],
    "skip_reading_prefix_cache": False,
}

FAULTS = ("500", "429", "hang", "hang_stream", "cut", "refuse", "context")

_DIRECTIVE_RE = re.compile(r"#(scenario|fault|delay|send|budget):([A-Za-z0-9_:.-]+)")
_WORD_RE = re.compile(r"\s*\S+|\s+")
EOS_TEXT = "<|im_end|>"
SYSTEM_FINGERPRINT = "vllm-scripted"
CHEAP_EOS_ID = 2
CHEAP_VOCAB = 50_000
CHEAP_SPECIAL = {"<|im_start|>": 3, "<|im_end|>": 2, "<think>": 4, "</think>": 5, "<tool_call>": 6, "</tool_call>": 7}


@functools.lru_cache(maxsize=65536)
def token_logprob(token_id: int, position: int) -> float:
    """A deterministic, token- and position-dependent logprob in (-2, 0)."""
    h = zlib.crc32(f"{token_id}:{position}".encode()) % 100_000
    return -(h + 1) / 50_000.0


@dataclass
class Piece:
    """One sampled token: id, the text it adds, and which output channel the text belongs to."""

    token_id: int
    text: str
    kind: str  # reasoning | content | markup | eos
    token: str = ""  # the token's own string (logprobs.content[].token)


@dataclass
class Reply:
    pieces: list[Piece]
    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    # tool call i starts at piece tool_starts[i] and ends (inclusive) at tool_ends[i]
    tool_starts: list[int] = field(default_factory=list)
    tool_ends: list[int] = field(default_factory=list)


class Tokenizer:
    """Real chat template (transformers) when a directory is given, else cheap crc32 words."""

    def __init__(self, directory: str | Path | Any | None = None):
        self.hf = None
        if isinstance(directory, (str, Path)):
            from polar_core.tokenizer_identity import load_tokenizer  # no Mistral-regex warning (its docstring)

            self.hf = load_tokenizer(directory)
        elif directory is not None:  # an already loaded transformers tokenizer
            self.hf = directory
        self._cache: OrderedDict[bytes, list[int]] = OrderedDict()
        self.eos_id = CHEAP_EOS_ID
        #: the cheap template renders a system message with this (when > 0): a template whose
        #: rendering of an old history changes (a date in the system prompt, as Llama 3's does)
        self.epoch = 0
        if self.hf is not None:
            eos = self.hf.convert_tokens_to_ids(EOS_TEXT)
            self.eos_id = eos if isinstance(eos, int) and eos >= 0 else self.hf.eos_token_id

    # -- prompts --------------------------------------------------------------------------------
    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   add_generation_prompt: bool = True) -> list[int]:
        if self.hf is not None:
            msgs = [_template_message(m) for m in messages]
            kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": True}
            if tools:
                kwargs["tools"] = tools
            ids = self.hf.apply_chat_template(msgs, **kwargs)
            if isinstance(ids, dict):  # BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        out: list[int] = []
        if tools:
            out += self._cached(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS))
        for m in messages:  # <|im_start|> role ... <|im_end|>, like ChatML
            out += self.message_ids(m)
        if add_generation_prompt:
            out += [CHEAP_SPECIAL["<|im_start|>"], _cheap_id("assistant")]
        return out

    def message_ids(self, m: dict[str, Any]) -> list[int]:
        """The cheap template's ids of one message (the cheap rendering is their concatenation)."""
        out = [CHEAP_SPECIAL["<|im_start|>"], _cheap_id(str(m.get("role")))]
        if self.epoch and m.get("role") == "system":
            out.append(_cheap_id(f"epoch:{self.epoch}"))
        if isinstance(m.get("content"), str) and set(m) <= {"role", "content"}:  # plain text: its words
            out += [p.token_id for p in self.pieces(m["content"], "content")]
        else:
            out += self._cached(orjson.dumps(m, option=orjson.OPT_SORT_KEYS))
        out.append(CHEAP_SPECIAL["<|im_end|>"])
        return out

    def _cached(self, key: bytes) -> list[int]:
        ids = self._cache.get(key)
        if ids is None:
            ids = [_cheap_id(w) for w in key.decode().split()]
            self._cache[key] = ids
            if len(self._cache) > 8192:
                self._cache.popitem(last=False)
        return ids

    # -- answers --------------------------------------------------------------------------------
    def pieces(self, text: str, kind: str) -> list[Piece]:
        if not text:
            return []
        if self.hf is None:
            out = []
            for w in _split_special(text):
                tid = CHEAP_SPECIAL.get(w) or _cheap_id(w)
                out.append(Piece(tid, w, kind, w))
            return out
        ids = self.hf.encode(text, add_special_tokens=False)
        out, prev = [], ""
        for i in range(len(ids)):
            cur = self.hf.decode(ids[: i + 1])
            out.append(Piece(ids[i], cur[len(prev):], kind, self.hf.convert_ids_to_tokens(ids[i])))
            prev = cur
        return out

    def eos(self) -> Piece:
        return Piece(self.eos_id, "", "eos", EOS_TEXT)


def _cheap_id(word: str) -> int:
    return 10 + zlib.crc32(word.encode()) % CHEAP_VOCAB


def _split_special(text: str) -> list[str]:
    parts = re.split(r"(<\|im_start\|>|<\|im_end\|>|<think>|</think>|<tool_call>|</tool_call>)", text)
    out: list[str] = []
    for p in parts:
        if not p:
            continue
        if p in CHEAP_SPECIAL:
            out.append(p)
        else:
            out += _WORD_RE.findall(p)
    return out


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    """Flatten content parts and parse tool-call arguments the way vLLM does before templating."""
    m = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if m.get("tool_calls"):
        calls = []
        for tc in m["tool_calls"]:
            fn = dict(tc.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = orjson.loads(fn["arguments"])
                except orjson.JSONDecodeError:
                    pass
            calls.append({**tc, "function": fn})
        m["tool_calls"] = calls
    return m


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, list):
                return " ".join(p.get("text", "") for p in c if isinstance(p, dict))
            return c or ""
    return ""


class Script:
    """Which turn to answer with: by session (optional) and by the number of assistant turns."""

    def __init__(self, data: Any = None):
        if data is None:
            data = DEFAULT_SCRIPT
        self.by_session: dict[str, list[Any]] = data if isinstance(data, dict) else {"*": list(data)}

    @classmethod
    def load(cls, path: str | Path | None) -> "Script":
        return cls(orjson.loads(Path(path).read_bytes()) if path else None)

    def turn(self, session: str | None, index: int) -> dict[str, Any]:
        turns = self.by_session.get(session or "") or self.by_session.get("*") or DEFAULT_SCRIPT
        entry = turns[index % len(turns)]
        return resolve_scenario(entry)


def resolve_scenario(entry: Any) -> dict[str, Any]:
    if isinstance(entry, dict):
        return entry
    name = str(entry)
    if name.startswith("words:"):
        n = int(name.split(":", 1)[1])
        return {"text": " ".join(f"w{i % 97}" for i in range(n))}
    if name not in DEFAULT_SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}")
    return DEFAULT_SCENARIOS[name]


class ScriptedUpstream:
    """The aiohttp application and its state (request log for tests, counters for benchmarks)."""

    def __init__(
        self,
        *,
        served_model: str = "scripted-model",
        max_model_len: int = 4096,
        tokenizer: str | Path | Any | None = None,
        script: Script | None = None,
        log_size: int = 64,
        reject_large_max_tokens: bool = False,
        summary: Any = "summary",
        resumed: Any = None,
    ):
        self.served_model = served_model
        self.reject_large_max_tokens = reject_large_max_tokens
        #: the answer to a harness's compaction (summary) request: a scenario name or a turn
        self.summary = summary
        #: the answer to a call whose history restarts from a harness's summary (None: the script's turn)
        self.resumed = resumed
        self.max_model_len = max_model_len
        self.tok = Tokenizer(tokenizer)
        self.script = script or Script()
        self.requests: deque[dict[str, Any]] = deque(maxlen=log_size)
        self.responses: deque[dict[str, Any]] = deque(maxlen=log_size)
        self.count = 0
        #: request ids a ``drop_once`` fault has already dropped
        self.dropped: set[str | None] = set()
        self.reply_cache: dict[bytes, Reply] = {}
        # token-in/token-out (vLLM's --enable-scale-out endpoints): what each rendered request was,
        # by request id, and which reply each generated id sequence spells (for derender)
        self.scale_out = True
        self.rendered: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.generated: OrderedDict[tuple[int, ...], Reply] = OrderedDict()
        self.generate_requests: deque[dict[str, Any]] = deque(maxlen=log_size)
        # The exact prompt each generate should get, worked out here from what this upstream sampled
        # (not from the proxy's ledger): every re-sent answer whose history is the one it was
        # sampled for, whose text, tool calls and reasoning are those sampled, and whose template
        # rendering has not changed since, stands as [<|im_start|>, assistant] + its sampled ids (+
        # the end of turn closing a cut one); every other message as the template renders it.
        # Tests compare whole: ``prompt_checks`` (cheap tokenizer only; None with a real template).
        self.answers: OrderedDict[bytes, dict[str, Any]] = OrderedDict()
        self.prompt_checks: deque[dict[str, Any]] = deque(maxlen=4096)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/chat/completions/render", self.render)
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/v1/chat/completions/derender", self.derender)
        app.router.add_get("/_scripted/log", self.log)
        app.router.add_post("/_scripted/reset", self.reset)
        return app

    # -- side endpoints -------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.served_model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.served_model,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        return _json({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if "messages" in body:
            ids = self.tok.prompt_ids(body["messages"], body.get("tools"))
        else:
            ids = [p.token_id for p in self.tok.pieces(body.get("prompt", ""), "content")]
        return _json({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None})

    async def log(self, request: web.Request) -> web.Response:
        return _json({"count": self.count, "requests": list(self.requests), "responses": list(self.responses),
                      "generate_requests": list(self.generate_requests)})

    async def reset(self, request: web.Request) -> web.Response:
        self.requests.clear()
        self.responses.clear()
        self.generate_requests.clear()
        self.prompt_checks.clear()
        self.count = 0
        return _json({"ok": True})

    # -- chat -----------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.count += 1
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return _error(400, f"invalid JSON: {exc}", "BadRequestError")
        self.requests.append(body)
        messages = body.get("messages") or []
        directives = dict(_DIRECTIVE_RE.findall(_last_user_text(messages)))
        fault = request.headers.get("x-scripted-fault") or directives.get("fault")
        delay = float(directives.get("delay", 0)) / 1000.0
        model = body.get("model")
        if model != self.served_model:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")

        if fault == "drop_once" and request.headers.get("x-request-id") not in self.dropped:
            # a keep-alive connection the server closes as the client reuses it: nothing answered
            self.dropped.add(request.headers.get("x-request-id"))
            fault = "refuse"
        if fault == "refuse":
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=500)  # never delivered
        if fault == "500":
            return _error(500, "scripted internal server error", "InternalServerError")
        if fault == "429":
            return _error(429, "scripted rate limit", "RateLimitError", headers={"Retry-After": "7"})
        if fault == "hang":
            await asyncio.sleep(3600)

        prompt_ids = self.tok.prompt_ids(messages, body.get("tools"))
        if fault == "context" or len(prompt_ids) >= self.max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {max(len(prompt_ids), self.max_model_len + 1)} input tokens, which exceeds this "
                "limit even without any output tokens. Please reduce the length of the input prompt.",
                "BadRequestError",
            )

        if "scenario" in directives:
            turn = resolve_scenario(directives["scenario"])
        elif (kind := compaction_of(messages) or "").startswith("summary call"):
            turn = resolve_scenario(self.summary)  # a harness compacting its history gets a summary
        elif self.resumed is not None and kind.startswith("resumed from a summary"):
            turn = resolve_scenario(self.resumed)
        else:
            n_assistant = sum(1 for m in messages if m.get("role") == "assistant")
            turn = self.script.turn(request.headers.get("x-polar-session"), n_assistant)
        reply = self.build_reply(turn)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        room = self.max_model_len - len(prompt_ids)
        if max_tokens and int(max_tokens) > room and (self.reject_large_max_tokens or directives.get("budget") == "reject"):
            # vLLM before the clamp in get_max_tokens (and forks that kept the check) refuse it
            param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
            return _error(
                400,
                f"'{param}' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {len(prompt_ids)} input tokens "
                f"({max_tokens} > {self.max_model_len} - {len(prompt_ids)}).",
                "BadRequestError",
            )
        # vLLM 0.32 (get_max_tokens): the request's max_tokens, clamped to the room the prompt leaves
        max_tokens = min(int(max_tokens), room) if max_tokens else room
        pieces, finish = reply.pieces, reply.finish_reason
        if max_tokens is not None and len(pieces) > max_tokens:
            pieces, finish = pieces[:max_tokens], "length"
        want_ids = bool(body.get("return_token_ids"))
        want_lp = bool(body.get("logprobs"))
        if body.get("stream"):
            return await self.stream(request, body, reply, pieces, finish, prompt_ids, want_ids, want_lp, fault, delay,
                                     burst=directives.get("send") == "burst")
        if delay:
            await asyncio.sleep(delay * len(pieces))
        return _json(self.whole(body, reply, pieces, finish, prompt_ids, want_ids, want_lp))

    # -- token in / token out (vLLM 0.32 ``--enable-scale-out``) ----------------------------------
    def _turn_for(self, messages: list[dict[str, Any]], session: str | None) -> dict[str, Any]:
        directives = dict(_DIRECTIVE_RE.findall(_last_user_text(messages)))
        if "scenario" in directives:
            return resolve_scenario(directives["scenario"])
        kind = compaction_of(messages) or ""  # as the chat path answers a harness's compaction
        if kind.startswith("summary call"):
            return resolve_scenario(self.summary)
        if self.resumed is not None and kind.startswith("resumed from a summary"):
            return resolve_scenario(self.resumed)
        n_assistant = sum(1 for m in messages if m.get("role") == "assistant")
        return self.script.turn(session, n_assistant)

    async def render(self, request: web.Request) -> web.Response:
        """``POST /v1/chat/completions/render``: vLLM's ``GenerateRequest`` for a chat request."""
        if not self.scale_out:
            return _error(403, "scale-out endpoints are disabled (--enable-scale-out)", "PermissionDeniedError")
        body = orjson.loads(await request.read())
        if body.get("model") != self.served_model:
            return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        messages = body.get("messages") or []
        ids = self.tok.prompt_ids(messages, body.get("tools"), bool(body.get("add_generation_prompt", True)))
        rid = f"chatcmpl-{body.get('request_id') or uuid.uuid4().hex}"
        self.rendered[rid] = {"messages": messages, "session": request.headers.get("x-polar-session"),
                              "directives": dict(_DIRECTIVE_RE.findall(_last_user_text(messages))),
                              "context": _context(body), "ids": ids, "epoch": self.tok.epoch,
                              "generation_prompt": bool(body.get("add_generation_prompt", True))}
        while len(self.rendered) > 4096:
            self.rendered.popitem(last=False)
        params = dict(SAMPLING_DEFAULTS)
        # vLLM 0.32's render answers ``max_tokens: null`` whatever the request asked (seen on the
        # real server): a generate request built from it alone samples until the context is full.
        params.update(max_tokens=None,
                      logprobs=(int(body.get("top_logprobs") or 0) if body.get("logprobs") else None),
                      skip_special_tokens=not bool(body.get("tools")))
        for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"):
            if body.get(k) is not None:
                params[k] = body[k]
        return _json({"request_id": rid, "token_ids": ids, "token_offsets": None, "features": None,
                      "content_parts": None, "sampling_params": params, "model": body.get("model"),
                      "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
                      "output_mode": "tokens", "stream": bool(body.get("stream")),
                      "stream_options": body.get("stream_options") if body.get("stream") else None,
                      "cache_salt": body.get("cache_salt"), "priority": 0, "kv_transfer_params": None,
                      "ec_transfer_params": None})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /inference/v1/generate``: token ids in; sampled ids, logprobs (and text) out."""
        if not self.scale_out:
            return _error(403, "scale-out endpoints are disabled (--enable-scale-out)", "PermissionDeniedError")
        body = orjson.loads(await request.read())
        self.count += 1
        self.generate_requests.append(body)
        ids = body.get("token_ids") or []
        if not ids:
            return _error(400, "token_ids: List should have at least 1 item after validation", "BadRequestError")
        info = self.rendered.get(body.get("request_id") or "") or {"messages": [], "session": None, "directives": {}}
        fault = request.headers.get("x-scripted-fault") or info["directives"].get("fault")
        delay = float(info["directives"].get("delay", 0)) / 1000.0
        if fault == "500":
            return _error(500, "scripted internal server error", "InternalServerError")
        if len(ids) >= self.max_model_len:
            return _error(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                               f"your request has {len(ids)} input tokens.", "BadRequestError")
        reply = self.build_reply(self._turn_for(info["messages"], info["session"] or request.headers.get("x-polar-session")))
        params = body.get("sampling_params") or {}
        pieces, finish = reply.pieces, reply.finish_reason
        max_tokens = params.get("max_tokens")
        if max_tokens is not None and len(pieces) > max_tokens:
            pieces, finish = pieces[:max_tokens], "length"
        if finish != "length":
            finish = "stop"  # the engine knows no tool calls: the derender does
        sampled = [p.token_id for p in pieces]
        if info.get("context") is not None:
            self.prompt_checks.append({"session": info["session"], "request_id": body.get("request_id"),
                                       "received": list(ids), "expected": self.expected_prompt(info),
                                       "rendered": info["ids"]})
            self._keep_answer(info, reply, pieces)
        self.generated[tuple(sampled)] = reply
        if sampled and pieces[-1].kind == "eos":
            self.generated[tuple(sampled[:-1])] = reply
        while len(self.generated) > 8192:
            self.generated.popitem(last=False)
        text_mode = body.get("output_mode") == "text"
        want_lp = params.get("logprobs") is not None

        def choice(ps: list[Piece], offset: int, last: bool, stream: bool) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish if last else None, "stop_reason": None,
                                 "token_ids": [p.token_id for p in ps], "routed_experts": None, "sampling_mask": None,
                                 "weight_versions": None}
            if text_mode:
                c["text"] = "".join(p.text for p in ps if p.kind != "eos")
                c["logprobs"] = self._logprobs(ps, offset) if want_lp else None
            else:
                c["logprobs"] = {"content": [
                    {"token_id": p.token_id, "logprob": token_logprob(p.token_id, offset + i), "rank": 1,
                     "top_logprobs": []} for i, p in enumerate(ps)]} if want_lp else None
            return c

        self.responses.append({"prompt_token_ids": list(ids), "token_ids": sampled,
                               "logprobs": [token_logprob(t, i) for i, t in enumerate(sampled)], "finish_reason": finish})
        mode = "text" if text_mode else "tokens"
        usage = {"prompt_tokens": len(ids), "total_tokens": len(ids) + len(sampled), "completion_tokens": len(sampled),
                 "prompt_tokens_details": None}
        if not body.get("stream"):
            if delay:
                await asyncio.sleep(delay * len(pieces))
            return _json({"request_id": body.get("request_id"), "model": None, "created": int(time.time()),
                          "usage": usage, "prompt_logprobs": None, "prompt_token_id_logprobs": None,
                          "prompt_token_ids": list(ids) if body.get("return_token_ids") else None,
                          "mm_placeholders": None, "metrics": None, "kv_transfer_params": None,
                          "ec_transfer_params": None, "output_mode": mode,
                          "choices": [choice(pieces, 0, True, False)]})
        resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        for i, p in enumerate(pieces):
            if fault == "cut" and i == len(pieces) // 2:  # the connection breaks mid-generation
                assert request.transport is not None
                request.transport.abort()
                return resp
            if delay:
                await asyncio.sleep(delay)
            d = {"request_id": body.get("request_id"), "usage": None,
                 "prompt_token_ids": list(ids) if (i == 0 and body.get("return_token_ids")) else None,
                 "mm_placeholders": None, "metrics": None, "output_mode": mode,
                 "choices": [choice([p], i, i == len(pieces) - 1, True)]}
            await resp.write(b"data: " + orjson.dumps(d) + b"\n\n")
        if include_usage:
            d = {"request_id": body.get("request_id"), "usage": usage, "prompt_token_ids": None,
                 "mm_placeholders": None, "metrics": None, "output_mode": mode, "choices": []}
            await resp.write(b"data: " + orjson.dumps(d) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def derender(self, request: web.Request) -> web.Response:
        """``POST /v1/chat/completions/derender`` (non-streaming): generated ids -> chat answer."""
        if not self.scale_out:
            return _error(403, "scale-out endpoints are disabled (--enable-scale-out)", "PermissionDeniedError")
        body = orjson.loads(await request.read())
        gen = body.get("generate_response") or {}
        if body.get("chat_request") is None:
            return _error(400, "chat_request is required when a tool or reasoning parser is configured because "
                               "plain detokenization would leak raw parser markup into content.", "BadRequestError")
        choices = []
        for c in gen.get("choices") or ():
            ids = tuple(c.get("token_ids") or ())
            if not ids:
                return _error(400, f"choice {c.get('index', 0)} has empty or null token_ids", "BadRequestError")
            reply = self.generated.get(ids)
            n = len(ids)
            if reply is None:
                message = {"role": "assistant", "content": "", "reasoning": None, "tool_calls": []}
            else:
                pieces = reply.pieces[:n]
                content = "".join(p.text for p in pieces if p.kind == "content")
                reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
                calls = [{**tc, "id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"}
                         for tc, end in zip(reply.tool_calls, reply.tool_ends) if end < n]
                message = {"role": "assistant", "content": content if (content or not calls) else None,
                           "refusal": None, "annotations": None, "audio": None, "function_call": None,
                           "tool_calls": calls, "reasoning": reasoning or None}
            choices.append({"index": c.get("index", 0), "message": message, "logprobs": None,
                            "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason"),
                            "token_ids": None})
        n_out = sum(len(c.get("token_ids") or ()) for c in gen.get("choices") or ())
        prompt_tokens = body.get("prompt_tokens") or 0
        return _json({"id": gen.get("request_id"), "object": "chat.completion", "created": int(time.time()),
                      "model": body.get("model") or self.served_model, "choices": choices, "service_tier": None,
                      "system_fingerprint": None,
                      "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n_out,
                                "completion_tokens": n_out, "prompt_tokens_details": None},
                      "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None, "metrics": None})

    # -- the exact prompt, worked out independently of the proxy ------------------------------------
    def _answer_key(self, session: Any, context: bytes, messages: list[dict[str, Any]]) -> bytes:
        return _blake(orjson.dumps([session, context.decode(), messages], option=orjson.OPT_SORT_KEYS))

    def _keep_answer(self, info: dict[str, Any], reply: Reply, pieces: list[Piece]) -> None:
        n = len(pieces)
        calls = [(tc["function"]["name"], orjson.loads(tc["function"]["arguments"]))
                 for tc, end in zip(reply.tool_calls, reply.tool_ends) if end < n]
        self.answers[self._answer_key(info["session"], info["context"], info["messages"])] = {
            "sampled": [p.token_id for p in pieces], "epoch": info["epoch"], "calls": calls,
            "content": "".join(p.text for p in pieces if p.kind == "content"),
            "reasoning": "".join(p.text for p in pieces if p.kind == "reasoning")}
        while len(self.answers) > 8192:
            self.answers.popitem(last=False)

    def expected_prompt(self, info: dict[str, Any]) -> list[int] | None:
        """The exact prompt for a rendered request (see ``prompt_checks``); None with a real template."""
        if self.tok.hf is not None:
            return None
        messages, context = info["messages"], info["context"]
        tools = orjson.loads(context).get("tools")
        out: list[int] = list(self.tok._cached(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS))) if tools else []
        im_start, im_end = CHEAP_SPECIAL["<|im_start|>"], CHEAP_SPECIAL["<|im_end|>"]
        for i, m in enumerate(messages):
            a = self.answers.get(self._answer_key(info["session"], context, messages[:i])) \
                if m.get("role") == "assistant" else None
            if a is not None and a["epoch"] == self.tok.epoch and _same_answer(a, m):
                close = [] if a["sampled"] and a["sampled"][-1] == self.tok.eos_id else [im_end]
                out += [im_start, _cheap_id("assistant")] + a["sampled"] + close
            else:
                out += self.tok.message_ids(m)
        if info["generation_prompt"]:
            out += [im_start, _cheap_id("assistant")]
        return out

    def check_prompts(self, session: str) -> list[dict[str, Any]]:
        """This session's generate calls; raises AssertionError naming the first whose prompt ids
        are not the exact prompt (the first differing position, both ids there)."""
        checks = [c for c in self.prompt_checks if c["session"] == session]
        for i, c in enumerate(checks):
            got, want = c["received"], c["expected"]
            if want is not None and got != want:
                at = next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
                raise AssertionError(f"generate call {i} of session {session}: prompt ids differ from the exact "
                                     f"prompt at {at} of {len(want)} (got {got[at:at + 4]}, want {want[at:at + 4]}; "
                                     f"{len(got)} ids received; rendered == received: {c['rendered'] == got})")
        return checks

    def build_reply(self, turn: dict[str, Any]) -> Reply:
        key = orjson.dumps(turn, option=orjson.OPT_SORT_KEYS)
        cached = self.reply_cache.get(key)
        if cached is not None:
            return cached
        tok = self.tok
        pieces: list[Piece] = []
        reasoning, text = turn.get("reasoning", ""), turn.get("text", "")
        if turn.get("raw") is not None:
            pieces += tok.pieces(turn["raw"], "markup")
        if reasoning:
            pieces += tok.pieces("<think>\n", "markup")
            pieces += tok.pieces(reasoning, "reasoning")
            pieces += tok.pieces("\n</think>\n\n", "markup")
        pieces += tok.pieces(text, "content")
        calls, starts, ends = [], [], []
        for i, tc in enumerate(turn.get("tool_calls") or []):
            args = tc.get("arguments", {})
            args_s = args if isinstance(args, str) else orjson.dumps(args).decode()
            call = {"id": tc.get("id") or f"chatcmpl-tool-{uuid.uuid5(uuid.NAMESPACE_OID, key.decode() + str(i)).hex[:16]}",
                    "type": "function", "function": {"name": tc["name"], "arguments": args_s}}
            calls.append(call)
            sep = "\n" if (i or text or reasoning) else ""
            starts.append(len(pieces))
            payload = orjson.dumps({"name": tc["name"], "arguments": args}).decode()
            pieces += tok.pieces(f"{sep}<tool_call>\n{payload}\n</tool_call>", "markup")
            ends.append(len(pieces) - 1)
        finish = turn.get("finish_reason") or ("tool_calls" if calls else "stop")
        if finish != "length":
            pieces.append(tok.eos())
        reply = Reply(pieces, reasoning, text, calls, finish, starts, ends)
        if len(self.reply_cache) < 4096:
            self.reply_cache[key] = reply
        return reply

    def _logprobs(self, pieces: list[Piece], offset: int) -> dict[str, Any]:
        return {"content": [_lp_entry(p.token, p.token_id, offset + i) for i, p in enumerate(pieces)]}

    def whole(self, body, reply: Reply, pieces, finish, prompt_ids, want_ids, want_lp) -> dict[str, Any]:
        truncated = len(pieces) < len(reply.pieces)
        content = "".join(p.text for p in pieces if p.kind == "content")
        reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
        calls = [c for c, end in zip(reply.tool_calls, reply.tool_ends) if end < len(pieces)]
        finish = "length" if truncated else finish
        started = [i for i, s in enumerate(reply.tool_starts) if s < len(pieces)]
        if truncated and len(started) > len(calls):
            # vLLM's hermes parser on a cut answer: every started <tool_call> is read, the last
            # one up to the end of the text; if its JSON is whole, the answer reports the calls
            # and finish_reason "tool_calls" (although length cut it), else no call at all and
            # the raw text as content.
            cut = reply.tool_calls[started[-1]]
            try:
                orjson.loads(_call_json(pieces[reply.tool_starts[started[-1]]:]))
                whole_json = True
            except orjson.JSONDecodeError:
                whole_json = False
            if whole_json:
                calls = calls + [cut]
                finish = "tool_calls"
            else:
                calls = []
                content = "".join(p.text for p in pieces if p.kind in ("content", "markup")
                                  and not p.text.startswith("<think>"))
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None,
                                   "refusal": None, "annotations": None, "audio": None, "function_call": None,
                                   "reasoning": reasoning or None}
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message,
                  "logprobs": self._logprobs(pieces, 0) if want_lp else None,
                  "finish_reason": finish, "stop_reason": None,
                  "token_ids": [p.token_id for p in pieces] if want_ids else None, "routed_experts": None}
        resp = {
            "id": _request_id(), "object": "chat.completion", "created": int(time.time()),
            "model": self.served_model, "choices": [choice], "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + len(pieces),
                      "completion_tokens": len(pieces), "prompt_tokens_details": None,
                      "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_ids": prompt_ids if want_ids else None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }
        self.responses.append({"prompt_token_ids": prompt_ids, "token_ids": [p.token_id for p in pieces],
                               "logprobs": [token_logprob(p.token_id, i) for i, p in enumerate(pieces)],
                               "finish_reason": choice["finish_reason"]})
        return resp

    async def stream(self, request, body, reply: Reply, pieces, finish, prompt_ids, want_ids, want_lp, fault, delay,
                     burst: bool = False):
        headers = {"content-type": "text/event-stream; charset=utf-8"}
        resp: Any = _Burst(headers) if burst else web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
        rid, created = _request_id(), int(time.time())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.served_model,
                 "choices": choices, **extra}
            return b"data: " + orjson.dumps(d) + b"\n\n"

        first_extra = {"prompt_token_ids": prompt_ids if want_ids else None, "prompt_text": None}
        await resp.write(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], **first_extra))
        if fault == "hang_stream":
            await asyncio.sleep(3600)
        starts = {s: i for i, s in enumerate(reply.tool_starts)}
        ends = {e: i for i, e in enumerate(reply.tool_ends)}
        n = len(pieces)
        cut_at = n // 2 if fault == "cut" else -1
        # logged before the stream's first token leaves (a cut stream logs what it sent): a client
        # that has read the whole stream (a test comparing the capture with this log) must find it.
        # Logged after ``write_eof``, a loaded machine let the proxy finish and the test read the
        # previous response (the flake of test_two_turns_exact_tokens[openai_chat-stream-reverse]:
        # "14 more sampled ids than the upstream returned": the capture was right).
        if cut_at < 0:
            self.responses.append({"prompt_token_ids": prompt_ids, "token_ids": [p.token_id for p in pieces],
                                   "logprobs": [token_logprob(p.token_id, i) for i, p in enumerate(pieces)],
                                   "finish_reason": finish})
        open_call: int | None = None
        for i, p in enumerate(pieces):
            if i == cut_at:
                assert request.transport is not None
                request.transport.abort()
                self.responses.append({"prompt_token_ids": prompt_ids, "token_ids": [q.token_id for q in pieces[:i]],
                                       "finish_reason": None, "cut": True})
                return resp.response() if burst else resp
            delta: dict[str, Any] = {}
            if p.kind == "content":
                delta["content"] = p.text
            elif p.kind == "reasoning":
                delta["reasoning"] = p.text
            if i in starts:
                tc = reply.tool_calls[starts[i]]
                delta["tool_calls"] = [{"id": tc["id"], "type": "function", "index": starts[i],
                                        "function": {"name": tc["function"]["name"], "arguments": ""}}]
            if i in ends:
                tc = reply.tool_calls[ends[i]]
                delta.setdefault("tool_calls", []).append(
                    {"index": ends[i], "function": {"arguments": tc["function"]["arguments"]}})
            elif i == n - 1 and finish == "length" and open_call is not None:
                # cut by the budget inside a call: what vLLM streamed of its arguments so far
                partial = _partial_arguments(pieces[reply.tool_starts[open_call]:],
                                             reply.tool_calls[open_call]["function"]["arguments"])
                if partial:
                    delta.setdefault("tool_calls", []).append({"index": open_call, "function": {"arguments": partial}})
            if i in starts:
                open_call = starts[i]
            if i in ends:
                open_call = None
            c: dict[str, Any] = {"index": 0, "delta": delta,
                                 "logprobs": self._logprobs([p], i) if want_lp else None,
                                 "finish_reason": finish if i == n - 1 else None}
            if i == n - 1:
                c["stop_reason"] = None
            if want_ids:
                c["token_ids"] = [p.token_id]
            if delay:
                await asyncio.sleep(delay)
            extra = {"system_fingerprint": SYSTEM_FINGERPRINT} if i == n - 1 and not include_usage else {}
            await resp.write(chunk([c], **extra))
        if n == 0:
            await resp.write(chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish,
                                     "stop_reason": None, **({"token_ids": []} if want_ids else {})}]))
        if include_usage:
            usage = {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + n, "completion_tokens": n}
            await resp.write(chunk([], usage=usage, system_fingerprint=SYSTEM_FINGERPRINT))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp.response() if burst else resp


class _Burst:
    """Collects a stream's events; ``response()`` sends them with the head in one write."""

    def __init__(self, headers: dict[str, str]):
        self.headers, self.parts = headers, []

    async def prepare(self, request: web.Request) -> None:
        pass

    async def write(self, data: bytes) -> None:
        self.parts.append(data)

    async def write_eof(self) -> None:
        pass

    def response(self) -> web.Response:
        return web.Response(body=b"".join(self.parts), status=200, headers=self.headers)


def _partial_arguments(pieces: list[Piece], arguments: str) -> str:
    """What of a tool call's ``arguments`` the pieces (from its ``<tool_call>`` on) have generated."""
    text = "".join(p.text for p in pieces)
    at = text.find('"arguments":')
    if at < 0:
        return ""
    rest = text[at + len('"arguments":'):].lstrip(" ")
    return arguments[:min(len(rest), len(arguments))]


def _call_json(pieces: list[Piece]) -> str:
    """The JSON text after ``<tool_call>`` in the pieces of one (maybe cut) call."""
    text = "".join(p.text for p in pieces)
    return text.split("<tool_call>", 1)[-1].lstrip("\n").split("\n", 1)[0]


#: request fields besides the messages that change a rendering (as the proxy's ledger keys them)
_CONTEXT_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "documents", "reasoning_effort",
                   "add_special_tokens")


def _context(body: dict[str, Any]) -> bytes:
    return orjson.dumps({k: body.get(k) for k in _CONTEXT_FIELDS if body.get(k) not in (None, [], {})},
                        option=orjson.OPT_SORT_KEYS)


def _blake(data: bytes) -> bytes:
    import hashlib

    return hashlib.blake2b(data, digest_size=16).digest()


def _plain_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _same_answer(a: dict[str, Any], m: dict[str, Any]) -> bool:
    """Whether the re-sent assistant message ``m`` is the sampled answer ``a``: text, tool calls
    (name, parsed arguments; ids aside) and, when re-sent at all, reasoning."""
    if _plain_text(m.get("content")).strip() != a["content"].strip():
        return False
    calls = []
    for tc in m.get("tool_calls") or ():
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        try:
            args = orjson.loads(args) if isinstance(args, str) else args
        except orjson.JSONDecodeError:
            pass
        calls.append((fn.get("name"), args))
    if calls != a["calls"]:
        return False
    reasoning = _plain_text(m.get("reasoning") or m.get("reasoning_content")).strip()
    return not reasoning or reasoning == a["reasoning"].strip()


def _lp_entry(token: str, token_id: int, position: int) -> dict[str, Any]:
    return {"token": token, "logprob": token_logprob(token_id, position), "bytes": list(token.encode()),
            "top_logprobs": []}


def _request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:16]}"


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json", headers=headers)


def _error(status: int, message: str, typ: str, headers: dict[str, str] | None = None) -> web.Response:
    """vLLM's ErrorResponse shape."""
    return _json({"error": {"message": message, "type": typ, "param": None, "code": status}}, status, headers)


class ServerThread:
    """Run a ScriptedUpstream in a background thread (tests): ``with ServerThread() as s: s.url``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **kwargs: Any):
        self.host, self.port = host, port
        self.upstream = ScriptedUpstream(**kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="scripted-upstream", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("scripted upstream did not start")

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        # handler_cancellation: a hanging handler ends when the proxy gives up on it.
        runner = self._runner = web.AppRunner(self.upstream.app(), access_log=None, handle_signals=False,
                                              handler_cancellation=True, shutdown_timeout=0.5)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Scripted vLLM-compatible chat upstream for Polar tests/benchmarks.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default="scripted-model")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--tokenizer", default=None, help="HF directory whose chat template renders prompt ids")
    ap.add_argument("--script", default=None, help="JSON script: list of turns or {session: [turns]}")
    ap.add_argument("--reject-large-max-tokens", action="store_true",
                    help="refuse max_tokens above the room the prompt leaves, as older vLLM did (400)")
    args = ap.parse_args(argv)
    up = ScriptedUpstream(served_model=args.served_model_name, max_model_len=args.max_model_len,
                          tokenizer=args.tokenizer, script=Script.load(args.script),
                          reject_large_max_tokens=args.reject_large_max_tokens)
    web.run_app(up.app(), host=args.host, port=args.port, access_log=None, print=None,
                handler_cancellation=True, shutdown_timeout=0.5)


if __name__ == "__main__":
    main()
