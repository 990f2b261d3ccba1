"""Compaction: how a harness's long history becomes a summary, recognized from a call's messages.

Part of the small shared contract (polar_core): the proxy writes the Codex compaction texts below into the
requests it sends (a ``/v1/responses/compact`` call becomes a normal captured chat call ending in
``COMPACT_REQUEST``; a ``compaction`` input item comes back as a user message starting with
``COMPACT_SUMMARY_PREFIX``), and the drift report names the compaction from the same texts. The
other harnesses compact with a request of their own (a summary prompt, with ``tools`` present or
absent); their prompts are recognized by the phrases in ``HARNESS_SUMMARY_REQUESTS``.
"""

from __future__ import annotations

from typing import Any

#: The last user message of the summary call the proxy makes for Codex's ``/responses/compact``.
COMPACT_REQUEST = (
    "[polar compaction] The conversation above is about to be replaced by a summary. Write a "
    "concise handoff summary for yourself to continue the task: the goal, what has been done "
    "(files read or changed, commands run and their results), what is left, and any facts needed "
    "to finish. Answer with the summary only."
)
#: How the summary of a ``compaction`` item reaches the model in later calls.
COMPACT_SUMMARY_PREFIX = "[polar compaction] Summary of the earlier conversation:\n"
#: The proxy's own marker in a ``compaction`` item's ``encrypted_content`` (plain text follows).
COMPACT_ITEM_MARKER = "polar-compaction-v1:"

#: Phrases of the harnesses' own summary requests (the last user message of a compaction call).
HARNESS_SUMMARY_REQUESTS = (
    ("claude-code", "create a detailed summary of the conversation"),
    # Qwen Code 0.24: "First, reason in your <analysis> block. Then, produce the <state_snapshot> XML."
    ("qwen-code", "Then, produce the <state_snapshot> XML"),
    # Gemini CLI 0.61: "... First, reason in your scratchpad. Then, generate the updated <state_snapshot>.",
    # then a verification call "Critically evaluate the <state_snapshot> you just generated. ..."
    ("gemini-cli", "<state_snapshot>"),
    # OpenCode 1.18: "Here is the conversation so far: <conversation>...</conversation> Create a new
    # anchored summary from the conversation history ..." (with a prior summary: "... Construct a new
    # summary that combines both.")
    ("opencode", "Create a new anchored summary from the conversation history"),
    ("opencode", "Construct a new summary that combines both"),
    # Pi 0.73: "The messages above are a conversation to summarize. Create a structured context
    # checkpoint summary ..." (a later compaction: "... incorporate into the existing summary provided in
    # <previous-summary> tags"; a turn cut in two: "This is the PREFIX of a turn that was too large to keep")
    ("pi", "Create a structured context checkpoint summary"),
    ("pi", "incorporate into the existing summary provided in <previous-summary> tags"),
    ("pi", "This is the PREFIX of a turn that was too large to keep"),
    ("codex", "CONTEXT CHECKPOINT COMPACTION"),  # Codex's local compaction (a custom provider)
)


#: How the harnesses' own summaries come back at the start of a compacted history.
HARNESS_SUMMARY_PREFIXES = (
    ("codex", "Another language model started to solve this problem and produced a summary"),
    ("pi", "The conversation history before this point was compacted into the following summary"),
    ("claude-code", "This session is being continued from a previous conversation that ran out of context"),
    # OpenCode 1.18 `run`: [user "What did we do so far?", assistant <summary>, recent messages, user "Continue ..."]
    ("opencode", "Continue if you have next steps, or stop and ask for clarification if you are unsure how to proceed"),
    ("opencode", "<conversation-checkpoint>\nThe following is a summary and serialized record of earlier conversation"),
)


#: The model turn Gemini CLI and Qwen Code (its fork) put after the summary, a user message, when
#: their history restarts from it (Gemini CLI 0.61, Qwen Code 0.24).
HARNESS_SUMMARY_ACKS = (("gemini-cli/qwen-code", "Got it. Thanks for the additional context!"),)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def compaction_of(messages: list[dict[str, Any]] | None) -> str | None:
    """What kind of compaction a call's messages show, or None:

    ``summary call (<harness>)``: the call asks for a summary of its history;
    ``resumed from a summary (<harness>)``: the history starts again from a summary."""
    if not messages:
        return None
    last_user_at = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)
    last_user = messages[last_user_at] if last_user_at is not None else None
    for i, m in enumerate(messages):
        # an acknowledged summary: the history restarts from it (the summary, carrying the harness's
        # summary-request phrases, may be the last user message: it is not a summary call then)
        if i and m.get("role") == "assistant" and messages[i - 1].get("role") == "user":
            text = _text(m.get("content")).strip()
            for harness, ack in HARNESS_SUMMARY_ACKS:
                if text == ack:
                    return f"resumed from a summary ({harness})"
    if last_user is not None:
        text = _text(last_user.get("content"))
        if text.startswith(COMPACT_REQUEST[:40]):
            return "summary call (codex /responses/compact)"
        low = text.lower()
        for harness, phrase in HARNESS_SUMMARY_REQUESTS:
            if phrase.lower() in low:
                return f"summary call ({harness})"
    for m in messages:
        if m.get("role") != "user":
            continue
        text = _text(m.get("content"))
        if text.startswith(COMPACT_SUMMARY_PREFIX[:30]):
            return "resumed from a summary (codex compaction item)"
        for harness, prefix in HARNESS_SUMMARY_PREFIXES:
            if text.startswith(prefix):
                return f"resumed from a summary ({harness})"
    return None


#: Side calls that re-send the whole history without tools and are not compactions: Gemini CLI's
#: and Qwen Code's next-speaker check (``CHECK_PROMPT`` in both bundles) asks the model, with
#: ``responseMimeType: application/json``, who speaks next.
HARNESS_SIDE_CALLS = (
    ("gemini-cli/qwen-code next-speaker check", "Analyze *only* the content and structure of your immediately preceding response"),
)


def side_call_of(messages: list[dict[str, Any]] | None) -> str | None:
    """The kind of a known side call (its last user message holds the harness's phrase), or None."""
    last_user = next((m for m in reversed(messages or []) if m.get("role") == "user"), None)
    if last_user is None:
        return None
    text = _text(last_user.get("content"))
    return next((kind for kind, phrase in HARNESS_SIDE_CALLS if phrase in text), None)
