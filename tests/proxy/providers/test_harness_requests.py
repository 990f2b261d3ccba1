"""Real harness requests (Pi in four wire formats, Qwen Code, Claude Code --bare) normalize to
valid, deterministic chat requests whose first turn is a prefix of the second."""

from __future__ import annotations

import copy
import json
import re

import pytest

from polar_proxy.providers import PROVIDERS, detect_provider
from polar_core.paths import models_dir

ROLES_1 = ["system", "user"]
ROLES_2 = ["system", "user", "assistant", "tool"]
#: name -> (provider, roles, tool names)
EXPECT = {
    "claude-code.bare": ("anthropic", ROLES_1, ["Bash", "Edit", "Read"]),
    "pi.anthropic": ("anthropic", ROLES_1, ["read", "bash", "edit", "write"]),
    "pi.anthropic.second": ("anthropic", ROLES_2, ["read", "bash", "edit", "write"]),
    "pi.chat": ("openai_chat", ROLES_1, ["read", "bash", "edit", "write"]),
    "pi.chat.second": ("openai_chat", ROLES_2, ["read", "bash", "edit", "write"]),
    "pi.responses": ("openai_responses", ROLES_1, ["read", "bash", "edit", "write"]),
    "pi.responses.second": ("openai_responses", ROLES_2, ["read", "bash", "edit", "write"]),
    "pi.gemini": ("google", ROLES_1, ["read", "bash", "edit", "write"]),
    "pi.gemini.second": ("google", ROLES_2, ["read", "bash", "edit", "write"]),
    "qwen-code": ("openai_chat", ROLES_1, None),
    "qwen-code.second": ("openai_chat", ROLES_2, None),
}
PAIRS = [(n, n + ".second") for n in ("pi.anthropic", "pi.chat", "pi.responses", "pi.gemini",
                                      "qwen-code")]
HARNESS_ONLY = {"stream_options", "store", "max_completion_tokens", "max_output_tokens", "input",
                "system", "contents", "generationConfig", "prompt_cache_key", "metadata",
                "thinking", "output_config", "systemInstruction", "logprobs"}


def normalize(h, name):
    req = h.load_request(name)
    provider = detect_provider(req["method"], req["path"], req["headers"], req["body"])
    assert provider is not None, name
    return provider, req, provider.to_chat(req["body"], req["path"], req["query"])


def test_every_fixture_is_covered(fixture_dir):
    assert sorted(p.stem for p in fixture_dir.glob("*.json")) == sorted(EXPECT)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_fixture_normalizes(h, name):
    provider_name, roles, tool_names = EXPECT[name]
    provider, req, call = normalize(h, name)
    assert provider.name == provider_name
    chat = call.chat_request
    body = req["body"]
    assert [m["role"] for m in chat["messages"]] == roles
    # model restored from the body or (Google) the path; stream flag kept
    model = body.get("model") or re.search(r"models/([^:]+):", req["path"]).group(1)
    assert call.requested_model == chat["model"] == model
    assert call.stream is True and chat["stream"] is True
    native_max = (body.get("max_tokens") or body.get("max_completion_tokens")
                  or body.get("max_output_tokens") or body["generationConfig"]["maxOutputTokens"])
    assert chat["max_tokens"] == native_max
    assert not HARNESS_ONLY & set(chat), HARNESS_ONLY & set(chat)
    for m in chat["messages"]:
        assert isinstance(m["content"], str) or (m["role"] == "assistant" and m["content"] is None)
    # every tool result answers an earlier tool call, every tool call is answered
    calls = [tc["id"] for m in chat["messages"] for tc in m.get("tool_calls") or []]
    results = [m["tool_call_id"] for m in chat["messages"] if m["role"] == "tool"]
    assert calls == results
    tools = chat["tools"]
    # Qwen Code sends two tools without parameters: passed on as they are (optional in chat)
    assert all(t["type"] == "function" and isinstance(t["function"].get("parameters", {}), dict)
               for t in tools)
    names = [t["function"]["name"] for t in tools]
    if tool_names is not None:
        assert names == tool_names
    else:
        assert len(names) == len(body["tools"]) == 14
    json.dumps(chat)  # plain JSON


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_normalization_is_deterministic_and_pure(h, name):
    req = h.load_request(name)
    before = copy.deepcopy(req["body"])
    provider = PROVIDERS[EXPECT[name][0]]
    a = provider.to_chat(req["body"], req["path"], req["query"])
    b = provider.to_chat(copy.deepcopy(req["body"]), req["path"], req["query"])
    assert json.dumps(a.chat_request) == json.dumps(b.chat_request)
    assert a.notes == b.notes
    assert req["body"] == before  # the native body is not modified


def test_claude_code_billing_header_stripped(h):
    provider, req, call = normalize(h, "claude-code.bare")
    system = call.chat_request["messages"][0]["content"]
    assert "x-anthropic-billing-header" not in system
    assert system.startswith("You are a Claude agent")
    assert system.endswith("CWD: /home/dev/agents/claude/work\nDate: 2026-11-30")
    assert any("billing-header" in n for n in call.notes)
    assert call.chat_request["chat_template_kwargs"] == {"enable_thinking": True}  # adaptive
    # the header changes on every request; the normalized request must not
    other = copy.deepcopy(req["body"])
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.332.bb5; cch=9a8b7;"
    again = provider.to_chat(other, req["path"], req["query"])
    assert again.chat_request == call.chat_request


@pytest.mark.parametrize("first,second", PAIRS)
def test_first_turn_is_prefix_of_second(h, first, second):
    _, _, a = normalize(h, first)
    _, _, b = normalize(h, second)
    n = len(a.chat_request["messages"])
    assert b.chat_request["messages"][:n] == a.chat_request["messages"]
    assert b.chat_request["tools"] == a.chat_request["tools"]


@pytest.mark.parametrize("name", ["pi.anthropic.second", "pi.chat.second", "pi.responses.second",
                                  "pi.gemini.second"])
def test_pi_second_turn_tool_call_and_result(h, name):
    _, _, call = normalize(h, name)
    assistant, tool = call.chat_request["messages"][2:]
    (tc,) = assistant["tool_calls"]
    assert tc["type"] == "function" and tc["function"]["name"] == "bash"
    assert json.loads(tc["function"]["arguments"]) == {"command": "echo hi > hi.txt && echo hi"}
    assert tool["tool_call_id"] == tc["id"] and tool["content"] == "hi\n"
    assert not assistant["content"]


def test_pi_formats_agree(h):
    """The same Pi session in four wire formats reaches the engine as the same conversation."""
    seen = []
    for fmt in ("anthropic", "chat", "responses", "gemini"):
        _, _, call = normalize(h, f"pi.{fmt}.second")
        msgs = call.chat_request["messages"]
        seen.append((msgs[0]["content"], msgs[1]["content"], msgs[3]["content"],
                     [t["function"]["name"] for t in call.chat_request["tools"]],
                     [t["function"]["parameters"]["properties"]
                      for t in call.chat_request["tools"]]))
    assert all(s == seen[0] for s in seen[1:])
    assert seen[0][1] == "Run echo hi in the shell"


def test_gemini_ids_generated_by_position(h):
    _, _, call = normalize(h, "pi.gemini.second")
    assistant, tool = call.chat_request["messages"][2:]
    assert assistant["tool_calls"][0]["id"] == "call_1_0" == tool["tool_call_id"]


def test_qwen_code_part_arrays(h):
    _, req, call = normalize(h, "qwen-code.second")
    user, tool = call.chat_request["messages"][1], call.chat_request["messages"][3]
    parts = [p["text"] for p in req["body"]["messages"][1]["content"]]
    assert len(parts) == 5 and user["content"] == "\n".join(parts)
    assert tool["content"].startswith("Command: echo hi > hi.txt && echo hi\n")
    assert "Exit Code: 0" in tool["content"]
    assert "stream_options" not in call.chat_request
    assert call.options["include_usage"] is True


def _tokenizer():
    transformers = pytest.importorskip("transformers")
    path = models_dir() / "tiny-qwen"
    if not (path / "tokenizer_config.json").exists():
        pytest.skip(f"{path} not built (polar models build)")
    return transformers.AutoTokenizer.from_pretrained(str(path))


def test_rendered_prompts_with_real_chat_template(h):
    """The Qwen2.5 chat template renders every normalized request, and the first turn's
    conversation renders as a prefix of the second turn's prompt (what prefix merging needs)."""
    tok = _tokenizer()
    for first, second in PAIRS:
        _, _, a = normalize(h, first)
        _, _, b = normalize(h, second)
        ra = tok.apply_chat_template(a.chat_request["messages"], tools=a.chat_request["tools"],
                                     tokenize=False, add_generation_prompt=True)
        rb = tok.apply_chat_template(b.chat_request["messages"], tools=b.chat_request["tools"],
                                     tokenize=False, add_generation_prompt=True)
        assert rb.startswith(ra), first
        assert "<tool_call>" in rb[len(ra):] and "<tool_response>" in rb[len(ra):]
        for t in b.chat_request["tools"]:
            assert f'"name": "{t["function"]["name"]}"' in rb
