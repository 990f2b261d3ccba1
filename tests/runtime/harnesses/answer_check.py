"""Evaluator for the live harness runs: did the harness use the model's answer?

Run by the rollout runner after the harness (``python answer_check.py CAPTURE_DIR``, in the work
dir, with POLAR_SESSION and POLAR_HARNESS_STDOUT set). It passes (exit 0) when the text of the
session's last answer -- as captured from vLLM -- is in what the harness printed, or when a later
call of the session re-sent it as the assistant's turn (the harness parsed it and went on). A
harness that received the answer, mis-parsed or dropped it and still exited 0 fails here.

Compared on letters and digits only (ANSI colours removed): harnesses render Markdown, wrap lines
and trim whitespace, none of which changes those. An answer without a letter or digit is compared
as stripped text.
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
    last = answered[-1]
    answer = calls[last]["output_text"]
    if contains(stdout, answer):
        return True, f"the harness printed the answer of call {calls[last]['call_index']}"
    if resent(answer, calls[last + 1:]):
        return True, f"a later call re-sent the answer of call {calls[last]['call_index']}"
    return False, (f"the answer of call {calls[last]['call_index']} ({answer[:200]!r}) is neither in the "
                   f"harness's output ({stdout[-400:]!r}) nor re-sent by a later call")


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
