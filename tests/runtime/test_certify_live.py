"""polar certify, live, against the test session's vLLM (tiny-qwen): one fast cell, then a stale push.

The cell is the fastest pair (Pi's chat wire format on tiny-qwen, answers capped short): the real
harness in its sandbox through the real proxy, trajectories, the trainer's logprob pass, one GRPO
step, a push into the shared server, three plain calls through the proxy after it, every check. tiny-qwen has random weights,
so it makes no tool calls and does not reason: those checks must say NOT EXERCISED, never PASS.
The server is shared by the session: certify reloads its base weights at the end (checked).

The stale push reuses the cell's checkpoint (it carries the canary probe with the trainer's
logprobs under the new and the previous weights) and pushes it to a server that keeps serving the
old weights (a reload that does nothing): push_weights' own verification refuses it, and certify's
canary, asked independently, says ``previous``, so policy delivery FAILs even if the push had
claimed success.
"""

from __future__ import annotations

import json

import pytest

from polar_runtime.certify.checks import FAIL, NOT_EXERCISED, PASS

pytestmark = [pytest.mark.vllm, pytest.mark.harness]


@pytest.fixture(scope="module")
def cell(vllm_tiny, tmp_path_factory):
    from polar_runtime.certify.runner import certify_config, run_cell
    from polar_runtime.loop.config import LoopConfig

    base = LoopConfig()
    base.sampling.max_tokens = 24  # tiny-qwen's random answers run to the cap: keep them short
    base.harness.timeout_s = 240
    out = tmp_path_factory.mktemp("certify") / "pi-chat__tiny-qwen"
    # one task, two samples: the quickest cell whose GRPO group has a reward spread (6 calls, 4 re-sent
    # answers: exact history is NOT EXERCISED here; the full cell's 12 are in benchmarks/results/certify)
    cfg = certify_config(base, "pi-chat", "tiny-qwen", out, samples=2, task_ids=["dir-then-file"])
    # the calls after the push: three plain chat calls through the proxy (a second Pi run cost 50-100 s)
    report = run_cell(cfg, out, upstream=vllm_tiny.base_url, harness_after_push=False)
    print(json.dumps({c["name"]: [c["state"], c["measured"]] for c in report["checks"]}, indent=1))
    print("phases", report["phases"], "error", report["error"])
    return out, report


def test_a_fast_cell_passes_what_it_exercises(cell, vllm_tiny):
    out, report = cell
    assert report["error"] is None, report.get("traceback")
    states = {c["name"]: c["state"] for c in report["checks"]}
    for c in report["checks"]:
        assert c["state"] != FAIL, c
        assert c["state"] != PASS or c["count"] >= c["minimum"], c  # no pass without its minimum
    for name in ("capture", "mask", "logprob agreement", "sampling", "policy delivery"):
        assert states[name] == PASS, (name, states)
    assert states["reasoning"] == NOT_EXERCISED  # tiny-qwen does not reason
    assert states["exact history"] == NOT_EXERCISED  # 4 re-sent answers, under the minimum of 10
    assert next(c for c in report["checks"] if c["name"] == "exact history")["value"] == 1.0  # all of them exact
    assert report["verdict"] == PASS
    assert report["run"]["restored"]  # the shared server got its base weights back
    assert (out / "certify.json").is_file()


def test_a_stale_push_fails_policy_delivery(cell, vllm_tiny, tiny_qwen_dir):
    from polar_runtime.certify.delivery import check_policy_delivery, served_verdict
    from polar_training.push_probe import PushError
    from polar_training.weights_push import push_weights

    out, report = cell
    [ckpt] = sorted(p for p in (out / "train").glob("step-*") if (p / "config.json").is_file())

    class Stale:  # reloads nothing: the old weights stay served
        base_url = vllm_tiny.base_url

        def reload_weights(self, model_dir):
            return 0.0

    with pytest.raises(PushError) as err:
        push_weights(str(ckpt), [Stale()], None, 1)
    verdict = served_verdict(vllm_tiny.base_url, str(ckpt))
    print(err.value, verdict)
    assert verdict["state"] == "previous" and abs(verdict["alpha"]) < 0.2
    res = check_policy_delivery(1, str(err.value), verdict, [1, 1, 1])
    assert res.state == FAIL and "previous" in " ".join(res.details)
    # a push that (wrongly) claimed success is still caught by the canary
    res = check_policy_delivery(1, None, verdict, [1, 1, 1])
    assert res.state == FAIL and f"{verdict['alpha']:.3f} x the predicted" in res.details[0]
