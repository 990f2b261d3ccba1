"""Fixtures for the analysis tests: the real Qwen2.5 tokenizer + chat template, harness fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_analysis.alignment import ChatTemplateRenderer
from polar_core.paths import harness_request_fixtures

_REPO = Path(__file__).resolve().parents[2]
_FIXTURE_DIRS = (harness_request_fixtures(),)

#: A Qwen3-style template (real Qwen3 behaviour, reduced): history assistant turns are rendered
#: without any think block, but with enable_thinking=false the generation prompt carries an empty
#: "<think>\n\n</think>\n\n". Tool calls/results as in Qwen2.5 (Hermes).
QWEN3_STYLE_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for tc in message.tool_calls or [] %}{%- set f = tc.function %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def harness_request(name: str) -> dict:
    for d in _FIXTURE_DIRS:
        if (d / f"{name}.json").exists():
            return json.loads((d / f"{name}.json").read_text())
    pytest.skip(f"harness fixture {name} not available")


@pytest.fixture(scope="session")
def renderer(tiny_qwen_dir) -> ChatTemplateRenderer:
    """What vLLM does with a chat request for tiny-qwen (real Qwen2.5 tokenizer and template)."""
    return ChatTemplateRenderer(tiny_qwen_dir)


@pytest.fixture(scope="session")
def template(renderer):
    return renderer.template_info()


@pytest.fixture(scope="session")
def pi_chat() -> dict:
    """Pi's real Chat Completions request (system prompt + 4 tools)."""
    return harness_request("pi.chat.second")["body"]


@pytest.fixture(scope="session")
def tok(renderer):
    return renderer.tokenizer
