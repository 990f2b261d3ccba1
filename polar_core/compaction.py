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


#: Where a side call's phrase is looked for: the last user message, any user message, or a
#: system/developer message (the phrase of a title call is often in its system prompt, and its user
#: text is the conversation itself).
SIDE_CALL_PLACES = ("last user", "any user", "system")

#: The harnesses' own model calls that are not the agent's turn and not a compaction (titles, labels,
#: next-speaker and loop checks, recaps, suggestions, edit fixes): (kind, phrase, place). Each was read
#: from the installed harness named in its comment (``~/.cache/polar/harnesses``; the Bun binaries with
#: ``grep -a``). The trajectory builders leave them out of every sequence and count them by kind;
#: certify's capture check fails a run whose training data holds one. Several only fire in an
#: interactive session; they are listed so that a run which does send them is still labelled.
HARNESS_SIDE_CALLS = (
    # Gemini CLI 0.61 and Qwen Code 0.24 (``CHECK_PROMPT``): the whole history, no tools,
    # ``responseMimeType: application/json``, asks who speaks next
    ("gemini-cli/qwen-code next-speaker check", "Analyze *only* the content and structure of your immediately preceding response", "last user"),
    # OpenCode 1.18.33: the ``title`` agent on ``small_model`` (our model): system "You are a title
    # generator. ...", messages [user "Generate a title for this conversation:\n", the first user turn]
    ("opencode title", "You are a title generator. You output ONLY a thread title.", "system"),
    ("opencode title", "Generate a title for this conversation:", "any user"),
    # OpenCode 1.18.33: the desktop's project-copy name (``small_model``)
    ("opencode project name", "Generate a short 2-3 word name that describes this task:", "last user"),
    # OpenCode 1.18.33: the ``summary`` agent's prompt (defined; no caller found in this version)
    ("opencode session summary", "Summarize what was done in this conversation. Write like a pull request description.", "system"),
    # Claude Code 2.1.332 (querySource ``generate_session_title``): JSON {"title"}, session in <session>
    ("claude-code session title", "You are naming a coding session so the user can pick it out of a long list of sessions.", "system"),
    # Claude Code 2.1.332 (``tool_use_summary_generation``) and Qwen Code 0.24 (``TOOL_USE_SUMMARY_SYSTEM_PROMPT``)
    ("claude-code/qwen-code tool-use summary label", "Write a short summary label describing what these tool calls accomplished.", "system"),
    # Claude Code 2.1.332 (``prompt_suggestion``) and Qwen Code 0.24 (``SUGGESTION_PROMPT``)
    ("claude-code/qwen-code prompt suggestion", "[SUGGESTION MODE: Suggest what the user might naturally type next", "last user"),
    # Claude Code 2.1.332 (``agent_summary``): a background agent's progress label, forked from its history
    ("claude-code agent progress label", "most recent action in 3-5 words using present tense", "last user"),
    # Claude Code 2.1.332 (``away_summary``): a recap forked from the history
    ("claude-code away recap", "The user stepped away and is coming back. Recap in under 40 words", "last user"),
    # Qwen Code 0.24 (``TITLE_SYSTEM_PROMPT``, ``RECAP_SYSTEM_PROMPT``)
    ("qwen-code session title", "Generate a concise, sentence-case title (3-7 words) that captures what this programming-assistant session is about", "system"),
    ("qwen-code session recap", "You generate session recaps for a programming assistant CLI.", "system"),
    # Gemini CLI 0.61 (LlmRole ``utility_loop_detector``, ``LOOP_DETECTION_SYSTEM_PROMPT``)
    ("gemini-cli loop check", "You are a diagnostic agent that determines whether a conversational AI assistant is stuck in an unproductive loop.", "system"),
    # Gemini CLI 0.61 (``utility_edit_corrector``: ``EDIT_SYS_PROMPT``, ``CODE_CORRECTION_SYSTEM_PROMPT``)
    ("gemini-cli edit fix", "You are an expert code-editing assistant specializing in debugging and correcting failed search-and-replace operations.", "system"),
    ("gemini-cli edit fix", "You are an expert code-editing assistant. Your task is to analyze a failed edit attempt", "system"),
    # Gemini CLI 0.61 (``utility_summarizer``: ``SUMMARIZE_TOOL_OUTPUT_PROMPT``; ``session-summary-generation``;
    # ``utility_router``: ``CLASSIFIER_SYSTEM_PROMPT``)
    ("gemini-cli tool-output summary", "Summarize the following tool output to be a maximum of", "last user"),
    ("gemini-cli session summary", "Summarize the user's primary intent or goal in this conversation in ONE sentence", "last user"),
    ("gemini-cli model router", "You are a specialized Task Routing AI.", "system"),
    # Pi 0.73.1 (``branch-summarization.js``): a summary of the branch left in tree navigation, not a compaction
    ("pi branch summary", "Create a structured summary of this conversation branch for context when returning later.", "last user"),
    # Codex 0.171.0 (TUI thread titles): "Generate a concise, single-line task title of at most N characters ..."
    ("codex thread title", "Generate a concise, single-line task title of at most", "system"),
    ("codex thread title", "Generate a concise, single-line task title of at most", "last user"),
)
assert all(place in SIDE_CALL_PLACES for _, _, place in HARNESS_SIDE_CALLS)
# the builders look for the phrases in the request's JSON text first: none may need escaping there
assert all(p.isascii() and p.isprintable() and not set(p) & set('"\\/') for _, p, _ in HARNESS_SIDE_CALLS)


def side_call_of(messages: list[dict[str, Any]] | None) -> str | None:
    """The kind of a known harness side call (``HARNESS_SIDE_CALLS``: its phrase in the last user
    message, any user message or a system message, as the entry says), or None."""
    msgs = [m for m in (messages or []) if isinstance(m, dict)]
    users = [_text(m.get("content")) for m in msgs if m.get("role") == "user"]
    texts = {
        "last user": users[-1:],
        "any user": users,
        "system": [_text(m.get("content")) for m in msgs if m.get("role") in ("system", "developer")],
    }
    for kind, phrase, place in HARNESS_SIDE_CALLS:
        if any(phrase in t for t in texts[place]):
            return kind
    return None
