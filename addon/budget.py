"""The output budget of a call: what ``max_tokens`` the engine is sent, and how to tell that the
budget (not the model) ended an answer.

The proxy never guesses the prompt length. A harness's own limit (or ``polar_max_tokens_cap``)
is sent as asked; a limit of the whole context or more (Claude Code asks 32k-128k, Codex and
Gemini CLI ask nothing) is left out, and the engine uses the room its real prompt leaves
(vLLM: ``max_model_len - prompt_len``; current vLLM also clamps a larger ``max_tokens`` to that
room). Older vLLM refuses a ``max_tokens`` above the room with a 400 that names the prompt length:
the core then retries once with exactly that room (``room_from_error``).

A byte-based estimate (``body_bytes / 4``) overshot near the limit on digit-, JSON- and code-heavy
prompts (fewer than 4 bytes a token), and the harness was told its prompt was too long.
"""

from __future__ import annotations

import re
from typing import Any

#: Older vLLM (and its forks): "'max_tokens' or 'max_completion_tokens' is too large: 3000. This
#: model's maximum context length is 4096 tokens and your request has 3500 input tokens
#: (3000 > 4096 - 3500)."
_TOO_LARGE = re.compile(
    r"max_(?:completion_)?tokens'?.{0,60}?too large: (?P<asked>\d+).*?maximum context length is "
    r"(?P<max>\d+) tokens and your request has (?P<prompt>\d+) input tokens",
    re.S,
)


def output_budget(requested: Any, cap: int, max_model_len: int | None) -> int | None:
    """``max_tokens`` to send: the smaller of the harness's limit and the cap, or None (leave it
    out: the engine's default is the room the real prompt leaves) when there is no limit or the
    limit is at least the whole context."""
    limits = []
    if requested:
        limits.append(int(requested))
    if cap:
        limits.append(cap)
    if not limits:
        return None
    budget = max(1, min(limits))
    if max_model_len and budget >= max_model_len:
        return None
    return budget


def room_from_error(message: str) -> tuple[int, int] | None:
    """(room left for output, prompt tokens) from an engine's "max_tokens is too large" answer,
    or None when the message is something else (or the prompt alone fills the context)."""
    m = _TOO_LARGE.search(message)
    if not m:
        return None
    room = int(m.group("max")) - int(m.group("prompt"))
    return (room, int(m.group("prompt"))) if room >= 1 else None


def is_budget_error(message: str) -> bool:
    """An output-budget refusal (not a prompt that is too long by itself)."""
    return _TOO_LARGE.search(message) is not None


def effective_budget(sent: int | None, max_model_len: int | None, prompt_tokens: int) -> int | None:
    """The number of tokens the engine could sample for this call."""
    room = max_model_len - prompt_tokens if max_model_len and prompt_tokens else None
    if sent is None:
        return room
    return sent if room is None else min(sent, room)


def budget_cut(finish_reason: Any, sampled: int, budget: int | None) -> bool:
    """True when the budget ended the answer although the engine reports a finished tool call:
    vLLM's non-streaming answer says ``tool_calls`` whenever its parser found a call, even one
    that ``length`` cut (the parser may still read a half-written call)."""
    return finish_reason == "tool_calls" and budget is not None and sampled >= budget


def mark_cut(call: Any, answer: dict[str, Any]) -> None:
    """A tool call that the output budget cut is not a finished tool call: report ``length`` in
    ``answer`` (a whole chat.completion or a stream chunk, after the engine adapter read its ids)."""
    for choice in answer.get("choices") or ():
        if choice.get("finish_reason") == "tool_calls" and choice.get("index", 0) == 0:
            up = call.upstream
            limit = effective_budget(call.max_tokens_sent, up.max_model_len if up else None,
                                     len(call.tokens.prompt_token_ids))
            if budget_cut("tool_calls", len(call.tokens.sampled_token_ids), limit):
                choice["finish_reason"] = "length"
                call.record.translation_notes.append("tool call cut by the output budget: finish_reason length")
