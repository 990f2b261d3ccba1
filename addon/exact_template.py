"""Exact history's questions to the server: its token-in/token-out endpoints (vLLM 0.32's render,
generate and derender, under ``--enable-scale-out``) and what its chat template does, asked by
rendering probes rather than guessed from the model's name.

* ``_probe_eot``: the id the template closes an assistant turn with (a ``length``-cut answer has
  not sampled it, and the next call's prompt needs it);
* ``_probe_think``: the single ids of ``<think>``/``</think>`` and whether the server's reasoning
  parser takes text without markers as reasoning (a stream must know both before its first byte);
* ``_drops_reasoning``: whether the template renders a re-sent answer the same with and without its
  reasoning (then the model is prompted with the rendering: ``exact_splice.follow_template``).

Each answer is kept per upstream URL; a failed question answers "unknown", never an error to the
harness. ``TemplateQuestions`` is a mixin of ``ExactHistory`` (``exact_history.py``), which owns
the HTTP session and the per-upstream caches these methods fill.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from . import jsonutil

RENDER_PATH = "/v1/chat/completions/render"
GENERATE_PATH = "/inference/v1/generate"
DERENDER_PATH = "/v1/chat/completions/derender"
SCALE_OUT_HINT = ("polar_exact_history needs vLLM's render/generate/derender endpoints: "
                  "start vLLM 0.32+ with --enable-scale-out (polar serve --exact-history)")


class ExactError(Exception):
    """The upstream answered a step with an error: (status, body) go to the harness as usual."""

    def __init__(self, status: int, body: bytes, step: str = ""):
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body
        self.step = step


class TemplateQuestions:
    """Asked of the server (see the module docstring); the owner provides ``http``,
    ``probed_eot``, ``think_ids`` and ``unmarked_reasoning``."""

    http: aiohttp.ClientSession
    probed_eot: dict[str, int | None]
    think_ids: dict[str, tuple[int, int] | None]
    unmarked_reasoning: dict[str, bool]

    async def _call(self, url: str, body: Any, timeout: Any, headers: dict[str, str]) -> Any:
        async with self.http.post(url, data=jsonutil.dumps(body), timeout=timeout,
                                  headers={"content-type": "application/json", **headers}) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise ExactError(resp.status, raw, urlsplit(url).path)
        return orjson.loads(raw)

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
