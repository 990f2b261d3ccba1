"""Tasks with follow-up user turns: each real harness CLI is started again on the next instruction
with its own resume flag (``Session.resume``), so it re-sends the whole conversation, the model's
earlier answers (a tool call, then text) included. Through the proxy in exact-history mode, the
first call of a follow-up must be spliced onto what the model sampled in the run before: that call's
prompt ids start with the previous call's prompt ids + sampled ids, and its record says ``exact``.

Two harnesses edit the history when they resume: Qwen Code and Gemini CLI render their
environment context again (a directory listing, now with the file the first run wrote, in the
first user message; Gemini CLI's skill list in its system prompt changed order once too). Nothing of the old conversation can
be spliced then (a splice must not contradict what the harness sent): the call is rendered and
labelled ``history_edited``, which the test requires exactly where the messages changed.

Against the scripted vLLM-format upstream (real Qwen2.5 template through render / generate /
derender), so that every harness really gets a tool call and a text answer to re-send; then two
long-prompt harnesses (Codex, OpenCode: 5k-token prompts) against a real vLLM serving tiny-qwen,
whose random-weight answers are text cut at the output cap (``length``), so each splice also closes
a truncated turn. The side-by-side measurement is `benchmarks/bench_exact_onoff.py --tasks followups`.
"""

from __future__ import annotations

import orjson
import pytest

from polar_runtime import harnesses as h
from polar_runtime import rollout as r
from polar_testing.proxies import capturing_proxy

from .conftest import MATRIX, SERVED, check_token_fields, harness_log_tail, merge_observation, require_installed, run_one
from .test_scripted_matrix import shell_call

pytestmark = [pytest.mark.harness, pytest.mark.slow]

FOLLOWUP = "Now also write two.txt."
#: harnesses that rewrite earlier messages of the conversation when they resume it (seen above)
EDITS_HISTORY_ON_RESUME = {"gemini", "qwen-code"}


def script_for(preset: str) -> list[dict]:
    # by the number of assistant turns in the conversation: run 1 calls the shell and answers;
    # the follow-up run (two assistant turns re-sent) calls it again and answers
    return [{"tool_calls": [shell_call(preset, "echo one > one.txt")]}, {"text": "Wrote one.txt."},
            {"tool_calls": [shell_call(preset, "echo two > two.txt")]}, {"text": "Wrote two.txt."},
            {"text": "Done."}, {"text": "Done."}]


@pytest.fixture(scope="module")
def proxy(scripted, tmp_path_factory):
    with capturing_proxy(scripted.url, tmp_path_factory.mktemp("followups"), SERVED) as started:
        yield started


def _mentions(call: dict, text: str) -> bool:
    return text in str(call["normalized_request"])


def _normalized(call: dict) -> dict:
    req = call["normalized_request"]
    return orjson.loads(req) if isinstance(req, (str, bytes)) else req


@pytest.mark.parametrize("name", sorted(h.presets()))
def test_followup_resends_the_history_and_is_spliced_exactly(name, scripted, proxy):
    preset = h.get_preset(name)
    require_installed(preset)
    capture_dir, px = proxy
    task = r.Task(id=f"followup-{name}", instruction="Write one.txt with the shell.", followups=[FOLLOWUP],
                  evaluator="test \"$(cat one.txt)\" = one && test \"$(cat two.txt)\" = two")
    sid = r.session_id_for(task.id, 0, 0)
    scripted.upstream.script.by_session[sid] = script_for(name)
    row, calls, wall = run_one(preset=preset, endpoint=h.Endpoint("base_url", base_url=px.url),
                               capture_dir=capture_dir, task=task, model=SERVED, timeout=180, control=px.control)
    MATRIX[("follow-up turns, exact history", name, "base_url")] = {
        "result": row["status"], "wall_s": wall, "calls": row["calls"], "prompt_tokens": row["prompt_tokens"],
        "sampled_tokens": row["sampled_tokens"], "merge": merge_observation(calls, scripted.upstream.tok.hf.decode)}
    assert row["status"] == "ok" and row["turns"] == 2, harness_log_tail(row)
    assert row["reward"] == 1.0, f"the follow-up did not run: {row['evaluator_output']}\n" + harness_log_tail(row)
    check_token_fields(calls, sid)
    # the follow-up's calls carry the first run's conversation and the new instruction
    first = next(i for i, c in enumerate(calls) if _mentions(c, FOLLOWUP))
    assert first > 0 and all(not _mentions(c, FOLLOWUP) for c in calls[:first])
    # the calls that answered the first run with a tool call and with text (the scripted turns)
    answered = [c for c in calls[:first] if c["output_tool_calls"] or c["output_text"] == "Wrote one.txt."]
    assert answered and answered[-1]["output_text"] == "Wrote one.txt.", [c["output_text"] for c in calls]
    before, resumed = answered[-1], calls[first]
    head = before["prompt_token_ids"] + before["sampled_token_ids"]
    was, now = _normalized(before), _normalized(resumed)
    edited = now["messages"][: len(was["messages"])] != was["messages"] or now.get("tools") != was.get("tools")
    assert edited == (name in EDITS_HISTORY_ON_RESUME), "the harness changed how it resumes a conversation"
    label = (resumed["history"], resumed["history_cause"], resumed["translation_notes"])
    if edited:  # nothing may be spliced into a history the harness rewrote; the record says why
        assert resumed["history"] == "rendered" and resumed["history_cause"] == "history_edited", label
        return
    assert resumed["history"] == "exact", label
    assert resumed["prompt_token_ids"][: len(head)] == head  # the model's own ids, not a re-rendering
    assert f"exact history: spliced after call {before['call_index']}" in resumed["translation_notes"]


REAL_CAP = 24  # polar_max_tokens_cap on the real runs: every tiny-qwen answer is cut (finish length)


@pytest.fixture(scope="module")
def real_proxy(vllm_tiny, tmp_path_factory):
    with capturing_proxy(vllm_tiny.base_url, tmp_path_factory.mktemp("followups-real"),
                         vllm_tiny.served_model_name, polar_max_tokens_cap=REAL_CAP) as started:
        yield started


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["codex", "opencode"])
def test_followups_on_real_vllm_are_spliced_exactly(name, vllm_tiny, real_proxy, tiny_qwen_dir):
    from transformers import AutoTokenizer

    preset = h.get_preset(name)
    require_installed(preset)
    capture_dir, px = real_proxy
    followups = ["Now append a second line.", "How many lines are there?"]
    task = r.Task(id=f"real-followup-{name}", instruction="Create notes.txt with one line.", followups=followups)
    row, calls, wall = run_one(preset=preset, endpoint=h.Endpoint("base_url", base_url=px.url),
                               capture_dir=capture_dir, task=task, model=vllm_tiny.served_model_name,
                               timeout=240, control=px.control)
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen_dir))
    MATRIX[("follow-up turns on real vLLM (tiny-qwen), exact history", name, "base_url")] = {
        "result": row["status"], "wall_s": wall, "calls": row["calls"], "prompt_tokens": row["prompt_tokens"],
        "sampled_tokens": row["sampled_tokens"], "merge": merge_observation(calls, tok.decode)}
    assert row["status"] == "ok" and row["turns"] == 3, harness_log_tail(row)
    check_token_fields(calls, row["session_id"])
    for text in followups:
        at = next(i for i, c in enumerate(calls) if _mentions(c, text))
        before, resumed = calls[at - 1], calls[at]
        assert before["finish_reason"] == "length" and len(before["sampled_token_ids"]) == REAL_CAP
        head = before["prompt_token_ids"] + before["sampled_token_ids"]
        assert resumed["history"] == "exact", (resumed["history"], resumed["history_cause"], resumed["translation_notes"])
        # the model's own ids, then the end of turn closing the cut answer, then the new turn
        assert resumed["prompt_token_ids"][: len(head) + 1] == head + [tok.convert_tokens_to_ids("<|im_end|>")]
        assert len(before["prompt_token_ids"]) > 4000  # the harness's long system prompt and tools
