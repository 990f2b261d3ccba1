"""Exact-history streams of reasoning models, driven through ``_Ctx.stream`` with a generate stream
and a derender answer as vLLM sends them: reasoning goes out as reasoning while it is sampled,
text that may still be reasoning never goes out as answer, and the harness always gets the answer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson

from polar_proxy.accumulate import ChatAccumulator
from polar_proxy.exact_history import FeedReader, Pending, _Ctx, stream_view

OPEN, CLOSE = 151667, 151668  # Qwen3's <think> and </think>
BASE = "http://up"


class _Content:
    def __init__(self, events: list[bytes]):
        self.events = events

    async def iter_any(self):
        for e in self.events:
            yield e


class _Resp:
    def __init__(self, pieces: list[tuple[str, list[int]]], finish: str = "stop"):
        events = []
        for i, (text, ids) in enumerate(pieces):
            last = i == len(pieces) - 1
            choice = {"index": 0, "text": text, "token_ids": ids, "logprobs": None,
                      "finish_reason": finish if last else None, "stop_reason": None}
            events.append(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        self.content = _Content(events)

    def close(self) -> None:
        pass


class _Owner:
    """The parts of ``ExactHistory`` a stream uses; the derender answers ``message`` and notes what
    the harness had been sent by then."""

    def __init__(self, message: dict[str, Any], out: FeedReader):
        self.message, self.out = message, out
        self.think_ids = {BASE: (OPEN, CLOSE)}
        self.unmarked_reasoning: dict[str, bool] = {}
        self.pending: dict[str, Pending] = {}
        self.stats = {"derender_ms": 0.0}
        self.before_derender: ChatAccumulator | None = None

    async def _call(self, url: str, body: Any, timeout: Any, headers: Any) -> Any:
        assert url.endswith("/derender")
        self.before_derender = _accumulate(b"".join(self.out._chunks))
        return {"choices": [{"message": {"role": "assistant", **self.message}}]}


def _accumulate(raw: bytes) -> ChatAccumulator:
    acc = ChatAccumulator()
    for ev in raw.split(b"\n\n"):
        ev = ev.strip()
        if ev.startswith(b"data:") and ev[5:].strip() != b"[DONE]":
            acc.feed_chunk(orjson.loads(ev[5:]))
    return acc


def _run(prompt: list[int], pieces: list[tuple[str, list[int]]], message: dict[str, Any],
         tools: bool = False, unmarked_reasoning: bool = False) -> tuple[ChatAccumulator, _Owner, Any]:
    out = FeedReader()
    owner = _Owner(message, out)
    owner.unmarked_reasoning[BASE] = unmarked_reasoning
    rec = SimpleNamespace(call_id="c1", translation_notes=[])
    owner.pending["c1"] = Pending(b"", [], prompt)
    chat = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}
    if tools:
        chat["tools"] = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    ctx = _Ctx(owner, BASE, chat, rec, prompt, None, {})  # type: ignore[arg-type]

    async def go() -> bytes:
        await ctx.stream(_Resp(pieces), out)  # type: ignore[arg-type]
        return out.read_nowait()

    sent = asyncio.run(go())
    return _accumulate(sent), owner, rec


def test_a_template_that_opens_the_think_block_streams_reasoning_as_reasoning_and_the_answer() -> None:
    # DeepSeek-R1 distills, QwQ, Qwen3 Thinking-2507: the prompt ends "<|im_start|>assistant\n<think>\n"
    prompt = [1, 2, 3, OPEN, 198]
    pieces = [("Two plus", [10]), (" two is four.", [11, 12]), ("\n", [198]), ("</think>", [CLOSE]),
              ("\n\n", [271]), ("The answer", [13, 14]), (" is 4.", [15, 16]), ("", [151645])]
    derendered = {"reasoning": "Two plus two is four.\n", "content": "\n\nThe answer is 4."}
    acc, owner, rec = _run(prompt, pieces, derendered)
    assert "".join(acc.content) == "\n\nThe answer is 4."  # the harness gets the answer
    assert "".join(acc.reasoning) == "Two plus two is four.\n"
    assert not any("four" in c for c in acc.content)  # the reasoning never went out as answer
    assert not rec.translation_notes and not owner.pending["c1"].delivered_differs
    # and it streamed: reasoning and the start of the answer went out before the derender
    early = owner.before_derender
    assert early is not None and "".join(early.reasoning) == "Two plus two is four."
    assert "".join(early.content) == "\n\nThe answer is 4."


def test_qwen3_hybrid_streams_the_reasoning_the_model_opened_and_then_the_answer() -> None:
    prompt = [1, 2, 3]  # the model writes <think> itself
    pieces = [("<th", [60]), ("ink>", [61]), ("\nHmm,", [62]), (" let me see.", [63]), ("\n</think>\n\n", [64, CLOSE, 271]),
              ("Four", [65]), (".", [66])]
    derendered = {"reasoning": "\nHmm, let me see.\n", "content": "\n\nFour."}
    acc, owner, rec = _run(prompt, pieces, derendered)
    assert "".join(acc.reasoning) == "\nHmm, let me see.\n" and "".join(acc.content) == "\n\nFour."
    early = owner.before_derender
    assert "".join(early.reasoning) == "\nHmm, let me see." and "".join(early.content) == "\n\nFour."
    assert not any("<think>" in c or "Hmm" in c for c in acc.content)


def test_enable_thinking_false_closes_the_block_in_the_prompt_and_streams_the_answer() -> None:
    prompt = [1, OPEN, 271, CLOSE, 271]  # Qwen3 with enable_thinking=false: an empty think block
    acc, owner, _ = _run(prompt, [("Four", [65]), (".", [66])], {"content": "Four."})
    assert "".join(owner.before_derender.content) == "Four." and "".join(acc.content) == "Four."


def test_a_parser_that_disagrees_still_gets_the_answer_through_and_the_call_is_not_spliced() -> None:
    # the model never closed its reasoning; this parser calls it all content
    prompt = [1, 2, OPEN]
    acc, owner, rec = _run(prompt, [("Four", [65]), (".", [66])], {"reasoning": None, "content": "Four."})
    assert "".join(acc.reasoning) == "Four." and "".join(acc.content) == "Four."
    assert owner.pending["c1"].delivered_differs and "engine's text delivered" in rec.translation_notes[0]


VIDEO_PAD = 151656  # a special token: vLLM's streamed text leaves it out, the derendered answer keeps it


def test_a_special_token_mid_reasoning_is_not_delivered_twice() -> None:
    # measured with tiny-r1 under OpenCode: the streamed reasoning is not a prefix of the derendered
    # one; sending the derendered whole after it gave the harness 8,016 characters for 4,015
    prompt = [1, 2, OPEN]
    pieces = [("Two plus", [10]), ("", [VIDEO_PAD]), (" two.", [11]), ("</think>", [CLOSE]), ("Four.", [12])]
    derendered = {"reasoning": "Two plus<|video_pad|> two.", "content": "Four."}
    acc, owner, rec = _run(prompt, pieces, derendered)
    assert "".join(acc.reasoning) == "Two plus two."  # the engine's text, once
    assert "".join(acc.content) == "Four."
    assert owner.pending["c1"].delivered_differs and "reasoning differs" in rec.translation_notes[0]


def test_a_differing_field_gets_the_held_tail_of_the_engines_text() -> None:
    # cut at the token cap in the middle of what could have been "</think>": the stream held " <"
    # back; the harness still gets all of the engine's text, and nothing of it twice
    prompt = [1, 2, OPEN]
    pieces = [("Two plus", [10]), ("", [VIDEO_PAD]), (" two <", [11, 12])]
    derendered = {"reasoning": "Two plus<|video_pad|> two <", "content": None}
    acc, owner, _ = _run(prompt, pieces, derendered)
    assert "".join(owner.before_derender.reasoning) == "Two plus two"
    assert "".join(acc.reasoning) == "Two plus two <" and not "".join(acc.content)
    assert owner.pending["c1"].delivered_differs


def test_a_parser_that_takes_unmarked_text_as_reasoning_streams_it_as_reasoning() -> None:
    # vLLM's deepseek_r1 parser: text before </think> is reasoning whether or not <think> was written
    # (the proxy asks the server once per upstream); the R1 distill's template leaves <think> to the model
    for first in ("Hmm", "<think>\nHmm"):
        pieces = [(first, [70]), (", four.", [71]), ("</think>", [CLOSE]), ("Four.", [72])]
        derendered = {"reasoning": first.removeprefix("<think>") + ", four.", "content": "Four."}
        acc, owner, rec = _run([1, 2], pieces, derendered, unmarked_reasoning=True)
        assert "".join(owner.before_derender.reasoning) == derendered["reasoning"]
        assert "".join(acc.content) == "Four." and not rec.translation_notes, rec.translation_notes


def test_stream_view_holds_what_may_still_change_role() -> None:
    assert stream_view("", opened=False, tools=False) == ("", "")
    assert stream_view("  <thi", opened=False, tools=False) == ("", "")  # may become <think>
    assert stream_view("<think>abc</thi", opened=False, tools=False) == ("abc", "")
    assert stream_view("abc</think>\n\nHi <tool_", opened=True, tools=True) == ("abc", "\n\nHi")
    assert stream_view("abc</think>{\"name\"", opened=True, tools=True) == ("abc", "")  # a JSON tool call
    assert stream_view("Hello <think>x", opened=False, tools=False) == ("", "Hello")


def test_the_think_ids_and_the_parsers_reading_of_unmarked_text_are_asked_once_per_upstream() -> None:
    from polar_proxy.exact_history import ExactHistory

    class Server(ExactHistory):
        def __init__(self, vocab: dict[str, list[int]], parser_reasons: bool):
            super().__init__(None)  # type: ignore[arg-type]
            self.vocab, self.parser_reasons, self.paths = vocab, parser_reasons, []

        async def _call(self, url: str, body: Any, timeout: Any, headers: Any) -> Any:
            path = url.removeprefix(BASE)
            self.paths.append(path)
            if path == "/tokenize":
                return {"tokens": self.vocab[body["prompt"]]}
            key = "reasoning" if self.parser_reasons else "content"
            return {"choices": [{"message": {"role": "assistant", key: "ok"}}]}

    r1 = Server({"<think>": [OPEN], "</think>": [CLOSE], "ok": [562]}, parser_reasons=True)
    for _ in range(2):
        asyncio.run(r1._probe_think(BASE, "m", None, {}))
    assert r1.think_ids[BASE] == (OPEN, CLOSE) and r1.unmarked_reasoning[BASE] is True
    assert r1.paths == ["/tokenize", "/tokenize", "/tokenize", "/v1/chat/completions/derender"]  # once
    qwen3 = Server({"<think>": [OPEN], "</think>": [CLOSE], "ok": [562]}, parser_reasons=False)
    asyncio.run(qwen3._probe_think(BASE, "m", None, {}))
    assert qwen3.unmarked_reasoning[BASE] is False
    plain = Server({"<think>": [27, 26865, 29], "</think>": [522, 26865, 29]}, parser_reasons=False)  # Qwen2.5: no such ids
    asyncio.run(plain._probe_think(BASE, "m", None, {}))
    assert plain.think_ids[BASE] is None and plain.paths == ["/tokenize", "/tokenize"]
