"""Exact history, pure parts: the ledger's matching and splicing, and what a stream may send early."""

from __future__ import annotations

import asyncio
from array import array

from polar_proxy.exact_history import FeedReader, _must_hold, _safe_len
from polar_proxy.ledger import (ANSWER_CHANGED, Answer, Entry, Ledger, context_digest, message_digests, new_entry,
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
    return new_entry(index, context_digest(chat or {}), message_digests(messages), prompt, prompt, sampled, finish,
                     answer, exact=True)


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


def _record(i: int, messages: list[dict], prompt: list[int], sampled: list[int], text: str, **extra) -> dict:
    return {"record_type": "call", "status": "ok", "call_index": i, "finish_reason": "stop", "history": "exact",
            "stop_reason": None, "normalized_request": {"model": "m", "messages": messages},
            "prompt_token_ids": prompt, "sampled_token_ids": sampled, "output_text": text, **extra}


def test_a_rebuilt_ledger_keeps_the_stop_reason_the_model_and_the_mode() -> None:
    """After a restart: an answer that stopped on a stop string is closed with the end of turn (its
    last id is text); its last id never becomes an end-of-turn id; end-of-turn ids are per model;
    a record captured with exact history off is never ``exact``."""
    u1, a1, u2 = {"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}
    msgs = [u1, a1, u2]
    recs = [_record(0, [u1], [1, 2], [20, 21], "x", stop_reason="STOP")]
    ledger = Ledger(loader=lambda sid: recs)
    match = ledger.find("s", context_digest({"model": "m"}), msgs, message_digests(msgs))
    assert match.entry is not None and not match.entry.ends_with_eot
    assert ledger.eot("m") is None  # 21 is text, not an end of turn
    sp = splice(match, msgs, [1, 2, 30, EOT, 5], EOT)
    assert sp.ids == [1, 2, 20, 21, EOT, 5] and sp.history == "exact"
    # before stop_reason was recorded: the older flag still says so
    old = [_record(0, [u1], [1, 2], [20, 21], "x", history_stop_string=True)]
    del old[0]["stop_reason"]
    assert not Ledger(loader=lambda sid: old).find("s", context_digest({"model": "m"}), msgs,
                                                   message_digests(msgs)).entry.ends_with_eot
    # end-of-turn ids per model, learnt only where the stop reason is known to be a token
    both = [_record(0, [u1], [1], [20, EOT], "x"),
            {**_record(1, [u2], [1], [40, 7], "y"), "normalized_request": {"model": "other", "messages": [u2]}},
            {**_record(2, [u1, a1], [1], [50, 9], "z"), "history": None}]  # exact history off: unknown
    led = Ledger(loader=lambda sid: both)
    led.session("s")
    assert led.eot("m") == EOT and led.eot("other") == 7 and led.eot("") is None
    assert [e.exact for e in led.sessions["s"].entries] == [True, True, False]
    assert 9 not in led.eot_ids.get("m", {})
    # a spliced continuation of a mode-off record is labelled, never exact
    off = [{**_record(0, [u1], [1, 2], [20, EOT], "x"), "history": None}]
    m2 = Ledger(loader=lambda sid: off).find("s", context_digest({"model": "m"}), msgs, message_digests(msgs))
    sp = splice(m2, msgs, [1, 2, 30, EOT, 5], EOT)
    assert sp.ids == [1, 2, 20, EOT, 5] and sp.history == "spliced_at=2" and sp.cause == "earlier_history_rendered"


def test_entries_are_stored_as_their_difference_from_the_call_they_continue() -> None:
    """Memory linear in the session: each entry holds only the ids its call added."""
    ledger = Ledger()
    prompt, msgs = [1, 2, 3], [{"role": "user", "content": "u0"}]
    rnd = __import__("random").Random(0)
    for i in range(50):
        sampled = [rnd.randrange(10, 999) for _ in range(5)] + [EOT]
        ledger.add("s", new_entry(i, b"", message_digests(msgs), prompt, prompt, sampled, "stop",
                                  Answer("t", "", ()), exact=True))
        new = [rnd.randrange(10, 999) for _ in range(4)]
        msgs = msgs + [{"role": "assistant", "content": "t"}, {"role": "user", "content": f"u{i}"}]
        entries = ledger.sessions["s"].entries
        assert list(entries[-1].prompt_ids) == prompt and list(entries[-1].ids()) == prompt + sampled
        prompt = prompt + sampled + new
    entries = ledger.sessions["s"].entries
    held = sum(len(e.tail) + len(e.sampled_ids) for e in entries)
    assert held == len(entries[-1].ids())  # every id once (the last call's), not once per call


def test_the_rebuild_runs_off_the_event_loop_and_the_sessions_calls_wait_for_it() -> None:
    import threading
    import time

    from polar_proxy.exact_history import ExactHistory

    started = threading.Event()
    loads = []

    def slow_records(sid):
        loads.append(sid)
        started.set()
        time.sleep(0.3)  # parsing a long capture
        return [_record(0, [{"role": "user", "content": "a"}], [1, 2], [20, EOT], "x")]

    async def go() -> None:
        ex = ExactHistory(None)  # type: ignore[arg-type]
        ex.ledger.loader = slow_records
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        t = asyncio.get_running_loop().create_task(ticker())
        await asyncio.gather(ex.ensure_session("s"), ex.ensure_session("s"))  # two calls of one session
        t.cancel()
        assert loads == ["s"] and len(ex.ledger.sessions["s"].entries) == 1 and ex.ledger.rebuilt == 1
        assert ticks >= 20  # the loop went on during the 0.3 s rebuild (0 when it ran on the loop)

    asyncio.run(go())
