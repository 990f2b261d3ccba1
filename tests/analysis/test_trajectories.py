"""Trajectory reconstruction on captures whose ids come from the real Qwen2.5 tokenizer + template.

Every test checks the invariants that make a trajectory trainable (``check``): every sampled id of
every usable call is present once with loss mask 1 and its own behaviour logprob, mask-0 ids are
a suffix of the call's server-tokenized prompt, spans tile the sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_analysis import frames
from polar_analysis.alignment import ChatTemplateRenderer
from polar_analysis.synthetic import SyntheticSession, write_capture
from polar_analysis.trajectories import per_request, prefix_merge
from polar_analysis.trajectories.common import TRAJECTORY_SCHEMA

from .conftest import QWEN3_STYLE_TEMPLATE


def pi_session(renderer, pi_chat, sid="s1", **kw) -> SyntheticSession:
    return SyntheticSession(renderer, sid, system=pi_chat["messages"][0]["content"], tools=pi_chat["tools"], **kw)


def capture(tmp_path, records):
    write_capture(tmp_path, records)
    return frames.calls(tmp_path, rewards=None)


def check(df, stats, records):
    """Invariants every reconstruction must satisfy; returns {call_id: (row, span)} of sampled spans."""
    assert dict(df.schema) == TRAJECTORY_SCHEMA
    by_id = {r.call_id: r for r in records}
    usable = [r for r in records if r.status == "ok" and r.sampled_token_ids]
    seen = {}
    for row in df.iter_rows(named=True):
        ids, mask, lps = np.array(row["input_ids"]), np.array(row["loss_mask"]), np.array(row["logprobs"])
        assert len(ids) == len(mask) == len(lps)
        assert row["span_start"][0] == 0 and row["span_end"][-1] == len(ids)
        assert all(a == b for a, b in zip(row["span_end"][:-1], row["span_start"][1:]))
        assert len(row["merge_kind"]) == len(row["merge_exact"]) == row["n_calls"] - 1 == len(row["call_ids"]) - 1
        index_to_id = {by_id[c].call_index: c for c in row["call_ids"]}
        for ci, s, e, kind in zip(row["span_call_index"], row["span_start"], row["span_end"], row["span_kind"]):
            rec = by_id[index_to_id[ci]]
            if kind == "sampled":
                assert ids[s:e].tolist() == rec.sampled_token_ids
                assert mask[s:e].all()
                np.testing.assert_array_equal(lps[s:e], rec.sampled_logprobs)
                assert rec.call_id not in seen
                seen[rec.call_id] = (row, (s, e))
            else:
                assert not mask[s:e].any() and not lps[s:e].any()
                n = e - s
                assert ids[s:e].tolist() == rec.prompt_token_ids[len(rec.prompt_token_ids) - n :], "mask-0 ids must be a prompt suffix"
    assert set(seen) == {r.call_id for r in usable}
    assert stats.coverage == 1.0
    assert stats.sampled_tokens == sum(len(r.sampled_token_ids) for r in usable)
    assert int(df["loss_mask"].list.sum().sum()) == stats.sampled_tokens
    return seen


def tool_turns(s: SyntheticSession, n: int, *, compact_json_at=()):
    for i in range(n):
        args = {"command": f"ls -la src/{i}", "timeout": 30}
        raw = None
        if i in compact_json_at:
            raw = '{"name":"bash","arguments":{"timeout":30,"command":"ls -la src/%d"}}' % i
        tc = ("bash", args, raw) if raw else ("bash", args)
        s.generate(content="Let me look." if i % 2 else "", tool_calls=[tc])
        s.tool(f"total {i}\ndrwxr-xr-x  2 root root 4096 file_{i}.py", s.messages[-1]["tool_calls"][0]["id"])


def test_exact_chain_is_one_sequence_equal_to_the_last_call(tmp_path, renderer, template, pi_chat):
    s = pi_session(renderer, pi_chat).user("List the files in src/ and summarize.")
    tool_turns(s, 3)
    s.generate(content="There are three directories.")
    df, stats = prefix_merge.build(capture(tmp_path, s.records), template=template)
    check(df, stats, s.records)
    assert df.height == 1 and stats.merges == 3 and stats.exact_merge_rate == 1.0
    row = df.row(0, named=True)
    last = s.records[-1]
    assert row["input_ids"] == last.prompt_token_ids + last.sampled_token_ids
    assert row["merge_exact"] == [True, True, True]
    assert row["n_calls"] == 4 and row["task_id"] is None and row["status"] == "ok"


def test_per_request_mode(tmp_path, renderer, pi_chat):
    s = pi_session(renderer, pi_chat).user("hi")
    tool_turns(s, 2)
    s.generate(content="bye")
    df, stats = per_request.build(capture(tmp_path, s.records))
    check(df, stats, s.records)
    assert df.height == 3
    for row, rec in zip(df.iter_rows(named=True), s.records):
        assert row["input_ids"] == rec.prompt_token_ids + rec.sampled_token_ids
        assert row["span_kind"] == ["prompt", "sampled"]


def test_fish_ing_is_retokenized_and_strict_splits(tmp_path, renderer, template, pi_chat, tok):
    fish, ing = tok.encode("fish"), tok.encode("ing")
    assert tok.encode("fishing") != fish + ing  # the re-rendered answer will have other ids
    s = pi_session(renderer, pi_chat).user("What do bears do at rivers? One word.")
    s.generate(content="fishing", sampled_ids=fish + ing + [s.eot])
    s.user("And in winter?")
    s.generate(content="sleeping")
    lf = capture(tmp_path, s.records)
    df, stats = prefix_merge.build(lf, template=template)
    check(df, stats, s.records)
    assert df.height == 1 and df["merge_kind"][0].to_list() == ["retokenized"] and df["merge_exact"][0].to_list() == [False]
    ids = df["input_ids"][0].to_list()
    first = s.records[0]
    at = len(first.prompt_token_ids)
    assert ids[at : at + 3] == fish + ing + [s.eot]
    # the tail continues right after the re-rendered answer's <|im_end|>: "\n<|im_start|>user..."
    assert tok.decode(ids[at + 3 : at + 6]).startswith("\n<|im_start|>user")
    strict, st_stats = prefix_merge.build(lf, template=template, strict=True)
    check(strict, st_stats, s.records)
    assert strict.height == 2 and st_stats.breaks == 1 and st_stats.break_reasons == {"strict:retokenized": 1}
    assert strict["chain_index"].to_list() == [0, 0] and strict["segment_index"].to_list() == [0, 1]


def test_reserialized_tool_arguments(tmp_path, renderer, template, pi_chat):
    s = pi_session(renderer, pi_chat).user("inspect")
    tool_turns(s, 3, compact_json_at=(1,))
    s.generate(content="ok")
    df, stats = prefix_merge.build(capture(tmp_path, s.records), template=template)
    check(df, stats, s.records)
    assert df.height == 1
    assert df["merge_kind"][0].to_list() == ["exact", "retokenized", "exact"]


def test_interleaved_subagent_and_parallel_fork_are_separate_chains(tmp_path, renderer, template, pi_chat):
    main = pi_session(renderer, pi_chat, "sess").user("Fix the failing test.")
    sub = SyntheticSession(renderer, "sess", system="You are a search sub-agent.", tools=pi_chat["tools"][:2]).user("Find test files.")
    records = []
    for i in range(3):  # main and sub-agent calls interleave within one session
        main.generate(tool_calls=[("read", {"path": f"tests/test_{i}.py"})])
        main.tool(f"def test_{i}(): assert {i}", main.messages[-1]["tool_calls"][0]["id"])
        records.append(main.records[-1])
        sub.generate(tool_calls=[("bash", {"command": f"find . -name '*{i}*'"})])
        sub.tool(f"./tests/test_{i}.py", sub.messages[-1]["tool_calls"][0]["id"])
        records.append(sub.records[-1])
    # a parallel call: the same history sent twice (second answer differs) -> a fork
    fork_msgs = [dict(m) for m in main.messages]
    main.generate(content="Done.")
    records.append(main.records[-1])
    main.generate(content="Finished!", messages=fork_msgs, echo=False)
    records.append(main.records[-1])
    for i, r in enumerate(records):
        r.call_index = i
    df, stats = prefix_merge.build(capture(tmp_path, records), template=template)
    check(df, stats, records)
    assert stats.chains == 3 and stats.breaks == 0
    sizes = sorted(df["n_calls"].to_list())
    assert sizes == [1, 3, 4]
    assert df.filter(n_calls=3)["merge_exact"][0].to_list() == [True, True]


def test_qwen3_empty_think_generation_prompt(tmp_path, tiny_qwen_dir, pi_chat, tok):
    r3 = ChatTemplateRenderer(tiny_qwen_dir, chat_template=QWEN3_STYLE_TEMPLATE)
    t3 = r3.template_info(enable_thinking=False)
    assert tok.decode(list(t3.generation_prompt)) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.decode(list(t3.assistant_header)) == "<|im_start|>assistant\n"
    s = SyntheticSession(r3, "q3", system="You are a coding agent.", tools=pi_chat["tools"], chat_template_kwargs={"enable_thinking": False})
    s.user("Create hi.txt")
    s.generate(tool_calls=[("write", {"path": "hi.txt", "content": "hi"})])
    s.tool("wrote 2 bytes", s.messages[-1]["tool_calls"][0]["id"])
    s.generate(content="Created hi.txt.")
    s.user("Thanks")
    s.generate(content="You're welcome.")
    a, b = s.records[0].prompt_token_ids, s.records[1].prompt_token_ids
    assert b[: len(a)] != a  # the trap: call N is never a prefix of call N+1
    lf = capture(tmp_path, s.records)
    df, stats = prefix_merge.build(lf, template=t3)
    check(df, stats, s.records)
    assert df.height == 1 and df["merge_kind"][0].to_list() == ["prompt_changed", "prompt_changed"]
    text = tok.decode(df["input_ids"][0].to_list())
    # what the model saw when sampling each answer: the empty think block precedes each one
    assert text.count("<think>\n\n</think>\n\n") == 3
    strict, st = prefix_merge.build(lf, template=t3, strict=True)
    check(strict, st, s.records)
    assert strict.height == 3 and st.break_reasons == {"strict:prompt_changed": 2}
    # without template facts nothing can be merged across the changed prompt, and nothing is lost
    blind, bs = prefix_merge.build(lf)
    check(blind, bs, s.records)
    assert blind.height == 3 and bs.breaks == 2
    assert bs.break_reasons == {"generation_prompt_changed": 2}  # no decoder: the tail cannot be read


def billing_system(i: int) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.332.bb5; cc_entrypoint=sdk-cli; cch={1000 + 7 * i:05x};\nYou are Claude Code."


def claude_session(server: ChatTemplateRenderer, pi_chat, n: int) -> SyntheticSession:
    s = SyntheticSession(server, "cc", system=billing_system(0), tools=pi_chat["tools"], harness="claude-code", provider="anthropic")
    s.user("Run echo hi")
    for i in range(n):
        s.messages[0]["content"] = billing_system(i)  # a new header on every request
        if i < n - 1:
            s.generate(tool_calls=[("bash", {"command": f"echo {i}"})])
            s.tool(f"{i}", s.messages[-1]["tool_calls"][0]["id"])
        else:
            s.generate(content="Done.")
    return s


def test_claude_billing_header_breaks_unless_stripped(tmp_path, tiny_qwen_dir, renderer, template, pi_chat):
    keeps = ChatTemplateRenderer(tiny_qwen_dir, strip_billing_header=False)  # an engine that keeps it
    s = claude_session(keeps, pi_chat, 3)
    df, stats = prefix_merge.build(capture(tmp_path / "kept", s.records), template=template)
    check(df, stats, s.records)
    assert df.height == 3 and stats.breaks == 2 and stats.break_reasons == {"system_changed": 2}
    assert df["chain_index"].to_list() == [0, 0, 0] and df["segment_index"].to_list() == [0, 1, 2]
    # current vLLM drops the header line before rendering: the same run merges exactly
    s2 = claude_session(renderer, pi_chat, 3)
    df2, stats2 = prefix_merge.build(capture(tmp_path / "stripped", s2.records), template=template)
    check(df2, stats2, s2.records)
    assert df2.height == 1 and stats2.exact_merge_rate == 1.0


def test_compaction_turn(tmp_path, renderer, template, pi_chat):
    s = pi_session(renderer, pi_chat, "cmp").user("Refactor utils.py")
    tool_turns(s, 2)
    # the harness compacts: a summary call without tools over the whole history
    summary_msgs = s.messages + [{"role": "user", "content": "Summarize the conversation so far."}]
    s.generate(content="Summary: listed src twice.", messages=summary_msgs, tools=None, echo=False)
    s.messages = [s.messages[0], {"role": "user", "content": "Refactor utils.py\n\nSummary: listed src twice."}]
    tool_turns(s, 1)
    s.generate(content="Refactored.")
    df, stats = prefix_merge.build(capture(tmp_path, s.records), template=template)
    check(df, stats, s.records)
    assert stats.break_reasons == {"compacted": 1}
    assert stats.chains == 2 and df.height == 3
    assert sorted(df["n_calls"].to_list()) == [1, 2, 2]


def test_length_turn_with_empty_content_keeps_its_ids(tmp_path, renderer, template, pi_chat, tok):
    s = pi_session(renderer, pi_chat, "len").user("Think hard about primes.")
    cut = s.generate(reasoning="Let me enumerate primes: 2, 3, 5, 7, 11, 13, 17, 19, 23 and so on", max_tokens=12)
    assert cut.finish_reason == "length" and cut.output_text == "" and len(cut.sampled_token_ids) == 12
    assert s.eot not in cut.sampled_token_ids
    s.user("Continue.")
    s.generate(content="2, 3, 5, 7.")
    lf = capture(tmp_path / "echoed", s.records)
    df, stats = prefix_merge.build(lf, template=template)
    seen = check(df, stats, s.records)
    row, (a, b) = seen[cut.call_id]
    ids = row["input_ids"]
    assert ids[a:b] == cut.sampled_token_ids
    assert ids[b] == s.eot  # the template closes the cut turn: glue with loss mask 0
    assert row["merge_kind"] == ["content_changed"]
    # exact-history mode prompted the next call with the template's rendering (it drops the
    # reasoning): the proxy says so on the record, and the call is not merged after the unseen ids
    s.records[1].history_cause = "template_dropped_reasoning"
    dropped, dstats = prefix_merge.build(capture(tmp_path / "template-dropped", s.records), template=template)
    check(dropped, dstats, s.records)
    assert dropped.height == 2 and dstats.break_reasons == {"template_dropped_reasoning": 1}
    assert dropped["chain_index"].to_list() == [0, 0] and dropped["segment_index"].to_list() == [0, 1]
    # the same when the proxy re-rendered the whole history because the template's rendering of the
    # old prompt was no longer a prefix (DeepSeek-R1's text tool markup re-tokenized)
    s.records[1].history_cause = "template_not_prefix"
    rer, rstats = prefix_merge.build(capture(tmp_path / "template-not-prefix", s.records), template=template)
    check(rer, rstats, s.records)
    assert rer.height == 2 and rstats.break_reasons == {"template_not_prefix": 1}
    # a cause from the harness (it edited the answer: Claude Code fills in an Edit call's
    # "replace_all") splits too: the proxy prompted with the edited history, not the sampled ids
    s.records[1].history_cause = "answer_changed"
    edited, estats = prefix_merge.build(capture(tmp_path / "answer-changed", s.records), template=template)
    check(edited, estats, s.records)
    assert edited.height == 2 and estats.break_reasons == {"answer_changed": 1}
    # without exact history no call carries a cause: the default builder's merge stays
    s.records[1].history_cause = None
    kept, _ = prefix_merge.build(capture(tmp_path / "no-cause", s.records), template=template)
    assert kept.height == 1 and kept["merge_kind"].to_list() == [["content_changed"]]
    # a harness that drops the empty turn: a break, the ids are kept in their own sequence
    s2 = pi_session(renderer, pi_chat, "len2").user("Think hard about primes.")
    cut2 = s2.generate(reasoning="Let me enumerate primes: 2, 3, 5, 7, 11", max_tokens=8, echo=False)
    s2.user("Continue.")
    s2.generate(content="2, 3, 5.")
    df2, stats2 = prefix_merge.build(capture(tmp_path / "dropped", s2.records), template=template)
    seen2 = check(df2, stats2, s2.records)
    assert cut2.call_id in seen2 and df2.height == 2 and stats2.breaks == 1


def test_error_calls_are_counted_not_merged(tmp_path, renderer, template, pi_chat):
    s = pi_session(renderer, pi_chat, "err").user("go")
    tool_turns(s, 1)
    s.generate(content="", status="error")  # upstream failed: no sampled ids, nothing echoed
    tool_turns(s, 1)
    s.generate(content="done")
    df, stats = prefix_merge.build(capture(tmp_path, s.records), template=template)
    check(df, stats, s.records)
    assert stats.skipped_error == 1 and stats.calls == 4 and stats.usable_calls == 3
    assert df.height == 1 and df["merge_exact"][0].to_list() == [True, True]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    script=st.lists(
        st.sampled_from(["tool", "tool_compact", "say", "fish", "sub", "error", "length", "fork", "rewrite", "rewrite",
                         "drop"]), min_size=1, max_size=8
    ),
    strict=st.booleans(),
)
def test_random_sessions_never_lose_a_sampled_id(tmp_path_factory, renderer, template, tok, script, strict):
    main = SyntheticSession(renderer, "h", system="You are terse.", tools=[{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}]).user("start")
    sub = SyntheticSession(renderer, "h", system="You are a sub-agent.").user("sub task")
    records = []
    # prefix breaks made on purpose: the harness rewrites its first user message (its history
    # no longer starts as the last prompt did) or drops the answer it got; the next call must start
    # a sequence (a new segment of its chain, or a new chain), never be merged into the last one
    after_break, broken, answered = set(), False, False
    for i, op in enumerate(script):
        if op in ("rewrite", "drop"):
            if op == "rewrite":
                main.messages[1] = {"role": "user", "content": f"start over {i}"}
            elif main.messages[-1]["role"] == "user" and main.messages[-2]["role"] == "assistant":
                del main.messages[-2]  # the answer before the last user turn
            else:
                continue
            broken = broken or answered
            continue
        starts = op not in ("sub", "error") and broken
        if op not in ("sub", "error"):
            answered, broken = True, broken and not starts
        if op in ("tool", "tool_compact"):
            raw = '{"name":"sh","arguments":{"c":%d}}' % i if op == "tool_compact" else None
            main.generate(tool_calls=[("sh", {"c": i}, raw)] if raw else [("sh", {"c": i})])
            main.tool(f"out {i}", main.messages[-1]["tool_calls"][0]["id"])
        elif op == "say":
            main.generate(content=f"step {i}")
            main.user("next")
        elif op == "fish":
            main.generate(content="fishing", sampled_ids=tok.encode("fish") + tok.encode("ing") + [main.eot])
            main.user("more")
        elif op == "sub":
            sub.generate(content=f"sub {i}")
            sub.user("again")
            records.append(sub.records[-1])
            continue
        elif op == "error":
            main.generate(status="error")
        elif op == "length":
            main.generate(reasoning="long thinking " * 5, max_tokens=6)
            main.user("go on")
        elif op == "fork":
            main.generate(content="alt", messages=[dict(m) for m in main.messages], echo=False)
        records.append(main.records[-1])
        if starts:
            after_break.add(main.records[-1].call_id)
    for i, r in enumerate(records):
        r.call_index = i
    d = tmp_path_factory.mktemp("prop")
    df, stats = prefix_merge.build(capture(d, records), template=template, strict=strict)
    check(df, stats, records)
    if strict:
        assert all(all(row) for row in df["merge_exact"].to_list())
    assert sum(stats.break_reasons.values()) == stats.breaks
    for row in df.iter_rows(named=True):
        assert not after_break & set(row["call_ids"][1:]), "a call after a prefix break was merged"
