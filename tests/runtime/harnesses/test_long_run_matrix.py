"""Long-run acceptance (issue 16): a real harness CLI through the real proxy against the scripted
vLLM-format upstream, in one session that hits the output budget in the middle of a tool call, reads
an image file, and compacts its history. The run completes, every upstream answer is captured, and
the drift report names each compaction.

Done for Codex so far (its own, local compaction: Codex compacts through ``/v1/responses`` with its
CONTEXT CHECKPOINT COMPACTION prompt when the provider is not OpenAI's; ``/v1/responses/compact`` is
covered by tests/proxy/test_long_runs.py). What each harness's compaction request looks like is
in docs/long-runs.md.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from polar_analysis import drift, frames
from polar_proxy.process import ProxyProcess
from polar_runtime import harnesses as h
from polar_testing.scripted_upstream import Script, ServerThread

from .conftest import require_installed

pytestmark = [pytest.mark.harness, pytest.mark.slow]

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
CAP = 20  # polar_max_tokens_cap: the first call (a 40-word command) is cut mid-call
COMPACT_AT = 4000  # Codex's model_auto_compact_token_limit, in the scripted upstream's (cheap) tokens


def _exec(cmd: str) -> dict:
    return {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": cmd}}]}


def test_codex_long_session(tmp_path):
    preset = h.get_preset("codex")
    require_installed(preset)
    script = Script({"*": [
        _exec("echo " + " ".join(f"w{i}" for i in range(40))),  # cut by the budget
        _exec(f"echo {PNG} | base64 -d > img.png"),
        {"tool_calls": [{"name": "view_image", "arguments": {"path": "img.png"}}]},
        *[_exec(f"echo step{i} > s{i}.txt; seq -s ' ' 1 300") for i in range(6)],
        *[{"text": "All steps done."}] * 4,
    ]})
    # The summary carries a directive so that the scripted model finishes once the history
    # restarts from it (a real model would go on from the summary).
    summary = {"text": "Summary: the steps ran and wrote their files; left: the report. #scenario:text"}
    with ServerThread(max_model_len=131072, script=script, summary=summary, log_size=256) as up:
        proxy = ProxyProcess(up.url, tmp_path / "captures", confdir=tmp_path / "mitm",
                             options={"polar_max_tokens_cap": CAP}).start()
        try:
            home, work = tmp_path / "home", tmp_path / "work"
            codex_home = home / ".codex"
            codex_home.mkdir(parents=True)
            work.mkdir()
            (codex_home / "config.toml").write_text(
                'model = "gpt-5-codex"\nmodel_provider = "polar"\napproval_policy = "never"\n'
                'sandbox_mode = "danger-full-access"\ncheck_for_update_on_startup = false\n'
                f"model_auto_compact_token_limit = {COMPACT_AT}\n"
                '[analytics]\nenabled = false\n[feedback]\nenabled = false\n[otel]\nexporter = "none"\n'
                '[model_providers.polar]\nname = "polar"\n'
                f'base_url = "{proxy.url}/v1"\nenv_key = "POLAR_API_KEY"\nwire_api = "responses"\n'
                "request_max_retries = 1\nstream_max_retries = 1\n")
            env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(codex_home),
                   "POLAR_API_KEY": "codex-long-run", "NO_COLOR": "1"}
            argv = [str(preset.binary()), "exec", "--skip-git-repo-check", "--json",
                    "--dangerously-bypass-approvals-and-sandbox", "--cd", str(work), "--model", "gpt-5-codex",
                    "--disable", "multi_agent", "--disable", "goals", "-c", 'web_search="disabled"',
                    "Run the steps."]
            run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
            answered = up.upstream.count
        finally:
            proxy.stop()
    assert run.returncode == 0, run.stderr[-2000:]
    sessions = list((tmp_path / "captures" / "sessions").glob("*.jsonl"))
    assert len(sessions) == 1
    recs = [json.loads(line) for line in sessions[0].read_text().splitlines()]
    assert len(recs) == answered and all(r["status"] == "ok" for r in recs)  # every call captured
    cut = recs[0]
    assert cut["finish_reason"] == "length" and len(cut["sampled_token_ids"]) == CAP
    assert any("image replaced by a text placeholder" in n for r in recs for n in r["translation_notes"])
    assert (work / "img.png").exists()
    report = drift.drift_report(frames.calls(tmp_path / "captures", rewards=None))
    details = [d for c, d in zip(report["cause"], report["detail"]) if c == "compacted"]
    assert any(d.startswith("summary call (codex)") for d in details), details
    assert any(d.startswith("resumed from a summary (codex)") for d in details), details
    summary_call = next(r for r in recs if "CONTEXT CHECKPOINT COMPACTION" in json.dumps(r["native_request"]["input"][-1]))
    assert summary_call["native_path"] == "/v1/responses" and summary_call["native_request"]["tools"] == []
    assert summary_call["output_text"].startswith("Summary:")
    assert "compaction: codex summary call (request_kind compaction)" in summary_call["translation_notes"]
