"""Every real harness CLI through the real proxy against a scripted vLLM-format upstream, both ways.

A small model rarely calls tools, so the multi-turn flow is scripted: turn 1 calls the harness's
shell tool once, turn 2 calls it twice in one assistant message (parallel tool calls), then the
model answers. Checked per harness x {base_url, proxy}: the harness really ran the three commands
(the files exist, so the evaluator gives reward 1.0), and every answer the upstream sent is in the
captures token for token (prompt ids, sampled ids, logprobs), under the rollout's session id with
its task/group ids. The upstream renders prompts with the real Qwen2.5 chat template, so the merge
observations printed at the end are those a real vLLM would give.
"""

from __future__ import annotations

import time

import pytest

from polar_proxy.process import ProxyProcess
from polar_runtime import harnesses as h
from polar_runtime import rollout as r

from .conftest import MATRIX, SERVED, check_token_fields, dump, harness_log_tail, merge_observation, require_installed, run_one

pytestmark = [pytest.mark.harness, pytest.mark.slow]



def shell_call(preset: str, command: str) -> dict:
    """The harness's own shell tool with the argument names its schema declares."""
    if preset.startswith("pi-"):
        return {"name": "bash", "arguments": {"command": command}}
    return {
        "codex": {"name": "exec_command", "arguments": {"cmd": command}},
        "claude-code": {"name": "Bash", "arguments": {"command": command, "description": "Write a file"}},
        "qwen-code": {"name": "run_shell_command", "arguments": {"command": command, "description": "Write a file",
                                                               "is_background": False}},
        "gemini": {"name": "run_shell_command", "arguments": {"command": command, "description": "Write a file"}},
        "opencode": {"name": "bash", "arguments": {"command": command, "description": "Write a file"}},
    }[preset]


def script_for(preset: str) -> list[dict]:
    # Any turn past the second answers with text, however a translation counts assistant messages.
    done = {"text": "Done: one.txt, two.txt and three.txt are written."}
    return [
        {"tool_calls": [shell_call(preset, "echo one > one.txt")]},
        {"tool_calls": [shell_call(preset, "echo two > two.txt"), shell_call(preset, "echo three > three.txt")]},
        done, done, done, done,
    ]


EVALUATOR = "test \"$(cat one.txt)\" = one && test \"$(cat two.txt)\" = two && test \"$(cat three.txt)\" = three"


@pytest.fixture(scope="module")
def proxies(scripted, tmp_path_factory):
    """One proxy per mode, both writing into one capture directory (as several machines may)."""
    root = tmp_path_factory.mktemp("scripted-matrix")
    conf = root / "mitmproxy"
    started = {}
    try:
        for mode, pmode in (("base_url", "reverse"), ("proxy", "regular")):
            started[mode] = ProxyProcess(scripted.url, root / "captures", mode=pmode, confdir=conf,
                                         served_model=SERVED, log_file=root / f"proxy-{pmode}.log").start()
        yield root / "captures", started
    finally:
        for px in started.values():
            px.stop()


def endpoint(px: ProxyProcess, mode: str) -> h.Endpoint:
    return h.Endpoint(mode=mode, base_url=px.url, proxy_url=px.url, ca_cert=px.ca_cert)


@pytest.mark.parametrize("mode", h.MODES)
@pytest.mark.parametrize("name", sorted(h.presets()))
def test_multi_turn_tool_calls(name, mode, scripted, proxies):
    preset = h.get_preset(name)
    require_installed(preset)
    capture_dir, procs = proxies
    px = procs[mode]
    task = r.Task(id=f"multi-{name}-{mode}", instruction="Write one.txt, two.txt and three.txt with the shell.",
                  evaluator=EVALUATOR)
    sid = r.session_id_for(task.id, 0, 0)
    scripted.upstream.script.by_session[sid] = script_for(name)
    scripted.upstream.responses.clear()
    t0 = time.monotonic()
    row, calls, wall = run_one(preset=preset, endpoint=endpoint(px, mode), capture_dir=capture_dir, task=task,
                               model=SERVED, timeout=120, control=px.control)
    sent = list(scripted.upstream.responses)
    MATRIX[("scripted multi-turn", name, mode)] = {
        "result": row["status"], "wall_s": time.monotonic() - t0, "calls": row["calls"],
        "prompt_tokens": row["prompt_tokens"], "sampled_tokens": row["sampled_tokens"],
        "merge": merge_observation(calls, scripted.upstream.tok.hf.decode),
    }
    assert row["status"] == "ok", harness_log_tail(row)
    assert row["session_id"] == sid
    assert row["reward"] == 1.0, f"the harness did not run all three tool calls: {row['evaluator_output']}\n" \
                                 + harness_log_tail(row)
    check_token_fields(calls, sid)
    assert {c["task_id"] for c in calls} == {task.id} and {c["group_id"] for c in calls} == {f"{task.id}.st0"}
    assert {c["sample_index"] for c in calls} == {0}
    assert [c["call_index"] for c in calls] == list(range(len(calls)))
    # Every answer the upstream sent for this session is captured exactly, nothing dropped.
    assert len(sent) >= 3 and len(calls) == len(sent), dump([c["output_text"] for c in calls])
    captured = [(c["prompt_token_ids"], c["sampled_token_ids"], c["sampled_logprobs"]) for c in calls]
    for resp in sent:
        assert (resp["prompt_token_ids"], resp["token_ids"], resp["logprobs"]) in captured
    assert any(len(c["output_tool_calls"]) == 2 for c in calls), "the parallel tool-call turn is missing"
    assert sum(len(c["output_tool_calls"]) for c in calls) >= 3
    assert row["calls"] == len(calls) and row["sampled_tokens"] == sum(len(c["sampled_token_ids"]) for c in calls)
