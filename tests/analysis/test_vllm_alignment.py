"""Against a real vLLM (tiny-qwen): the re-renderer reproduces the server's prompt ids exactly, and
trajectories rebuilt from real ids keep every sampled id."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from polar_analysis import alignment, frames
from polar_core.schema import CallRecord
from polar_analysis.synthetic import write_capture
from polar_analysis.trajectories import prefix_merge

from .conftest import harness_request
from .test_trajectories import check

pytestmark = pytest.mark.vllm


def chat(server, body: dict) -> dict:
    body = dict(body, model="tiny-qwen", return_token_ids=True, logprobs=True)
    req = urllib.request.Request(f"{server.base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)


EDGE = {
    "parts_billing_developer": {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.332; cch=9f3a1;\nYou are Claude Code."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    },
    "tool_history": {
        "messages": [
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": "Sure.\n", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls",  "z": [1, 2]}'}},
                {"id": "c2", "type": "function", "function": {"name": "read", "arguments": "not json"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a.py"}, {"type": "text", "text": "b.py"}]},
            {"role": "tool", "tool_call_id": "c2", "content": "err"},
        ],
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}},
                  {"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": {"type": "object"}, "strict": False}},
                  {"type": "function", "function": {"name": "noparams", "description": "vLLM dumps parameters: null"}}],
    },
}


@pytest.mark.parametrize("name", ["pi.chat.second", "qwen-code.second", *EDGE])
def test_rerender_matches_vllm_prompt_ids(vllm_tiny, renderer, name):
    body = EDGE[name] if name in EDGE else {k: harness_request(name)["body"][k] for k in ("messages", "tools")}
    resp = chat(vllm_tiny, dict(body, max_tokens=1))
    server = np.asarray(resp["prompt_token_ids"])
    al = alignment.compare(server, renderer.render(body), renderer.decode)
    assert al.status == "exact", f"first divergence {al.first_divergence}: {al.server_text!r} vs {al.rendered_text!r}"


def test_real_multi_turn_ids_merge_without_loss(vllm_tiny, renderer, template, tmp_path):
    """A harness-like loop on the real server: echo each answer's text, add a user turn, repeat."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    records = []
    for i in range(4):
        body = {"messages": json.loads(json.dumps(messages)), "max_tokens": 8, "temperature": 0, "seed": i}
        resp = chat(vllm_tiny, body)
        choice = resp["choices"][0]
        records.append(CallRecord(
            call_id=f"v{i}", session_id="real", call_index=i, served_model="tiny-qwen", normalized_request=body,
            prompt_token_ids=resp["prompt_token_ids"], sampled_token_ids=choice["token_ids"],
            sampled_logprobs=[c["logprob"] for c in choice["logprobs"]["content"]],
            finish_reason=choice["finish_reason"], output_text=choice["message"]["content"] or "",
        ))
        messages += [{"role": "assistant", "content": choice["message"]["content"] or ""}, {"role": "user", "content": f"Again {i}."}]
    write_capture(tmp_path, records)
    lf = frames.calls(tmp_path)
    assert set(alignment.align(lf, renderer)["status"]) == {"exact"}
    df, stats = prefix_merge.build(lf, template=template)
    assert stats.merges == 3 and stats.breaks == 0 and df.height == 1
    # positions, not only counts: every sampled id where it belongs, with its own logprob
    seen = check(df, stats, records)
    starts = [seen[r.call_id][1][0] for r in records]
    assert starts == sorted(starts) and starts[0] == len(records[0].prompt_token_ids)
    for a, b, kind in zip(records, records[1:], [k for row in df["merge_kind"].to_list() for k in row]):
        exact = b.prompt_token_ids[: len(a.prompt_token_ids) + len(a.sampled_token_ids)] == a.prompt_token_ids + a.sampled_token_ids
        assert (kind == "exact") == exact
