"""`polar rollout --proxy URL` against a running proxy, with a bring-your-own (generic) harness.

The generic preset runs curl, in both modes: through the reverse proxy with the API key naming the
session, and unmodified against https://api.openai.com with only HTTPS_PROXY + the proxy's CA.
No model: the upstream is the scripted vLLM stand-in, so this takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import polars as pl
import pytest

from polar_proxy.process import ProxyProcess
from polar_testing.scripted_upstream import Script, ServerThread

from .conftest import check_token_fields, read_calls

pytestmark = pytest.mark.slow

BODY = json.dumps({"model": "gpt-4o-mini", "stream": True,
                   "messages": [{"role": "user", "content": "Say hi."}]})
CURL = {
    "base_url": "curl -sSf -N {base_url}/v1/chat/completions -H 'authorization: Bearer {api_key}' "
                "-H 'content-type: application/json' -d @body.json",
    # unmodified: the hosted URL, only HTTPS_PROXY (with the session as proxy user) and the CA
    "proxy": "curl -sSf -N https://api.openai.com/v1/chat/completions -H 'authorization: Bearer sk-none' "
             "-H 'content-type: application/json' -d @body.json",
}


@pytest.mark.parametrize("mode", ["base_url", "proxy"])
def test_rollout_through_a_running_proxy(mode, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "hi", "instruction": "Say hi.", "files": {"body.json": BODY},
                                 "evaluator": "grep -q '\"finish_reason\":\"stop\"' \"$POLAR_HARNESS_STDOUT\""}) + "\n")
    with ServerThread(served_model="scripted-model", script=Script(["text"])) as up, \
         ProxyProcess(up.url, tmp_path / "captures", mode="reverse" if mode == "base_url" else "regular",
                      confdir=tmp_path / "mitmproxy", served_model="scripted-model",
                      log_file=tmp_path / "proxy.log") as px:
        cmd = [sys.executable, "-m", "polar_runtime.cli", "rollout", "--tasks", str(tasks), "--proxy", px.url,
               "--mode", mode, "--harness", "generic", "--command", CURL[mode], "--samples", "2",
               "--timeout", "60", "--ca-cert", str(px.ca_cert)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        df = pl.read_parquet(tmp_path / "captures" / "rollouts.parquet")
    assert df["status"].to_list() == ["ok", "ok"] and df["reward"].to_list() == [1.0, 1.0], df.to_dicts()
    assert df["calls"].to_list() == [1, 1] and set(df["model"]) == {"scripted-model"}
    for row in df.iter_rows(named=True):
        calls = read_calls(tmp_path / "captures", row["session_id"])
        check_token_fields(calls, row["session_id"])
        c = calls[0]
        assert (c["task_id"], c["group_id"], c["sample_index"]) == ("hi", "hi.st0", row["sample_index"])
        assert c["harness"] == "generic"  # the preset's name, registered by the runner
        assert c["session_source"] == "key"  # bound by the key the proxy issued at registration
        assert c["requested_model"] == "gpt-4o-mini"
