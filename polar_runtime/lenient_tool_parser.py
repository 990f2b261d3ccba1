"""vLLM tool-call parser plugin ``polar_lenient``: Hermes ``<tool_call>`` blocks, plus the bare or
```json-fenced ``{"name": ..., "arguments": {...}}`` objects small models write instead.

Why: Qwen2.5-Coder-0.5B (the model the demo serves on CPU) sees the Hermes instructions in its chat
template but answers a tool call as a Markdown JSON block, practically never with ``<tool_call>``.
vLLM's ``hermes`` parser then returns it as plain text, the harness stops after one turn and every
reward is zero. This parser keeps Hermes behaviour and additionally reads an answer that starts with
such JSON objects (optionally fenced) as tool calls, when their names are among the request's tools
(text after them is dropped, as Hermes drops text after ``</tool_call>``). Token ids and logprobs are untouched: only how the answer text is presented changes.

Loaded by the vLLM server process (its own venv), never imported by Polar itself::

    python -m vllm.entrypoints.openai.api_server ... \\
        --tool-parser-plugin polar_runtime/lenient_tool_parser.py --tool-call-parser polar_lenient

Streaming: text that starts like a JSON object or a code fence is held back until the generation
ends (an end-of-sequence id or ``max_tokens`` reached), then sent as tool calls or, if it was not
one, as content; anything else streams exactly as with ``hermes``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

PARSER_NAME = "polar_lenient"
_FENCE_OPEN = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n?")
_DECODER = json.JSONDecoder()


def tool_names(request: Any) -> set[str]:
    names = set()
    for tool in getattr(request, "tools", None) or []:
        fn = getattr(tool, "function", None)
        name = getattr(fn, "name", None) if fn is not None else getattr(tool, "name", None)
        if name:
            names.add(name)
    return names


def parse_json_calls(text: str, names: set[str]) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] when ``text`` starts with tool-call objects (each optionally in a
    code fence) naming known tools; None otherwise. Text after the calls is ignored, as vLLM's
    Hermes parser ignores text after ``</tool_call>``."""
    calls: list[tuple[str, str]] = []
    pos, n = 0, len(text)
    while True:
        while pos < n and text[pos].isspace():
            pos += 1
        if pos >= n:
            break
        fenced = _FENCE_OPEN.match(text, pos)
        start = fenced.end() if fenced else pos
        while start < n and text[start].isspace():
            start += 1
        if start >= n or text[start] != "{":
            break  # trailing prose (or nothing more): done
        obj, end = _decode_object(text, start)
        if not isinstance(obj, dict) or obj.get("name") not in names:
            break
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                break
        if not isinstance(args, dict):
            break
        calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
        pos = end
        if fenced:
            while pos < n and text[pos].isspace():
                pos += 1
            if text.startswith("```", pos):
                pos += 3
    return calls or None


def _decode_object(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value at ``pos``; an object cut short of its last closing braces at the very end
    of the answer (small models stop early) is completed. (None, pos) when there is none."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        pass
    tail = text[pos:].rstrip()
    if tail.endswith("```"):
        tail = tail[:-3].rstrip()
    for braces in ("}", "}}"):
        try:
            obj, end = _DECODER.raw_decode(tail + braces)
        except ValueError:
            continue
        if end == len(tail) + len(braces):
            return obj, len(text)
    return None, pos


def _could_be_json_start(stripped: str) -> bool | None:
    """True: starts like a JSON object or fence; False: cannot; None: too short to tell."""
    if not stripped:
        return None
    if stripped[0] == "{" or stripped.startswith("```"):
        return True
    if "```".startswith(stripped):
        return None
    return False


@ToolParserManager.register_module(PARSER_NAME)
class LenientHermesToolParser(Hermes2ProToolParser):
    """Hermes, plus whole-answer JSON tool calls (see the module docstring)."""

    def __init__(self, tokenizer: Any, tools: Any = None):
        super().__init__(tokenizer, tools)
        self._json_mode: bool | None = None  # streaming: undecided / holding JSON / plain Hermes
        vocab = self.vocab
        eos = {getattr(tokenizer, "eos_token_id", None), vocab.get("<|im_end|>"), vocab.get("<|endoftext|>")}
        self._eos_ids = {i for i in eos if isinstance(i, int)}

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        info = super().extract_tool_calls(model_output, request)
        if info.tools_called:
            return info
        calls = parse_json_calls(model_output, tool_names(request))
        if not calls:
            return info
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=[ToolCall(type="function", function=FunctionCall(name=n, arguments=a)) for n, a in calls],
            content=None,
        )

    def _finished(self, current_token_ids: Sequence[int], delta_token_ids: Sequence[int], request: Any) -> bool:
        if any(t in self._eos_ids for t in delta_token_ids):
            return True
        limit = getattr(request, "max_completion_tokens", None) or getattr(request, "max_tokens", None)
        return bool(limit) and len(current_token_ids) >= limit

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        if self._json_mode is None:
            self._json_mode = _could_be_json_start(current_text.lstrip())
        if self._json_mode is False:
            return super().extract_tool_calls_streaming(
                previous_text, current_text, delta_text, previous_token_ids, current_token_ids,
                delta_token_ids, request,
            )
        if not self._finished(current_token_ids, delta_token_ids, request):
            return None  # undecided or holding a JSON answer until the generation ends
        calls = parse_json_calls(current_text, tool_names(request)) if self._json_mode else None
        if not calls:
            return DeltaMessage(content=current_text) if current_text else None
        deltas = []
        for i, (name, args) in enumerate(calls):
            self.prev_tool_call_arr.append({"name": name, "arguments": args})
            self.streamed_args_for_tool.append(args)
            deltas.append(DeltaToolCall(index=i, type="function", id=make_tool_call_id(),
                                        function=DeltaFunctionCall(name=name, arguments=args).model_dump(exclude_none=True)))
        return DeltaMessage(tool_calls=deltas)
