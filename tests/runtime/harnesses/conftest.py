"""Fixtures and checks shared by the harness matrices (scripted upstream and real vLLM).

Every harness run goes through the rollout runner (`run_rollout`), so the matrices also exercise
session registration, evaluators and rollouts.parquet. Wall times per harness are collected and
printed at the end of the pytest run (the issue asks for them).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from polar_core.schema import SESSIONS_SUBDIR, read_capture_lines
from polar_runtime import harnesses as h
from polar_runtime import rollout as r
from polar_testing.scripted_upstream import Script, ServerThread

#: the model name the scripted upstream serves to the matrices
SERVED = "scripted-model"

#: (matrix, preset, mode) -> facts printed in the terminal summary.
MATRIX: dict[tuple[str, str, str], dict[str, Any]] = {}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not MATRIX:
        return
    tr = terminalreporter
    tr.section("harness matrix")
    by_matrix: dict[str, list[tuple[str, str, dict[str, Any]]]] = defaultdict(list)
    for (matrix, preset, mode), facts in MATRIX.items():
        by_matrix[matrix].append((preset, mode, facts))
    for matrix, rows in by_matrix.items():
        tr.write_line(f"{matrix}:")
        tr.write_line(f"  {'harness':<13} {'mode':<9} {'result':<7} {'wall_s':>7} {'calls':>5} "
                      f"{'prompt':>7} {'sampled':>7}  merge (=: exact, ~s: answer re-rendered, !p: history changed)")
        for preset, mode, f in rows:
            tr.write_line(f"  {preset:<13} {mode:<9} {f.get('result', '?'):<7} {f.get('wall_s', 0):>7.1f} "
                          f"{f.get('calls', 0):>5} {f.get('prompt_tokens', 0):>7} {f.get('sampled_tokens', 0):>7}  "
                          f"{f.get('merge', '')}")
        per_harness: dict[str, float] = defaultdict(float)
        for preset, _mode, f in rows:
            per_harness[preset] += f.get("wall_s", 0.0)
        tr.write_line("  wall time per harness: " + ", ".join(f"{k} {v:.1f}s" for k, v in per_harness.items()))


def require_installed(preset: h.Preset) -> None:
    """CI installs every harness in setup; a missing one is a failure, not a skip."""
    if not preset.installed():
        pytest.fail(f"{preset.name} is not installed: run `polar harness install {preset.package}` (setup does)")


def read_calls(capture_dir: Path, session_id: str) -> list[dict[str, Any]]:
    path = capture_dir / SESSIONS_SUBDIR / f"{session_id}.jsonl"
    if not path.exists():
        return []
    out = list(read_capture_lines(path))  # delta records (schema 3) expanded
    return sorted(out, key=lambda c: c["call_index"])


def merge_observation(calls: list[dict[str, Any]], decode: Any | None = None) -> str:
    """What a prefix merger sees between consecutive calls of a session, one mark per pair:

    ``=``  prompt[n] + sampled[n] is a prefix of prompt[n+1] (merges exactly);
    ``~s`` prompt[n] is a prefix of prompt[n+1] but the sampled answer came back re-rendered
           (e.g. the chat template re-serializes tool-call JSON);
    ``!p@i`` prompt[n] itself is not a prefix of prompt[n+1]: the harness changed earlier history or
           its system prompt at token i (what was there -> what is there now).
    """
    notes = []
    for a, b in zip(calls, calls[1:]):
        pa, head, nxt = a["prompt_token_ids"], a["prompt_token_ids"] + a["sampled_token_ids"], b["prompt_token_ids"]
        if nxt[: len(head)] == head:
            notes.append("=")
        elif nxt[: len(pa)] == pa:
            notes.append("~s")
        else:
            i = next((k for k, (x, y) in enumerate(zip(pa, nxt)) if x != y), min(len(pa), len(nxt)))
            note = f"!p@{i}/{len(pa)}"
            if decode is not None:
                was = decode(pa[i : i + 6]).replace("\n", "\\n")
                now = decode(nxt[i : i + 6]).replace("\n", "\\n")
                note += f"({was!r}->{now!r})"
            notes.append(note)
    return " ".join(notes) if notes else "(one call)"


def check_token_fields(calls: list[dict[str, Any]], session_id: str) -> None:
    """The capture invariants every matrix checks: ids and logprobs present, aligned, of this session."""
    assert calls, f"no calls captured for {session_id}"
    for c in calls:
        assert c["session_id"] == session_id and c["status"] == "ok", (c["status"], c.get("error"))
        assert c["prompt_token_ids"], "empty prompt ids"
        assert c["sampled_token_ids"], "no sampled ids"
        assert len(c["sampled_logprobs"]) == len(c["sampled_token_ids"])
        assert all(lp <= 0.0 for lp in c["sampled_logprobs"])


def run_one(
    *,
    preset: h.Preset,
    endpoint: h.Endpoint,
    capture_dir: Path,
    task: r.Task,
    model: str,
    timeout: float,
    control: Any,
) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    """One sample of ``task`` through the rollout runner; (rollouts row, captured calls, wall s)."""
    cfg = r.RolloutConfig(tasks=[task], preset=preset, endpoint=endpoint, capture_dir=capture_dir, model=model,
                          samples=1, timeout=timeout, eval_timeout=30.0)
    t0 = time.monotonic()
    df = r.run_rollout(cfg, control=control)
    wall = time.monotonic() - t0
    row = df.filter(df["task_id"] == task.id).row(0, named=True)
    return row, read_calls(capture_dir, row["session_id"]), wall


def harness_log_tail(row: dict[str, Any], n: int = 3000) -> str:
    logs = Path(row["workdir"]).parent / "logs"
    return "\n".join(p.read_text(errors="replace")[-n:] for p in sorted(logs.glob("*")) if p.is_file())


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]


@pytest.fixture(scope="module")
def scripted(tiny_qwen_dir):
    """The scripted vLLM-format upstream, rendering with the real Qwen2.5 template (tiny-qwen's
    tokenizer); each test sets its session's script in ``upstream.script.by_session``."""
    with ServerThread(served_model=SERVED, max_model_len=131072, tokenizer=str(tiny_qwen_dir),
                      script=Script({"*": ["text"]}), log_size=256) as up:
        yield up
