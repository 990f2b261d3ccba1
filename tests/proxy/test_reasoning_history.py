"""Exact history follows the template about reasoning: sampled ids where it keeps a turn's reasoning,
its rendering (labelled) where it drops it, and Qwen3's empty think block (enable_thinking=false)
no longer failing the prefix check of every call."""

from __future__ import annotations

from polar_proxy.exact_history import TEMPLATE_DROPPED_REASONING, follow_template, without_empty_think
from polar_proxy.ledger import TEMPLATE_NOT_PREFIX, Answer, Ledger, context_digest, message_digests, new_entry, splice

OPEN, CLOSE, EOS, U, A, NL = 151667, 151668, 151645, 7, 8, 271
THINK = (OPEN, CLOSE)
USER = {"role": "user", "content": "2+2?"}
ANSWER = {"role": "assistant", "content": "Four.", "reasoning_content": "two and two"}


def _ledger(prompt: list[int], rendered: list[int], sampled: list[int], answer: dict) -> Ledger:
    ledger = Ledger()
    ledger.add("s", new_entry(0, context_digest({}), message_digests([USER]), prompt, rendered, sampled, "stop",
                              Answer.from_message(answer), exact=True))
    return ledger


def _next(ledger: Ledger, messages: list[dict], rendered: list[int]):
    match = ledger.find("s", context_digest({}), messages, message_digests(messages))
    return match, splice(match, messages, rendered, EOS)


def test_a_template_that_drops_the_reasoning_gets_its_rendering_and_the_record_says_so() -> None:
    # DeepSeek-R1 distills: every earlier answer is rendered as its content alone
    prompt = [1, U, 10, A]
    ledger = _ledger(prompt, prompt, [OPEN, 50, CLOSE, 60, EOS], ANSWER)
    msgs = [USER, ANSWER, {"role": "user", "content": "and 3+3?"}]
    rendered = prompt + [60, EOS, U, 11, A]
    match, sp = _next(ledger, msgs, rendered)
    assert sp.history == "exact" and OPEN in sp.ids  # the splice alone would keep the reasoning
    # the server rendered the conversation the same with and without the answer's reasoning
    out = follow_template(sp, match.entry, rendered, THINK, dropped=True)
    assert out.ids == rendered and out.history == "spliced_at=1" and out.cause == TEMPLATE_DROPPED_REASONING
    assert out.matched_call == 0


def test_a_template_that_keeps_the_reasoning_gets_the_sampled_ids() -> None:
    # Qwen3 after the last user message (a tool result follows): the turn is rendered with its reasoning
    prompt = [U, 10, A]
    sampled = [OPEN, 50, CLOSE, NL, 60, EOS]
    ledger = _ledger(prompt, prompt, sampled, ANSWER)
    msgs = [USER, ANSWER, {"role": "tool", "content": "ok"}]
    rendered = prompt + [OPEN, 52, 53, CLOSE, NL, 60, EOS, 9, 12, A]  # re-tokenized differently
    match, sp = _next(ledger, msgs, rendered)
    out = follow_template(sp, match.entry, rendered, THINK, dropped=False)
    assert out is sp and out.history == "exact" and out.ids == prompt + sampled + [9, 12, A]


def test_a_failed_prefix_check_where_the_template_dropped_kept_reasoning_is_named() -> None:
    # Qwen3: a new user message; the reasoning kept in the last call's prompt is dropped now
    u2 = {"role": "user", "content": "more"}
    a2 = {"role": "assistant", "content": "Six."}
    ledger = Ledger()
    ledger.add("s", new_entry(1, context_digest({}), message_digests([USER, ANSWER, u2]),
                              [U, 10, A, OPEN, 50, CLOSE, 60, EOS, U, 11, A], [U, 10, A, OPEN, 51, CLOSE, 60, EOS, U, 11, A],
                              [70, EOS], "stop", Answer.from_message(a2), exact=True))
    msgs = [USER, ANSWER, u2, a2, {"role": "user", "content": "bye"}]
    rendered = [U, 10, A, 60, EOS, U, 11, A, 70, EOS, U, 12, A]
    match, sp = _next(ledger, msgs, rendered)
    assert sp.history == "rendered" and sp.cause == TEMPLATE_NOT_PREFIX
    out = follow_template(sp, match.entry, rendered, THINK)
    assert out.ids == rendered and out.history == "rendered" and out.cause == TEMPLATE_DROPPED_REASONING


def test_enable_thinking_false_passes_the_prefix_check() -> None:
    # Qwen3 with enable_thinking=false: the generation prompt ends with an empty think block that the
    # template leaves out when it re-renders the answer
    prompt = [U, 10, A, OPEN, NL, CLOSE, NL]
    assert without_empty_think(prompt, THINK) == [U, 10, A]
    assert without_empty_think([U, 10, A, OPEN, NL], THINK) == [U, 10, A, OPEN, NL]  # opened: the model thinks
    answer = {"role": "assistant", "content": "Four."}
    msgs = [USER, answer, {"role": "user", "content": "more"}]
    rendered = [U, 10, A, 60, EOS, U, 11, A, OPEN, NL, CLOSE, NL]
    _match, plain = _next(_ledger(prompt, prompt, [60, EOS], answer), msgs, rendered)
    assert plain.cause == TEMPLATE_NOT_PREFIX  # what every call got
    match, sp = _next(_ledger(prompt, without_empty_think(prompt, THINK), [60, EOS], answer), msgs, rendered)
    assert sp.history == "exact" and sp.ids == prompt + [60, EOS, U, 11, A, OPEN, NL, CLOSE, NL]
    assert follow_template(sp, match.entry, rendered, THINK) is sp


def test_the_server_is_asked_whether_its_template_drops_the_reasoning() -> None:
    import asyncio

    from polar_proxy.exact_history import ExactError, ExactHistory

    class Server(ExactHistory):
        def __init__(self, keeps: bool | None):
            super().__init__(None)  # type: ignore[arg-type]
            self.keeps = keeps

        async def _call(self, url: str, body, timeout, headers):
            if self.keeps is None:
                raise ExactError(400, b"no")
            answer = body["messages"][1]
            # like vLLM: the assistant message's "reasoning" reaches the template
            return {"token_ids": [1, 2] + ([3] if self.keeps and answer.get("reasoning") else [])}

    entry = _ledger([U], [U], [OPEN, 50, CLOSE, 60, EOS], ANSWER).sessions["s"].entries[0]
    chat = {"model": "m", "messages": [USER, ANSWER, {"role": "user", "content": "more"}]}
    ask = lambda keeps: asyncio.run(Server(keeps)._drops_reasoning("http://up", chat, entry, None, {}))  # noqa: E731
    assert ask(True) is False and ask(False) is True and ask(None) is None
