"""Drift between the turns of a session: why call N+1's prompt is not call N's prompt + sampled ids.

For every call the report names its predecessor (the earlier call of the same session whose
conversation it continues, with the longest common prompt prefix — so sub-agents are compared
with their own previous turn) and classifies the difference, using both the token ids and the
normalized requests' messages:

- ``none``: previous prompt + sampled ids are a prefix of the next prompt (prefix merge is exact);
- ``retokenized``: the answer came back as the same text with other ids (``[fish, ing]`` vs
  ``[fishing]``);
- ``tool_args_reserialized``: a tool call came back with the same arguments, serialized
  differently (key order, whitespace);
- ``tool_call_rerendered``: the model wrote its tool call in a form of its own (Markdown JSON,
  other tags) that the engine's tool parser read; the history renders the same call in the chat
  template's form;
- ``reasoning_removed`` / ``reasoning_changed``: the sampled reasoning (think text) is missing or
  different in the history;
- ``template_dropped_reasoning``: exact-history mode prompted the call with the chat template's
  rendering of an earlier answer whose reasoning the template drops (the proxy's
  ``history_cause``): the model never saw its sampled reasoning in this context (Qwen3-family and
  DeepSeek-R1 templates drop earlier ``<think>`` blocks);
- ``template_not_prefix``: exact-history mode prompted the call with the template's rendering of
  the whole history, because the template no longer renders the earlier prompt as a prefix (the
  proxy's ``history_cause``; DeepSeek-R1's tool markup is plain text, so the end of a tool result
  re-tokenizes with the answer after it);
- ``length_turn``: a ``finish_reason=length`` answer (often empty content) came back differently;
- ``answer_dropped``: the history does not contain the previous answer at all;
- ``empty_think_generation_prompt``: the previous prompt ended with an empty
  ``<think>\\n\\n</think>\\n\\n`` that the history rendering does not repeat (Qwen3,
  ``enable_thinking=false``); ``generation_prompt_changed`` for other generation-prompt tails;
- ``tool_call_edited``: the harness re-sent the model's tool call with arguments it added, every
  sampled one unchanged (Claude Code fills in Edit's ``"replace_all": false``): a harness edit;
- ``tool_result_reformatted``: an earlier tool result is rendered differently (string vs parts);
- ``system_changed``: the system prompt differs (e.g. Claude Code's per-request billing header);
- ``compacted``: the context was compacted or truncated (a summary call with ``tools=[]``, or a
  shorter history); also a harness's summary request appended to the history it summarizes (its
  prompt continues the previous one: ``exact`` stays what the ids say, ``detail`` names the cause
  it would have had);
- ``tools_changed``: a different tools list;
- ``new_conversation``: no earlier call of the session is continued (first call, sub-agent start);
- ``other``: anything else (details in ``detail``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import polars as pl

from polar_core.compaction import compaction_of, side_call_of
from polar_analysis.trajectories.common import (
    TEMPLATE_DROPPED_REASONING,
    TEMPLATE_RERENDERED,
    Call,
    TemplateInfo,
    by_session,
    canonical_answer,
    collect_calls,
    continues,
    infer_template_info,
    is_prefix,
    lcp,
    message_text,
)

CAUSES = (
    "none",
    "retokenized",
    "tool_args_reserialized",
    "tool_call_rerendered",
    "reasoning_removed",
    "reasoning_changed",
    "template_dropped_reasoning",
    "template_not_prefix",
    "length_turn",
    "answer_dropped",
    "empty_think_generation_prompt",
    "generation_prompt_changed",
    "tool_result_reformatted",
    "user_turn_edited",
    "tool_call_edited",
    "system_changed",
    "compacted",
    "tools_changed",
    "new_conversation",
    "other",
)

#: Who changed the history, per cause. ``rerendered``: the harness re-sent its answer unchanged
#: (same text, same tool call) and only its tokens differ, because the chat template renders the
#: text again (other ids, another tool-call form, reasoning stripped, a different generation-prompt
#: tail): exact-history mode removes these. ``harness``: the harness itself sent a different
#: history (dropped or changed an answer, reformatted a tool result, another system prompt or tool
#: list, a compaction): no engine can undo these, and exact mode splices only up to them.
ORIGIN = {
    "none": "exact",
    "retokenized": "rerendered",
    "tool_args_reserialized": "rerendered",
    "tool_call_rerendered": "rerendered",
    "reasoning_removed": "rerendered",
    "template_dropped_reasoning": "rerendered",
    "template_not_prefix": "rerendered",
    "length_turn": "rerendered",
    "empty_think_generation_prompt": "rerendered",
    "generation_prompt_changed": "rerendered",
    "reasoning_changed": "harness",
    "answer_dropped": "harness",
    "tool_result_reformatted": "harness",
    "user_turn_edited": "harness",
    "tool_call_edited": "harness",
    "system_changed": "harness",
    "compacted": "harness",
    "tools_changed": "harness",
    "new_conversation": "start",
    "other": "other",
}
ORIGINS = ("exact", "rerendered", "harness", "start", "other")

DRIFT_SCHEMA = {
    "session_id": pl.String,
    "call_id": pl.String,
    "call_index": pl.Int32,
    "prev_call_id": pl.String,
    "prev_call_index": pl.Int32,
    "cause": pl.String,
    "origin": pl.String,  # ORIGIN[cause]: exact, rerendered (by the template), harness (edited), start, other
    "exact": pl.Boolean,
    "prompt_divergence": pl.Int64,  # first index where the next prompt leaves the previous prompt (null: prefix)
    "answer_divergence": pl.Int64,  # first index in the sampled ids the next prompt does not repeat (null: none)
    "common_prefix": pl.Int64,  # common prefix of the two prompts, in ids
    "prev_text": pl.String,  # decoded window at the divergence, previous prompt + sampled side
    "next_text": pl.String,  # the same window in the next prompt
    "detail": pl.String,
}


@dataclass
class Drift:
    cause: str
    prompt_divergence: int | None = None
    answer_divergence: int | None = None
    common_prefix: int = 0
    prev_text: str | None = None
    next_text: str | None = None
    detail: str | None = None

    @property
    def exact(self) -> bool:
        return self.cause == "none"


# ------------------------------------------------------------------------------------------------
# message-level views
# ------------------------------------------------------------------------------------------------
def _messages(call: Call) -> list[dict[str, Any]] | None:
    req = call.request
    if not req or not isinstance(req.get("messages"), list):
        return None
    return [m for m in req["messages"] if isinstance(m, dict)]


def _system_text(msgs: list[dict[str, Any]]) -> str:
    return "\n".join(message_text(m.get("content")) for m in msgs if m.get("role") in ("system", "developer"))


def _turns(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in msgs if m.get("role") not in ("system", "developer")]


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _tool_calls(m: dict[str, Any]) -> list[tuple[str, Any, str]]:
    out = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or tc
        raw = fn.get("arguments")
        out.append((fn.get("name"), _args(raw), raw if isinstance(raw, str) else json.dumps(raw)))
    return out


def _same_tool_calls(got: list[dict[str, Any]] | None, answer_msg: dict[str, Any]) -> bool:
    """The calls the engine parsed from the answer are the ones the history sends back."""
    sent = _tool_calls(answer_msg)
    return bool(got) and [(g.get("name"), _args(g.get("arguments"))) for g in got] == [(n, v) for n, v, _ in sent]


def added_arguments(got: list[dict[str, Any]] | None, sent: list[tuple[Any, Any, Any]]) -> list[str] | None:
    """The argument keys a harness added to the tool calls it re-sent (same calls, same names, every
    sampled argument unchanged), or None when the calls differ otherwise. Claude Code re-sends an
    Edit call with ``"replace_all": false`` filled in when the model left it out."""
    if not got or len(got) != len(sent):
        return None
    added: list[str] = []
    for g, (name, args, _) in zip(got, sent):
        mine = _args(g.get("arguments"))
        if g.get("name") != name or not isinstance(mine, dict) or not isinstance(args, dict):
            return None
        if any(k not in args or args[k] != v for k, v in mine.items()):
            return None
        added += [k for k in args if k not in mine]
    return added or None


def _reasoning(m: dict[str, Any]) -> str:
    return m.get("reasoning") or m.get("reasoning_content") or ""


def _tools_key(call: Call) -> str:
    req = call.request or {}
    return json.dumps(req.get("tools") or [], sort_keys=True)


def _first_line_diff(a: str, b: str) -> str:
    for la, lb in zip(a.splitlines(), b.splitlines()):
        if la != lb:
            return f"{la[:80]!r} -> {lb[:80]!r}"
    return f"{len(a)} -> {len(b)} chars"


def _history_diff(pm: list[dict[str, Any]], nm: list[dict[str, Any]]) -> tuple[str, str] | None:
    """Cause of the first differing message of the shared history (non-system turns), or None."""
    for i, (a, b) in enumerate(zip(pm, nm)):
        if a == b:
            continue
        role = a.get("role")
        if role != b.get("role"):
            return "other", f"turn {i}: role {role} -> {b.get('role')}"
        if role == "tool":
            return "tool_result_reformatted", f"turn {i}: {type(a.get('content')).__name__} -> {type(b.get('content')).__name__}"
        if role == "assistant":
            if _reasoning(a) and not _reasoning(b):
                return "reasoning_removed", f"turn {i}"
            if _reasoning(a) != _reasoning(b):
                return "reasoning_changed", f"turn {i}"
            ta, tb = _tool_calls(a), _tool_calls(b)
            if [(n, v) for n, v, _ in ta] == [(n, v) for n, v, _ in tb] and ta != tb:
                return "tool_args_reserialized", f"turn {i}"
        if message_text(a.get("content")) == message_text(b.get("content")) and role != "assistant":
            if role == "user":
                return "tool_result_reformatted" if isinstance(a.get("content"), list) or isinstance(b.get("content"), list) else "other", f"turn {i}: same text, other shape"
        if role == "user":  # the harness rewrote an earlier user turn (Qwen Code 0.24 on tiny-r1, at its 10th call)
            return "user_turn_edited", f"turn {i}: {_first_line_diff(message_text(a.get('content')), message_text(b.get('content')))}"
        return "other", f"turn {i} ({role}) edited"
    return None


# ------------------------------------------------------------------------------------------------
# classification of one pair
# ------------------------------------------------------------------------------------------------
def _window(decode: Callable[[list[int]], str] | None, ids: np.ndarray, at: int, width: int = 10) -> str | None:
    if decode is None:
        return None
    return decode(ids[max(0, at - width) : at + width].tolist())


def _is_empty_think(text: str) -> bool:
    t = text.strip()
    return t.startswith("<think>") and t.endswith("</think>") and not t[len("<think>") : -len("</think>")].strip()


def classify_pair(prev: Call, nxt: Call, template: TemplateInfo | None = None) -> Drift:
    """Why ``nxt.prompt`` is not ``prev.prompt + prev.sampled + ...`` (token ids and messages)."""
    t = template or TemplateInfo(eot_ids=frozenset())
    a, s, p = prev.prompt, prev.sampled, nxt.prompt
    common = lcp(a, p)
    expected = np.concatenate([a, s]) if s.size else a
    if is_prefix(expected, p):
        return Drift("none", common_prefix=common)
    pm, nm = _messages(prev), _messages(nxt)
    decode = t.decode
    if nxt.history_cause in TEMPLATE_RERENDERED:  # the proxy knows: its ids are the template's
        k = lcp(s, p[a.size :]) if common == a.size else None
        at = a.size + k if k is not None else common
        why = ("the chat template drops this answer's reasoning; the proxy prompted with its rendering"
               if nxt.history_cause == TEMPLATE_DROPPED_REASONING else
               "the template no longer renders the earlier prompt as a prefix; the proxy prompted with its rendering")
        return Drift(nxt.history_cause, None if k is not None else common, k, common,
                     _window(decode, expected, at), _window(decode, p, at), why)
    if common == a.size:  # the prompt is a prefix: the answer came back differently
        k = lcp(s, p[a.size :])
        drift = Drift("other", None, k, common, _window(decode, expected, a.size + k), _window(decode, p, a.size + k))
        answer_msg = None
        if pm is not None and nm is not None:
            tp, tn = _turns(pm), _turns(nm)
            if len(tn) > len(tp):
                answer_msg = tn[len(tp)]
            if answer_msg is None or answer_msg.get("role") != "assistant":
                drift.cause, drift.detail = "answer_dropped", "no assistant turn after the previous history"
                return drift
        if prev.finish_reason == "length":
            drift.cause, drift.detail = "length_turn", f"{s.size} sampled ids, output text {len(prev.output_text)} chars"
            return drift
        if prev.output_reasoning:
            sent = _reasoning(answer_msg) if answer_msg else ""
            rendered = decode(p[a.size : a.size + s.size + 64].tolist()) if decode else None
            if not sent or (rendered is not None and prev.output_reasoning.strip()[:40] not in rendered):
                drift.cause, drift.detail = "reasoning_removed", "reasoning sampled but not in the next prompt"
                return drift
            if sent.strip() != prev.output_reasoning.strip():
                drift.cause = "reasoning_changed"
                return drift
        if decode is not None:
            eot = t.eot_ids
            body = s[:-1] if s.size and int(s[-1]) in eot else s
            ends = np.flatnonzero(np.isin(p[a.size :], np.fromiter(eot, dtype=np.int64))) if eot else np.zeros(0)
            region = p[a.size : a.size + int(ends[0])] if ends.size else p[a.size : a.size + body.size]
            ta, tb = decode(body.tolist()), decode(region.tolist())
            if ta == tb:
                drift.cause, drift.detail = "retokenized", f"{body.size} sampled ids -> {region.size} ids, same text"
                return drift
            if canonical_answer(ta) == canonical_answer(tb):
                drift.cause, drift.detail = "tool_args_reserialized", _first_line_diff(ta, tb)
                return drift
            drift.detail = _first_line_diff(ta, tb)
            if answer_msg is not None and _same_tool_calls(prev.tool_calls, answer_msg):
                drift.cause = "tool_call_rerendered"
            elif answer_msg is not None and (added := added_arguments(prev.tool_calls, _tool_calls(answer_msg))):
                drift.cause, drift.detail = "tool_call_edited", f"the harness added {', '.join(sorted(set(added)))}"
            return drift
        if answer_msg is not None:
            got = prev.tool_calls
            if _same_tool_calls(got, answer_msg):
                drift.cause = "tool_args_reserialized"
            elif message_text(answer_msg.get("content")).strip() == prev.output_text.strip() and not got:
                drift.cause = "retokenized"
        return drift

    # the prompt itself diverged
    drift = Drift("other", common, None, common, _window(decode, a, common), _window(decode, p, common))
    if pm is not None and nm is not None:
        tp, tn = _turns(pm), _turns(nm)
        prev_tools, next_tools = _tools_key(prev), _tools_key(nxt)
        kind = compaction_of(nm)
        if kind is not None:  # a summary call, or a history that restarts from a summary
            drift.cause = "compacted"
            drift.detail = f"{kind}: {len(tp)} -> {len(tn)} turns"
            return drift
        side = side_call_of(nm)
        if side is not None and len(tn) >= len(tp):  # the history re-sent whole, tools dropped: not a compaction
            drift.cause, drift.detail = "tools_changed", f"side call ({side}): {len(tp)} -> {len(tn)} turns, tools {'removed' if next_tools == '[]' else 'kept'}"
            return drift
        if (prev_tools != "[]" and next_tools == "[]") or len(tn) < len(tp):
            drift.cause = "compacted"
            drift.detail = f"{len(tp)} -> {len(tn)} turns, tools {'removed' if next_tools == '[]' else 'kept'}"
            return drift
        if _system_text(pm) != _system_text(nm):
            drift.cause, drift.detail = "system_changed", _first_line_diff(_system_text(pm), _system_text(nm))
            return drift
        if prev_tools != next_tools:
            drift.cause = "tools_changed"
            return drift
        hist = _history_diff(tp, tn)
        if hist is not None:
            drift.cause, drift.detail = hist
            return drift
        if len(tn) > len(tp) and tn[len(tp)].get("role") != "assistant":
            drift.cause = "answer_dropped"
            drift.detail = f"turn {len(tp)} is {tn[len(tp)].get('role')}, not the previous answer"
            if prev.finish_reason == "length":
                drift.detail += " (the previous turn was cut by finish_reason=length)"
            return drift
    # same messages (or none known): where in the prompt did it diverge?
    gen = len(t.generation_prompt)
    last_eot = max((i for i in range(a.size - 1, max(-1, a.size - 64), -1) if int(a[i]) in t.eot_ids), default=None)
    in_gen_prompt = (gen and common >= a.size - gen) or (last_eot is not None and common > last_eot)
    if in_gen_prompt:
        tail = decode(a[common:].tolist()) if decode else ""
        drift.cause = "empty_think_generation_prompt" if _is_empty_think(tail) else "generation_prompt_changed"
        drift.detail = f"previous prompt tail {tail!r}" if decode else None
        return drift
    if pm is not None and nm is not None and drift.detail is None:
        drift.detail = "same messages, different ids (template or preprocessing changed)"
    return drift


# ------------------------------------------------------------------------------------------------
# whole capture
# ------------------------------------------------------------------------------------------------
def predecessor(call: Call, earlier: list[Call], window: int = 32) -> Call | None:
    """The earlier call whose conversation ``call`` continues: longest common prompt prefix wins."""
    best, best_l = None, -1
    for prev in reversed(earlier[-window:]):
        l = lcp(prev.prompt, call.prompt)
        if l > best_l and (is_prefix(prev.prompt, call.prompt) or continues(prev, call)):
            best, best_l = prev, l
    return best


def drift_report(calls_lf: pl.LazyFrame, template: TemplateInfo | None = None) -> pl.DataFrame:
    """One row per usable call (DRIFT_SCHEMA): its predecessor and the cause of any drift."""
    calls = collect_calls(calls_lf)
    template = template or infer_template_info(calls)
    rows = []
    for session_id, session_calls in by_session(calls):
        seen: list[Call] = []
        for call in session_calls:
            if not call.usable and call.prompt.size == 0:
                continue
            prev = predecessor(call, seen)
            base = {"session_id": session_id, "call_id": call.call_id, "call_index": call.call_index}
            kind = compaction_of(_messages(call)) if prev is None and seen else None
            if kind is not None:  # the history was replaced by a summary: a break, named
                last = seen[-1]
                rows.append(base | {"prev_call_id": last.call_id, "prev_call_index": last.call_index, "exact": False,
                                    "cause": "compacted", "detail": kind,
                                    "common_prefix": lcp(last.prompt, call.prompt)})
            elif prev is None:
                rows.append(base | {"cause": "new_conversation", "exact": False})
            else:
                d = classify_pair(prev, call, template)
                exact = d.exact
                summary = compaction_of(_messages(call))
                if d.cause != "compacted" and summary is not None and summary.startswith("summary call"):
                    # a summary request appended to the history it summarizes (tools kept: Claude Code,
                    # Qwen Code): the prompt goes on, but the call is the harness compacting
                    d.detail = f"{summary}: the history goes on ({d.cause})"
                    d.cause = "compacted"
                rows.append(
                    base
                    | {"prev_call_id": prev.call_id, "prev_call_index": prev.call_index, "exact": exact}
                    | {k: getattr(d, k) for k in ("cause", "prompt_divergence", "answer_divergence", "common_prefix", "prev_text", "next_text", "detail")}
                )
            rows[-1]["origin"] = ORIGIN[rows[-1]["cause"]]
            if call.usable:
                seen.append(call)
    return pl.DataFrame(rows, schema=DRIFT_SCHEMA) if rows else pl.DataFrame(schema=DRIFT_SCHEMA)


def summarize(report: pl.DataFrame) -> pl.DataFrame:
    """Counts per cause (every cause listed, zeros included), with each cause's origin, for the CLI table."""
    counts = report.group_by("cause").len()
    return (
        pl.DataFrame({"cause": list(CAUSES), "origin": [ORIGIN[c] for c in CAUSES]})
        .join(counts, on="cause", how="left")
        .with_columns(pl.col("len").fill_null(0).alias("calls"))
        .select("cause", "origin", "calls")
        .with_columns(share=pl.col("calls") / pl.col("calls").sum().clip(1))
    )


def by_origin(report: pl.DataFrame) -> pl.DataFrame:
    """Counts per origin (every origin listed): how many turns the template re-rendered against how
    many the harness itself edited."""
    counts = report.group_by("origin").len()
    return (
        pl.DataFrame({"origin": list(ORIGINS)})
        .join(counts, on="origin", how="left")
        .with_columns(pl.col("len").fill_null(0).alias("calls"))
        .select("origin", "calls")
        .with_columns(share=pl.col("calls") / pl.col("calls").sum().clip(1))
    )
