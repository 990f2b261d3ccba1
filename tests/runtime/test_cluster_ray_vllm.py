"""The Ray placement for real: a head and two nodes of ``ray.cluster_utils.Cluster``, each node with
a vLLM CPU server of tiny-qwen (a replica actor) and a node agent (its proxy, the generic harness);
the persistent trainer on the head's placement group. Step 0 trains and pushes the new weights to
both replicas (each verified on its node), then a node is removed during the final rollout: the
loop ends, its unfinished samples ran again on the other node, every sample of the run is in the
driver's store, and every trained or measured call carries the policy version its replica served.

Marked vllm + slow. Time on the shared 2-core dev box (load ~14 from other jobs): 368 s, of which the
two vLLM starts ~210 s (at once); both pushes verified in place (probe max |dlogp| 1.9e-06, 2.5-2.7 s).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from polar_runtime.cluster.placement import RayPlacement  # noqa: E402
from polar_runtime.loop import config as c  # noqa: E402
from polar_runtime.loop.loop import run_loop  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BODY = json.dumps({"model": "gpt-4o-mini", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]})
CURL = ("sleep $(cat pause); curl -sSf {base_url}/v1/chat/completions -H 'authorization: Bearer {api_key}' "
        "-H 'content-type: application/json' -d @body.json")
EVALUATOR = 'case "$POLAR_SESSION" in *.s0|*.s0.r*) exit 0;; esac; exit 1'


@pytest.mark.timeout(2400)
def test_two_vllm_nodes_train_push_and_survive_a_node_loss(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    from ray.cluster_utils import Cluster

    tasks = [{"id": t, "instruction": "Say hi.", "files": {"body.json": BODY, "pause": "3"}, "evaluator": EVALUATOR}
             for t in ("alpha", "beta")]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    out = tmp_path / "run"
    cl = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [cl.add_node(num_cpus=1, resources={"polar_rollout": 1}) for _ in range(2)]
    cl.wait_for_nodes()
    ray.init(address=cl.address, namespace="polar", log_to_driver=False)
    try:
        cfg = c.parse_config(
            f'out = "{out}"\n[model]\nname = "tiny-qwen"\nmax_model_len = 4096\n'
            f'[harness]\nname = "generic"\ncommand = "{CURL}"\nconcurrency = 1\ntimeout_s = 300\n'
            f'[tasks]\nsource = "{tmp_path / "tasks.jsonl"}"\nlimit = 0\n'
            "[rollout]\nsamples_per_group = 3\niterations = 1\n[sampling]\nmax_tokens = 8\n"
            '[trainer]\nserver_during_train = "keep"\n'
            f'[placement]\nkind = "ray"\naddress = "{cl.address}"\nnode_resource = "polar_rollout"\n')
        placement = RayPlacement(cfg, out, log=print)
        result: dict[str, Any] = {}

        def go() -> None:
            try:
                result["report"] = run_loop(cfg, placement, out, log=print)
            except BaseException as exc:  # noqa: BLE001
                result["error"] = exc

        t0 = time.monotonic()
        th = threading.Thread(target=go)
        th.start()
        store = out / "cluster" / "samples"
        victim = None
        deadline = time.monotonic() + 1800
        while victim is None:  # the first node to finish a sample of the final rollout (step 1) is removed
            assert time.monotonic() < deadline and th.is_alive(), result
            for p in store.glob("*.st1.*json"):
                nid = json.loads(p.read_text())["node_id"]
                victim = next(n for n in nodes if n.node_id == nid)
                break
            time.sleep(0.2)
        cl.remove_node(victim)
        th.join(1200)
        assert not th.is_alive()
        print(f"ray + vLLM loop with a node removed: {time.monotonic() - t0:.0f} s")
    finally:
        ray.shutdown()
        cl.shutdown()
    assert "error" not in result, result.get("error")
    report = result["report"]
    assert report["finished"] and report["policy_version"] == 1
    step0, step1 = report["steps"]
    push = step0["push"]
    assert len(push["replicas"]) == 2  # both replicas reloaded, each verified on its node
    assert all(any("probe" in n for n in r["notes"]) for r in push["replicas"].values()), push
    counters = report["placement"]["counters"]
    assert counters["nodes_lost"] == 1 and counters["groups_retried"] >= 1
    stored = [json.loads(p.read_text()) for p in store.glob("*.json")]
    assert len(stored) == 2 * 2 * 3 and all(s["row"]["status"] == "ok" for s in stored)
    for s in stored:  # every sampled token's version: v0 in step 0, v1 (after the push) in step 1
        assert set(s["versions"]) == {str(s["row"]["step"])}, s
    assert {s["node_id"] for s in stored if s["row"]["step"] == 0} == {n.node_id for n in nodes}
