"""Hand-built requests in the shapes real harnesses send where no recorded fixture exists
(Codex's Responses input, Gemini CLI with ids and thought signatures, Claude Code without
--bare). Plain data, shared by the request tests and the real-vLLM test."""

from __future__ import annotations

OBJ = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


def fn(name):
    return {"type": "function", "name": name, "description": f"{name} tool", "strict": False,
            "parameters": OBJ}


CODEX = {
    "model": "gpt-5.1-codex",
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions instructions>sandbox</permissions instructions>"}]},
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are Codex, a coding agent."}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context>cwd=/w</environment_context>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Create hi.txt"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Need a shell."}],
         "content": None, "encrypted_content": "gAAAAB-opaque"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_A", "name": "shell_command",
         "arguments": "{\"command\":\"echo hi > hi.txt\"}"},
        {"type": "function_call_output", "call_id": "call_A", "output": "Exit code: 0\nOutput:\n"},
        {"type": "message", "role": "assistant", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Done.", "annotations": []}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "now list it"}]},
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions changed>"}]},
    ],
    "tools": [
        fn("shell_command"), fn("update_plan"),
        {"type": "namespace", "name": "mcp__fs", "description": "fs server",
         "tools": [fn("mcp__fs__read")]},
        {"type": "namespace", "name": "collab", "description": "agents", "tools": []},
        {"type": "web_search", "external_web_access": False},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
        {"type": "local_shell"},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "019a-thread",
    "text": {"verbosity": "low"},
}


GEMINI_CLI = {
    "contents": [
        {"role": "user", "parts": [{"text": "Create hi.txt"}]},
        {"role": "model", "parts": [
            {"text": "Plan: use the shell.", "thought": True},
            {"functionCall": {"id": "gc-1", "name": "run_shell_command",
                              "args": {"command": "echo hi > hi.txt", "description": "write"}},
             "thoughtSignature": "CiQBVKhc7opaque"}]},
        {"role": "user", "parts": [{"functionResponse": {
            "id": "gc-1", "name": "run_shell_command",
            "response": {"output": "Command: echo hi > hi.txt\nExit Code: 0"}}}]},
        {"role": "model", "parts": [{"text": "Done"}, {"text": " - created."}]},
        {"role": "user", "parts": [{"text": "Now read a and b"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "read_file", "args": {"path": "a"}}},
                                    {"functionCall": {"name": "read_file", "args": {"path": "b"}}}]},
        {"role": "user", "parts": [
            {"functionResponse": {"name": "read_file", "response": {"output": "AAA"}}},
            {"functionResponse": {"name": "read_file", "response": {"error": "no such file"}}}]},
    ],
    "systemInstruction": {"role": "user", "parts": [{"text": "You are Gemini CLI."},
                                                    {"text": "Be careful."}]},
    "tools": [{"functionDeclarations": [
        {"name": "run_shell_command", "description": "Runs a command",
         "parametersJsonSchema": OBJ},
        {"name": "read_file", "description": "Reads",
         "parameters": {"type": "OBJECT", "properties": {"path": {"type": "STRING"},
                                                         "lines": {"type": "ARRAY",
                                                                   "items": {"type": "INTEGER"}}},
                        "required": ["path"]}}]},
        {"googleSearch": {}}],
    "generationConfig": {"temperature": 0, "topP": 1, "maxOutputTokens": 100,
                         "thinkingConfig": {"includeThoughts": True, "thinkingBudget": -1}},
    "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
}
GEMINI_PATH = "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"


CLAUDE_NON_BARE = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 128000,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cch=abc12;"},
               {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "system", "content": "<system-reminder>skills: none</system-reminder>"},
        {"role": "user", "content": [{"type": "text", "text": "Fix the bug"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look at the file.", "signature": "EqQBopaque"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_01", "name": "Read",
             "input": {"file_path": "/a.py", "limit": 5, "note": "naïve"}},
            {"type": "tool_use", "id": "toolu_02", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": "line1"}, {"type": "text", "text": "line2"}]},
            {"type": "tool_result", "tool_use_id": "toolu_02", "content": "boom", "is_error": True},
            {"type": "text", "text": "continue", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": [{"type": "text", "text": "<system-reminder>todo</system-reminder>"}]},
        {"role": "user", "content": "and then?"},
    ],
    "tools": [
        {"name": "Read", "description": "Reads a file", "input_schema": OBJ},
        {"name": "Bash", "input_schema": OBJ, "cache_control": {"type": "ephemeral"}},
        {"name": "mcp__srv__tool", "description": "deferred", "input_schema": OBJ,
         "defer_loading": True},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    ],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "temperature": 1,
    "stop_sequences": ["END"],
    "metadata": {"user_id": "u"},
    "context_management": {"edits": []},
    "stream": True,
}
