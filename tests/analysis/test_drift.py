"""Drift causes between consecutive turns, each reproduced with real Qwen2.5 ids."""

from __future__ import annotations

import json

import polars as pl

from polar_analysis import drift, frames
from polar_analysis.alignment import ChatTemplateRenderer
from polar_analysis.synthetic import SyntheticSession, write_capture

from .conftest import QWEN3_STYLE_TEMPLATE


def report(tmp_path, records, template):
    write_capture(tmp_path, records)
    return drift.drift_report(frames.calls(tmp_path, rewards=None), template)


def causes(rep: pl.DataFrame) -> list[str]:
    return rep.sort("call_index")["cause"].to_list()


def session(renderer, pi_chat, sid="d", **kw):
    return SyntheticSession(renderer, sid, system=pi_chat["messages"][0]["content"], tools=pi_chat["tools"], **kw)


def tool_turn(s, i, raw=None):
    args = {"path": f"f{i}.py", "limit": 10}
    s.generate(tool_calls=[("read", args, raw)] if raw else [("read", args)])
    s.tool(f"content of f{i}", s.messages[-1]["tool_calls"][0]["id"])


def test_exact_and_retokenized_and_reserialized(tmp_path, renderer, template, pi_chat, tok):
    s = session(renderer, pi_chat).user("read files")
    tool_turn(s, 0)
    tool_turn(s, 1, raw='{"name":"read","arguments":{"limit":10,"path":"f1.py"}}')
    s.generate(content="fishing", sampled_ids=tok.encode("fish") + tok.encode("ing") + [s.eot])
    s.user("ok")
    s.generate(content="bye")
    rep = report(tmp_path, s.records, template)
    assert causes(rep) == ["new_conversation", "none", "tool_args_reserialized", "retokenized"]
    row = rep.filter(cause="retokenized").row(0, named=True)
    assert row["prompt_divergence"] is None and row["answer_divergence"] == 0
    assert "fish" in row["prev_text"] and "fishing" in row["next_text"]
    assert row["prev_call_index"] == 2 and not row["exact"]


def test_reasoning_removed(tmp_path, renderer, template, pi_chat):
    s = session(renderer, pi_chat).user("why?")
    s.generate(reasoning="The user asks why; answer briefly.", content="Because.")
    s.user("really?")
    s.generate(content="Yes.")
    rep = report(tmp_path, s.records, template)
    assert causes(rep) == ["new_conversation", "reasoning_removed"]


def test_template_dropped_reasoning_is_named_from_the_proxys_record(tmp_path, renderer, template, pi_chat):
    """Exact-history mode prompted call 1 with the template's rendering of an answer whose reasoning
    the template drops: the report names the template (the proxy's history_cause), not a guess."""
    s = session(renderer, pi_chat).user("why?")
    s.generate(reasoning="The user asks why; answer briefly.", content="Because.")
    s.user("really?")
    s.generate(content="Yes.")
    s.records[1].history_cause = "template_dropped_reasoning"
    rep = report(tmp_path, s.records, template)
    assert causes(rep) == ["new_conversation", "template_dropped_reasoning"]
    row = rep.filter(cause="template_dropped_reasoning").row(0, named=True)
    assert row["origin"] == "rerendered" and not row["exact"] and "template drops" in row["detail"]
    # the proxy re-rendered the whole history (the template's old prompt was no longer a prefix)
    s.records[1].history_cause = "template_not_prefix"
    rep = report(tmp_path / "not-prefix", s.records, template)
    assert causes(rep) == ["new_conversation", "template_not_prefix"]
    row = rep.filter(cause="template_not_prefix").row(0, named=True)
    assert row["origin"] == "rerendered" and "no longer renders" in row["detail"]


def test_qwen3_empty_think(tmp_path, tiny_qwen_dir, pi_chat):
    r3 = ChatTemplateRenderer(tiny_qwen_dir, chat_template=QWEN3_STYLE_TEMPLATE)
    s = SyntheticSession(r3, "q3", system="sys", tools=pi_chat["tools"], chat_template_kwargs={"enable_thinking": False}).user("hi")
    s.generate(content="Hello!")
    s.user("bye")
    s.generate(content="Bye!")
    rep = report(tmp_path, s.records, r3.template_info(enable_thinking=False))
    assert causes(rep) == ["new_conversation", "empty_think_generation_prompt"]
    row = rep.row(1, named=True)
    assert row["prompt_divergence"] == row["common_prefix"] and "<think>" in row["detail"]


def test_billing_header_system_change(tmp_path, tiny_qwen_dir, template, pi_chat):
    keeps = ChatTemplateRenderer(tiny_qwen_dir, strip_billing_header=False)
    s = SyntheticSession(keeps, "cc", system="x-anthropic-billing-header: cch=aaaa1;\nYou are Claude Code.", tools=pi_chat["tools"])
    s.user("go")
    tool_turn(s, 0)
    s.messages[0]["content"] = "x-anthropic-billing-header: cch=bbbb2;\nYou are Claude Code."
    s.generate(content="done")
    rep = report(tmp_path, s.records, template)
    assert causes(rep) == ["new_conversation", "system_changed"]
    assert "cch=aaaa1" in rep["detail"][1] and "cch=bbbb2" in rep["detail"][1]


def test_tool_result_reformatted_and_tools_changed(tmp_path, renderer, template, pi_chat):
    s = session(renderer, pi_chat).user("go")
    tool_turn(s, 0)
    s.generate(content="first")
    s.user("again")
    # the harness re-sends an earlier tool result in another shape (string -> wrapped differently)
    s.messages[3]["content"] = "content of f0\n"
    s.generate(content="second")
    s.user("with fewer tools")
    s.tools = pi_chat["tools"][:2]
    s.generate(content="third")
    rep = report(tmp_path, s.records, template)
    assert causes(rep) == ["new_conversation", "none", "tool_result_reformatted", "tools_changed"]


def test_compaction_and_length_and_dropped_answer(tmp_path, renderer, template, pi_chat):
    s = session(renderer, pi_chat).user("long task")
    tool_turn(s, 0)
    s.generate(content="Summary: read f0.", messages=s.messages + [{"role": "user", "content": "Summarize."}], tools=None, echo=False)
    s.generate(reasoning="thinking " * 20, max_tokens=5)  # cut, empty content, echoed as ""
    s.user("continue")
    s.generate(content="ok", echo=False)
    s.user("and?")  # the answer above was never echoed back
    s.generate(content="fine")
    rep = report(tmp_path, s.records, template)
    assert causes(rep) == ["new_conversation", "compacted", "none", "length_turn", "answer_dropped"]
    # the compaction call is compared with the call it summarizes, not with a later one
    assert rep.filter(cause="compacted")["prev_call_index"].item() == 0


def test_subagent_is_a_new_conversation_and_summary_counts(tmp_path, renderer, template, pi_chat):
    main = session(renderer, pi_chat, "m").user("main task")
    sub = SyntheticSession(renderer, "m", system="sub-agent", tools=None).user("sub task")
    tool_turn(main, 0)
    sub.generate(content="sub answer")
    sub.user("more")
    main.generate(content="main answer")
    sub.generate(content="sub 2")
    records = [main.records[0], sub.records[0], main.records[1], sub.records[1]]
    for i, r in enumerate(records):
        r.call_index = i
    rep = report(tmp_path, records, template)
    assert causes(rep) == ["new_conversation", "new_conversation", "none", "none"]
    assert rep.sort("call_index")["prev_call_index"].to_list() == [None, None, 0, 1]
    summary = drift.summarize(rep)
    assert summary.height == len(drift.CAUSES)
    assert dict(zip(summary["cause"], summary["calls"]))["none"] == 2


def test_tool_call_written_as_markdown_json_is_rerendered(tmp_path, renderer, template, pi_chat, tok):
    """A small model writes its call as a Markdown JSON block; the engine's (lenient) tool parser
    reads it, and the history renders the call as <tool_call>: the same call, other ids."""
    s = session(renderer, pi_chat).user("read f0.py")
    args = {"path": "f0.py", "limit": 10}
    markdown = '```json\n{"name": "read", "arguments": {"path": "f0.py", "limit": 10}}\n```'
    s.generate(tool_calls=[("read", args)], sampled_ids=tok.encode(markdown) + [s.eot])
    s.tool("content of f0", s.messages[-1]["tool_calls"][0]["id"])
    s.generate(content="done")
    rep = report(tmp_path, s.records, template)
    assert causes(rep) == ["new_conversation", "tool_call_rerendered"]
    row = rep.filter(cause="tool_call_rerendered").row(0, named=True)
    assert row["prompt_divergence"] is None and "```json" in row["prev_text"] and "<tool_call>" in row["next_text"]


def test_origin_separates_template_rerendering_from_harness_edits(tmp_path, renderer, template, pi_chat, tok):
    """A re-sent answer whose ids the template changed counts as ``rerendered``; a history the
    harness itself changed (a tool result reformatted, an answer dropped) as ``harness``."""
    s = session(renderer, pi_chat).user("go")
    tool_turn(s, 0)  # exact
    s.generate(content="fishing", sampled_ids=tok.encode("fish") + tok.encode("ing") + [s.eot])
    s.user("next")
    s.generate(content="second")  # retokenized: the template re-rendered "fishing" (template)
    s.user("more")
    s.messages[3]["content"] = "content of f0\n"
    s.generate(content="third", echo=False)  # tool_result_reformatted (harness)
    s.user("and?")
    s.generate(content="fourth")  # answer_dropped: "third" was never echoed (harness)
    rep = report(tmp_path, s.records, template).sort("call_index")
    assert rep["origin"].to_list() == [drift.ORIGIN[c] for c in rep["cause"].to_list()]
    origins = dict(zip(rep["cause"], rep["origin"]))
    assert origins["tool_result_reformatted"] == "harness" and origins["answer_dropped"] == "harness"
    assert origins["none"] == "exact" and origins["new_conversation"] == "start"
    counts = dict(zip(*drift.by_origin(rep).select("origin", "calls").to_dict(as_series=False).values()))
    assert rep["cause"].to_list() == ["new_conversation", "none", "retokenized", "tool_result_reformatted",
                                      "answer_dropped"]
    assert (counts["rerendered"], counts["harness"]) == (1, 2)
    assert counts["harness"] + counts["rerendered"] + counts["exact"] + counts["start"] + counts["other"] == rep.height
    assert set(drift.ORIGIN) == set(drift.CAUSES) and set(drift.ORIGIN.values()) == set(drift.ORIGINS)


def test_summary_request_appended_to_the_history_is_named(tmp_path, renderer, template, pi_chat):
    """Claude Code and Qwen Code ask for the summary at the end of the history they summarize, tools
    kept: the prompt continues the previous one, and the report still names the compaction."""
    s = session(renderer, pi_chat).user("long task")
    tool_turn(s, 0)
    s.user("First, reason in your <analysis> block. Then, produce the <state_snapshot> XML.")
    s.generate(content="<state_snapshot>read f0</state_snapshot>")
    rep = report(tmp_path, s.records, template)
    assert causes(rep) == ["new_conversation", "compacted"]
    row = rep.row(1, named=True)
    assert row["exact"] and row["detail"] == "summary call (qwen-code): the history goes on (none)"


def test_a_user_turn_the_harness_rewrote_is_a_named_harness_edit():
    """Qwen Code rewrote an earlier user turn on tiny-r1 (its 10th call): once named ``other``
    (no name, so certify FAILed the cell); it is the harness's own edit, which no engine undoes."""
    from polar_analysis.drift import ORIGIN, _history_diff

    before = [{"role": "user", "content": "write notes.txt"}, {"role": "assistant", "content": "done"}]
    after = [{"role": "user", "content": "write notes.txt\n(reminder: be brief)"}, {"role": "assistant", "content": "done"}]
    cause, detail = _history_diff(before, after)
    assert cause == "user_turn_edited" and ORIGIN[cause] == "harness" and "turn 0" in detail
    assert _history_diff(before, before) is None


def test_a_tool_call_the_harness_filled_in_is_named_a_harness_edit(tmp_path, renderer, template, pi_chat):
    """Claude Code re-sends an Edit call with ``"replace_all": false`` added when the model left it
    out: every sampled argument unchanged, one added. That is the harness's edit (not graded by
    certify, split by the trajectory builder), named, never ``other``; a changed argument is not."""
    def run(sent_args, where):
        s = session(renderer, pi_chat, sid=where).user("read a file")
        s.generate(tool_calls=[("read", {"path": "f0.py"})])
        call = s.messages[-1]["tool_calls"][0]
        call["function"]["arguments"] = json.dumps(sent_args)  # what the harness re-sends
        s.tool("content of f0.py", call["id"])
        s.generate(content="done")
        return report(tmp_path / where, s.records, template).sort("call_index").row(1, named=True)

    row = run({"path": "f0.py", "limit": 2000}, "filled")
    assert row["cause"] == "tool_call_edited" and row["detail"] == "the harness added limit"
    assert drift.ORIGIN["tool_call_edited"] == "harness"
    assert run({"path": "f1.py", "limit": 2000}, "changed")["cause"] == "other"
    assert drift.added_arguments([{"name": "read", "arguments": '{"path": "a"}'}],
                                 [("read", {"path": "a", "limit": 5}, "")]) == ["limit"]
    assert drift.added_arguments([{"name": "read", "arguments": '{"path": "a"}'}], [("write", {"path": "a"}, "")]) is None
