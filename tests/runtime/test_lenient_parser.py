"""The ``polar_lenient`` vLLM tool parser (polar_runtime/lenient_tool_parser.py), run inside the
vLLM venv with the real Qwen2.5 tokenizer, whole and token-by-token streamed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from polar_core import paths
from polar_runtime.serve import LENIENT_PARSER

CHECK = Path(__file__).with_name("lenient_parser_check.py")

WRITE = '{"name": "write", "arguments": {"path": "hello.txt", "content": "hello world"}}'
CASES = [
    # what Qwen2.5-Coder-0.5B really answers (from the demo's captures): a fenced JSON block
    ("```json\n" + WRITE + "\n```", None, [["write", '{"path": "hello.txt", "content": "hello world"}']]),
    # bare, and cut short of its last brace before <|im_end|>
    ('{"name": "write", "arguments": {"path": "a.txt", "content": "x\\n"}', None, [["write", '{"path": "a.txt", "content": "x\\n"}']]),
    # Hermes stays Hermes
    ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>', None, [["bash", '{"command": "ls"}']]),
    # two fenced calls
    ('```json\n{"name": "read", "arguments": {"path": "a"}}\n```\n```json\n{"name": "read", "arguments": {"path": "b"}}\n```',
     None, [["read", '{"path": "a"}'], ["read", '{"path": "b"}']]),
    # a call, a stray fence and prose after it (a real 0.5B answer): the call, the rest dropped
    (WRITE + '\n```\n\nThis file is created with the text "hello world".', None,
     [["write", '{"path": "hello.txt", "content": "hello world"}']]),
    # not tool calls: text, an unknown tool name, prose before the JSON, arguments not an object, other code
    ("Sure, here it is: 42", "Sure, here it is: 42", []),
    ('{"name": "nope", "arguments": {}}', '{"name": "nope", "arguments": {}}', []),
    ("Call this: " + WRITE, "Call this: " + WRITE, []),
    ('```json\n{"name": "write", "arguments": [2, 3]}\n```', '```json\n{"name": "write", "arguments": [2, 3]}\n```', []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
]


@pytest.mark.vllm
@pytest.mark.slow
def test_lenient_parser_whole_and_streamed(qwen05_dir: Path) -> None:
    if not paths.vllm_python().exists():
        pytest.fail(f"vLLM venv missing ({paths.vllm_python()}): run scripts/setup.sh")
    texts = [c[0] for c in CASES]
    proc = subprocess.run([str(paths.vllm_python()), str(CHECK), str(LENIENT_PARSER), str(qwen05_dir), json.dumps(texts)],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (text, content, calls), got in zip(CASES, results, strict=True):  # a result per case, no fewer
        assert got["whole"]["calls"] == calls, text
        assert got["whole"]["called"] == bool(calls), text
        assert got["stream"]["calls"] == calls, text
        if content is None:
            assert not got["whole"]["content"] and not got["stream"]["content"], text
        else:  # everything the model wrote reaches the harness, whole or streamed
            assert got["whole"]["content"] == content and got["stream"]["content"] == content, text
