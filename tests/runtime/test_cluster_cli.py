"""The acceptance run of docs/cluster.md, through the commands a user types: a local two-node Ray
cluster (``python -m polar_testing.ray_cluster --nodes 2``), ``polar loop loop.toml`` on it with
``[placement] kind = "ray"``, one node removed mid-run (``remove 1`` on the cluster's stdin), then
``polar cluster gather --config loop.toml --to DIR``. The model is the scripted vLLM-format upstream
(both nodes' proxies use it); the harness is the generic one (``curl``); the loop's trainer is real
but never reached: every sample scores alike, so no step updates (no push).

Checked: the loop ends normally, the report counts the lost node and the retried group, every
sample of every step is in the driver's store, and every session the removed node captured is either
a finished sample of the store or one re-run elsewhere as ``.r<n>``; gather copies both nodes.
Time on the shared 2-core dev box: ~100 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from polar_testing.scripted_upstream import Script, ServerThread  # noqa: E402

pytestmark = pytest.mark.slow

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say hi."}]})
CURL = ("sleep 2; curl -sSf {base_url}/v1/chat/completions -H 'authorization: Bearer {api_key}' "
        "-H 'content-type: application/json' -d @body.json")


def test_acceptance_run_through_the_commands(tmp_path: Path) -> None:
    polar = str(Path(sys.executable).with_name("polar"))
    env = {**os.environ, "COLUMNS": "200"}
    cluster = subprocess.Popen([sys.executable, "-m", "polar_testing.ray_cluster", "--nodes", "2"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    loop = None
    try:
        assert cluster.stdout is not None and cluster.stdin is not None
        lines = [cluster.stdout.readline() for _ in range(3)]
        address = lines[0].split("address: ", 1)[1].strip()
        node1 = lines[2].split(": ", 1)[1].strip()
        with ServerThread(served_model="scripted-model", script=Script(["text"])) as up:
            (tmp_path / "loop.toml").write_text(
                f'out = "run"\n[model]\nname = "tiny-qwen"\n[harness]\nname = "generic"\ncommand = "{CURL}"\n'
                'concurrency = 1\ntimeout_s = 120\n[tasks]\nsource = "tasks.jsonl"\n'
                "[rollout]\nsamples_per_group = 4\ngroups_per_step = 2\niterations = 1\n"
                f'[placement]\nkind = "ray"\naddress = "{address}"\nnode_resource = "polar_rollout"\n'
                f'replicas = ["{up.url}"]\n')
            # two tasks: two groups per step, one per node (least-loaded)
            (tmp_path / "tasks.jsonl").write_text("".join(
                json.dumps({"id": t, "instruction": "Say hi.", "files": {"body.json": BODY}, "evaluator": "true"}) + "\n"
                for t in ("hi", "hello")))
            loop = subprocess.Popen([polar, "loop", "loop.toml"], cwd=tmp_path, stdout=open(tmp_path / "loop.log", "w"),
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            store = tmp_path / "run" / "cluster" / "samples"
            deadline = time.monotonic() + 300
            while not any(json.loads(p.read_text())["node_id"] == node1 for p in store.glob("*.json")):
                assert loop.poll() is None, (tmp_path / "loop.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "node 1 never finished a sample"
                time.sleep(0.1)
            cluster.stdin.write("remove 1\n")
            cluster.stdin.flush()
            assert "removed node 1" in cluster.stdout.readline()
            assert loop.wait(600) == 0, (tmp_path / "loop.log").read_text()[-3000:]
        report = json.loads((tmp_path / "run" / "loop-report.json").read_text())
        assert report["finished"]
        counters = report["placement"]["counters"]
        assert counters["nodes_lost"] == 1 and counters["groups_retried"] >= 1 and counters["groups_dropped"] == 0
        stored = [json.loads(p.read_text()) for p in store.glob("*.json")]
        assert len(stored) == 2 * 2 * 4 and all(s["row"]["status"] == "ok" for s in stored)
        gather = subprocess.run([polar, "cluster", "gather", "--config", "loop.toml", "--to", "gathered"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=300, env=env)
        assert gather.returncode == 0, gather.stdout + gather.stderr
        g = json.loads((tmp_path / "gathered" / "gather.json").read_text())["nodes"]
        assert g[node1]["lost"] and g[node1]["state"] == "copied" and len(g) == 2
        finished = {s["row"]["session_id"] for s in stored}
        lost_sessions = {p.stem for p in (tmp_path / "gathered" / node1 / "sessions").glob("*.jsonl")}
        for sid in lost_sessions - finished:  # unfinished on the lost node: re-run elsewhere as .r<n>
            assert any(f.startswith(sid + ".r") for f in finished), (sid, sorted(finished))
        all_gathered = {p.stem for d in g for p in (tmp_path / "gathered" / d / "sessions").glob("*.jsonl")}
        assert finished <= all_gathered  # every finished sample's capture came back
    finally:
        if loop is not None and loop.poll() is None:
            loop.kill()
        if cluster.poll() is None and cluster.stdin is not None:
            cluster.stdin.write("quit\n")
            cluster.stdin.flush()
            try:
                cluster.wait(60)
            except subprocess.TimeoutExpired:
                cluster.kill()
