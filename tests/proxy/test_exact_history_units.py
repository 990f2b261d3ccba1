"""Exact history, pure parts: the ledger's matching and splicing, and what a stream may send early."""

from __future__ import annotations

import asyncio
from array import array

from polar_proxy.exact_history import FeedReader, _must_hold, _safe_len
from polar_proxy.ledger import (ANSWER_CHANGED, Answer, Entry, Ledger, context_digest, message_digests,
                                rendered_diff, rendered_from_diff, splice)

EOT = 2


def test_stream_holds_back_what_may_become_a_tool_call_or_markup() -> None:
    assert not _must_hold("Sure, I will", tools=True)
    assert _must_hold("  {\"name\": \"bash\"", tools=True)  # the lenient parser's JSON tool call
    assert _must_hold("```json\n{", tools=True)
    assert not _must_hold("{not a tool", tools=False)  # no tools: JSON is just text
    assert _must_hold("Let me run it.\n<tool_call>", tools=True)
    assert _safe_len("Let me run it.\n<tool_") == len("Let me run it.\n")  # a marker may be starting
    assert _safe_len("a < b") == len("a < b")


def test_rendered_diff_round_trips() -> None:
    assert rendered_diff([1, 2, 3], [1, 2, 3]) is None
    d = rendered_diff([1, 2, 3, 4], [1, 2, 9])
    assert d == {"common_prefix": 2, "rendered_tail": [9], "rendered_len": 3}
    assert rendered_from_diff([1, 2, 3, 4], d) == [1, 2, 9]


def _entry(index: int, messages: list[dict], prompt: list[int], sampled: list[int], answer: Answer,
           chat: dict | None = None, finish: str = "stop") -> Entry:
    return Entry(index, context_digest(chat or {}), message_digests(messages), array("i", prompt), array("i", prompt),
                 array("i", sampled), finish, finish != "length", answer, True)


def test_splice_takes_the_sampled_ids_and_the_rendered_tail() -> None:
    m1 = [{"role": "user", "content": "hi"}]
    ans = {"role": "assistant", "content": "hello"}
    m2 = m1 + [ans, {"role": "user", "content": "more"}]
    ledger = Ledger()
    # prompt [10, 11] rendered; sampled [50, 51, EOT]; the template renders the answer as [60, EOT, 7]
    ledger.add("s", _entry(0, m1, [10, 11], [50, 51, EOT], Answer.from_message(ans)))
    rendered = [10, 11, 60, EOT, 7, 12, 13]
    match = ledger.find("s", context_digest({}), m2, message_digests(m2))
    sp = splice(match, m2, rendered, EOT)
    assert sp.history == "exact" and sp.ids == [10, 11, 50, 51, EOT, 7, 12, 13]
    # truncated: closed with the end-of-turn id
    ledger2 = Ledger()
    ledger2.add("s", _entry(0, m1, [10, 11], [50, 51], Answer.from_message(ans), finish="length"))
    sp = splice(ledger2.find("s", context_digest({}), m2, message_digests(m2)), m2, rendered, EOT)
    assert sp.ids == [10, 11, 50, 51, EOT, 7, 12, 13]
    # other tools: not spliced
    other = ledger.find("s", context_digest({"tools": [{"type": "function"}]}), m2, message_digests(m2))
    assert other.entry is None and other.cause == "context_changed"


def test_an_edited_later_answer_splices_only_up_to_the_last_match() -> None:
    u1, a1 = {"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}
    u2, a2 = {"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}
    ledger = Ledger()
    ledger.add("s", _entry(0, [u1], [1], [20, EOT], Answer.from_message(a1)))
    ledger.add("s", _entry(1, [u1, a1, u2], [1, 20, EOT, 5], [30, EOT], Answer.from_message(a2)))
    edited = {"role": "assistant", "content": "y, edited"}
    msgs = [u1, a1, u2, edited, {"role": "user", "content": "c"}]
    match = ledger.find("s", context_digest({}), msgs, message_digests(msgs))
    assert match.entry is not None and match.entry.call_index == 0 and match.cause == ANSWER_CHANGED
    sp = splice(match, msgs, [1, 21, EOT, 5, 31, 32, EOT, 6], EOT)
    assert sp.history == "spliced_at=2" and sp.ids == [1, 20, EOT, 5, 31, 32, EOT, 6]


def test_feed_reader_serves_the_relay() -> None:
    async def go() -> None:
        r = FeedReader()
        r.feed(b"a")
        assert r.read_nowait() == b"a" and not r.at_eof()
        later = asyncio.get_running_loop().call_later(0.01, lambda: (r.feed(b"b"), r.feed_eof()))
        assert await r.readany() == b"b" and r.at_eof() and await r.readany() == b""
        later.cancel()

    asyncio.run(go())


def test_an_answer_that_stopped_on_another_stop_id_is_still_spliced() -> None:
    """Qwen2.5 sometimes ends an answer on <|endoftext|>, which vLLM also stops on, while the
    template closes the re-rendered answer with <|im_end|>: the rendered tail starts after the
    template's end of turn, and the model keeps the id it sampled (seen live: 2 of 208 calls of a
    0.5B Pi run fell back to the rendered history)."""
    other_stop = 3
    m1 = [{"role": "user", "content": "hi"}]
    ans = {"role": "assistant", "content": "hello"}
    m2 = m1 + [ans, {"role": "user", "content": "more"}]
    ledger = Ledger()
    ledger.add("s", _entry(0, m1, [10, 11], [50, 51, other_stop], Answer.from_message(ans)))
    rendered = [10, 11, 60, EOT, 7, 12, 13]
    match = ledger.find("s", context_digest({}), m2, message_digests(m2))
    sp = splice(match, m2, rendered, EOT)
    assert sp.history == "exact" and sp.ids == [10, 11, 50, 51, other_stop, 7, 12, 13]
    # without knowing the template's end of turn, it cannot be spliced: a labelled fallback
    sp = splice(match, m2, rendered, None)
    assert sp.history == "rendered" and sp.detail.startswith("no end of turn") and sp.ids == rendered


def test_arguments_re_sent_with_the_same_numbers_are_the_same_answer() -> None:
    """A JavaScript harness re-sends the model's ``"timeout": 3.0`` as ``3`` (one JSON number); a
    boolean for a number, or another value, is a changed answer."""
    def answer(args: str) -> Answer:
        return Answer.from_message({"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": args}}]})

    sampled = answer('{"command": "mkdir build", "timeout": 3.0, "opts": [1.0, 2.5]}')
    assert answer('{"timeout":3,"command":"mkdir build","opts":[1,2.5]}') == sampled
    assert answer('{"command": "mkdir build", "timeout": 3.5, "opts": [1, 2.5]}') != sampled
    assert answer('{"command": "mkdir build", "timeout": true, "opts": [1, 2.5]}') != answer(
        '{"command": "mkdir build", "timeout": 1, "opts": [1, 2.5]}')


def test_common_prefix_finds_the_first_difference_anywhere() -> None:
    import random

    from polar_proxy.ledger import common_prefix

    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = list(a[: rng.randrange(0, len(a) + 1)]) + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == want == common_prefix(b, a), (a, b)
