"""Runs inside the vLLM venv (see test_lenient_parser.py): the polar_lenient parser on real outputs."""

import json
import sys

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

ToolParserManager.import_tool_parser(sys.argv[1])
tok = AutoTokenizer.from_pretrained(sys.argv[2])
parser_cls = ToolParserManager.get_tool_parser("polar_lenient")
tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in ("read", "bash", "edit", "write")]
out = []
for text in json.loads(sys.argv[3]):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools, max_tokens=200)
    whole = parser_cls(tok, None).extract_tool_calls(text, req)
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    p = parser_cls(tok, None)
    prev_text, prev_ids, content, calls = "", [], "", {}
    for k, tid in enumerate(ids):
        cur_ids = ids[: k + 1]
        cur_text = tok.decode(cur_ids, skip_special_tokens=True)
        delta = p.extract_tool_calls_streaming(prev_text, cur_text, cur_text[len(prev_text):], prev_ids, cur_ids, [tid], req)
        if delta is not None:
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        prev_text, prev_ids = cur_text, cur_ids
    out.append({
        "whole": {"called": whole.tools_called, "content": whole.content,
                  "calls": [[c.function.name, c.function.arguments] for c in whole.tool_calls]},
        "stream": {"content": content, "calls": [[c["name"], c["arguments"]] for _, c in sorted(calls.items())]},
    })
print(json.dumps(out))
