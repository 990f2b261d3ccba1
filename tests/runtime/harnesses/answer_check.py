"""Evaluator for the live harness runs: did the harness use the model's answer?

Run by the rollout runner after the harness (``python answer_check.py CAPTURE_DIR``, in the work
dir, with POLAR_SESSION and POLAR_HARNESS_STDOUT set). It passes (exit 0) when the text of an
answer of the session -- as captured from vLLM, the last one first -- is in what the harness
printed, or when a later call of the session re-sent it as the assistant's turn (the harness parsed
it and went on). A harness that received the answers, mis-parsed or dropped them and still exited
0 fails here. (Any answer, not only the last: harnesses make side calls whose answers they do not
print -- OpenCode asks for a session title -- and Qwen Code retries answers cut at max_tokens.)

Compared on letters and digits only (ANSI colours removed): harnesses render Markdown, wrap lines
and trim whitespace, none of which changes those; JSON output (``--output-format json``) is also
read as the strings it holds, so ``\\uXXXX`` escapes do not hide an answer. An answer without a
letter or digit is compared as stripped text.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from polar_core.schema import SESSIONS_SUBDIR, read_capture_lines

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def alnum(text: str) -> str:
    return "".join(ch for ch in _ANSI.sub("", text) if ch.isalnum())


def json_strings(text: str) -> str:
    """Every string inside the JSON documents of ``text`` (the whole of it, or one per line)."""
    docs = []
    for chunk in [text, *text.splitlines()]:
        try:
            docs.append(json.loads(chunk))
        except ValueError:
            continue
    out: list[str] = []

    def walk(v):
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for d in docs:
        walk(d)
    return "\n".join(out)


def contains(haystack: str, needle: str) -> bool:
    key = alnum(needle)
    return key in alnum(haystack) if key else needle.strip() in haystack


def resent(answer: str, later: list[dict]) -> bool:
    """A later call's request has the answer as an assistant turn."""
    for call in later:
        for m in (call.get("normalized_request") or {}).get("messages") or []:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if m.get("role") == "assistant" and isinstance(content, str) and contains(content, answer):
                return True
    return False


def verdict(calls: list[dict], stdout: str) -> tuple[bool, str]:
    calls = sorted((c for c in calls if c.get("record_type", "call") == "call" and c.get("status") == "ok"),
                   key=lambda c: c["call_index"])
    answered = [i for i, c in enumerate(calls) if (c.get("output_text") or "").strip()]
    if not answered:
        return False, f"no call of the session answered with text ({len(calls)} ok calls)"
    printed = stdout + "\n" + json_strings(stdout)
    for i in reversed(answered):
        answer, index = calls[i]["output_text"], calls[i]["call_index"]
        if contains(printed, answer):
            return True, f"the harness printed the answer of call {index} (of {len(calls)})"
        if resent(answer, calls[i + 1:]):
            return True, f"a later call re-sent the answer of call {index} (of {len(calls)})"
    last = calls[answered[-1]]["output_text"]
    return False, (f"none of the {len(answered)} answers (last: {last[:200]!r}) is in the harness's output "
                   f"({stdout[-400:]!r}) or re-sent by a later call")


def main(argv: list[str]) -> int:
    session = os.environ["POLAR_SESSION"]
    path = Path(argv[1]) / SESSIONS_SUBDIR / f"{session}.jsonl"
    calls = list(read_capture_lines(path)) if path.exists() else []
    stdout = Path(os.environ["POLAR_HARNESS_STDOUT"]).read_text(errors="replace")
    ok, why = verdict(calls, stdout)
    print(json.dumps({"pass": ok, "why": why}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
