"""`polar rollout` and `polar harness run` as a newcomer types them: a *relative* capture dir, started
from a directory that is not the repository root, through the installed `polar` script.

The real Pi harness runs against the scripted vLLM-format upstream (seconds, no model). Pi reads its
provider config from its isolated HOME; before paths were resolved at the command boundary that HOME
was relative, Pi (started in its work dir) looked under ``work/runs/...`` and every sample failed
with ``Model "polar/..." not found`` and zero calls. The all-failed case must then exit non-zero with
the harness's own error line and the path of its stderr log.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from polar_runtime import harnesses as h
from polar_testing.scripted_upstream import Script, ServerThread

from .conftest import read_calls, require_installed

pytestmark = [pytest.mark.harness, pytest.mark.slow]

POLAR = Path(sys.executable).with_name("polar")
SCRIPT = Script({"*": [{"tool_calls": [{"name": "bash", "arguments": {"command": "echo hi > hi.txt"}}]},
                       {"text": "Done: hi.txt is written."}, {"text": "Done."}, {"text": "Done."}]})
TASK = {"id": "write-hi", "instruction": "Write hi into hi.txt.", "evaluator": "test \"$(cat hi.txt)\" = hi"}


@pytest.fixture(scope="module")
def scripted(tiny_qwen_dir: Path):
    with ServerThread(served_model="scripted-model", max_model_len=65536, tokenizer=str(tiny_qwen_dir),
                      script=SCRIPT) as up:
        yield up


def _polar(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([str(POLAR), *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("command", ["rollout", "harness run"])
def test_relative_capture_dir_from_another_cwd_captures_real_calls(command: str, scripted, tmp_path: Path) -> None:
    require_installed(h.get_preset("pi-chat"))
    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    (elsewhere / "tasks.jsonl").write_text(json.dumps(TASK) + "\n")
    if command == "rollout":
        args = ["rollout", "--tasks", "tasks.jsonl", "--harness", "pi-chat", "--samples", "1",
                "--upstream", scripted.url, "--capture-dir", "runs/rel", "--timeout", "120"]
    else:
        # with a follow-up turn: Pi resumes its conversation from the same (resolved) HOME
        args = ["harness", "run", "pi-chat", "--task", TASK["instruction"], "--evaluator", TASK["evaluator"],
                "--followup", "Say done.", "--upstream", scripted.url, "--capture-dir", "runs/rel", "--timeout", "120"]
    proc = _polar(args, elsewhere)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cap = elsewhere / "runs" / "rel"
    (row,) = pl.read_parquet(cap / "rollouts.parquet").to_dicts()
    assert row["status"] == "ok" and row["reward"] == 1.0, row
    assert row["turns"] == (2 if command == "harness run" else 1), row
    calls = read_calls(cap, row["session_id"])
    if command == "harness run":  # the resumed run re-sent the first run's conversation
        assert "Say done." in json.dumps(calls[-1]["normalized_request"])
        assert "Done: hi.txt is written." in json.dumps(calls[-1]["normalized_request"])
    assert len(calls) >= 2 and calls[0]["output_tool_calls"], [c["finish_reason"] for c in calls]
    assert all(c["prompt_token_ids"] and c["sampled_token_ids"] for c in calls)
    assert Path(row["workdir"]).is_absolute() and Path(row["workdir"]).is_relative_to(cap)
    assert not list(cap.rglob("work/runs")), "a relative path was resolved inside the harness's work dir"


def test_rollout_where_every_sample_fails_exits_non_zero_with_the_harness_error(scripted, tmp_path: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text(json.dumps(TASK) + "\n")
    proc = _polar(["rollout", "--tasks", "tasks.jsonl", "--harness", "generic", "--command",
                   "echo 'Error: no such model' >&2; exit 3", "--samples", "2", "--upstream", scripted.url,
                   "--capture-dir", "caps", "--timeout", "60"], tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    out = " ".join(proc.stdout.split())  # rich wraps long lines
    assert "rollout produced nothing to learn from: generic: all 2 samples failed" in out
    assert "Error: no such model" in out
    assert str(tmp_path / "caps" / "work" / "write-hi.st0.s0" / "logs" / "generic.stderr") in proc.stdout.replace("\n", "")


def _pids_with(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                out.append(int(cmdline.parent.name))
        except OSError:
            continue
    return out


def test_sigterm_stops_everything_the_rollout_started(scripted, tmp_path: Path) -> None:
    """SIGTERM (a supervisor, `kill`, a CI timeout) during `polar rollout` stops the harness runs and
    the proxy it started, and exits 130. Before, SIGTERM killed the CLI alone: its vLLM server, proxy
    and harness went on as orphans (seen live: a 6 GB vLLM left behind next to a demo's trainer)."""
    import signal
    import time

    (tmp_path / "tasks.jsonl").write_text(json.dumps(TASK) + "\n")
    marker = f"sleep 7{os.getpid() % 1000}.5"  # unique per test process: only our harness runs match
    proc = subprocess.Popen([str(POLAR), "rollout", "--tasks", "tasks.jsonl", "--harness", "generic", "--command",
                             marker, "--samples", "2", "--concurrency", "2", "--upstream", scripted.url,
                             "--capture-dir", "caps", "--timeout", "600"], cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The marker is in the CLI's own command line too: the SIGTERM lands as the first sample's
        # sandbox starts, often while the other sample still prepares its own (the case that hung).
        deadline = time.monotonic() + 120
        while len(_pids_with(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        harness = _pids_with(marker)
        proxy = _pids_with(str(tmp_path / "caps"))  # mitmdump, started with the capture dir
        assert len(harness) >= 2 and proxy, (harness, proxy)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)  # a hang guard: 0.5-13 s quiet, 43 s for the test at load 15
        assert proc.returncode == 130, out[-2000:]
        assert "interrupted: everything the rollout started was stopped" in " ".join(out.split())
        time.sleep(1.0)
        assert _pids_with(marker) == [] and [p for p in proxy if p in _pids_with(str(tmp_path / "caps"))] == []
    finally:  # a failure must never leave a harness or a mitmdump behind (one ran on for 42 min)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in _pids_with(marker) + _pids_with(str(tmp_path / "caps")):
            with contextlib.suppress(ProcessLookupError):  # gone between the listing and the kill
                os.kill(pid, signal.SIGKILL)
