"""New weights reach a running server: in place (`reload_weights`) and by `restart()`.

The trainer pushes checkpoints this way, so each path is checked against transformers' own
logprobs for the checkpoint that should now be served.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from polar_runtime import models
from polar_core.net import http_json
from polar_runtime.serve import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "hello there"}]


def reference(model_dir, n: int = 3) -> tuple[list[int], list[float]]:
    """Greedy ids and their logprobs from transformers (float32)."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    x = torch.tensor([tok.apply_chat_template(MESSAGES, add_generation_prompt=True)])
    ids, lps = [], []
    with torch.inference_mode():
        for _ in range(n):
            logp = torch.log_softmax(model(x).logits[0, -1], -1)
            t = int(logp.argmax())
            ids.append(t)
            lps.append(float(logp[t]))
            x = torch.cat([x, torch.tensor([[t]])], 1)
    return ids, lps


def served(server: VLLMServer, n: int = 3) -> tuple[list[int], list[float]]:
    body = {"model": server.served_model_name, "messages": MESSAGES, "max_tokens": n, "temperature": 0,
            "logprobs": True, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    choice = http_json(f"{server.openai_base_url}/chat/completions", body, timeout=120)["choices"][0]
    return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


def test_reload_weights_in_place_and_restart(vllm_tiny, tiny_qwen_dir, tmp_path):
    """Runs on the session's tiny server (saves a start) and leaves it serving seed-0 weights."""
    if vllm_tiny.attached:
        pytest.skip("an attached (shared) server must not get other weights")
    other = tmp_path / "tiny-qwen-seed1"
    models.write_tiny_qwen(other, tiny_qwen_dir, seed=1)
    ref0, ref1 = reference(tiny_qwen_dir), reference(other)
    assert ref0[0] != ref1[0]
    server, port = vllm_tiny, vllm_tiny.port
    try:
        ids, lps = served(server)
        assert ids == ref0[0] and lps == pytest.approx(ref0[1], abs=1e-3)

        seconds = server.reload_weights(other)
        assert seconds < 60 and server.model_dir == other.resolve()
        ids, lps = served(server)
        assert ids == ref1[0] and lps == pytest.approx(ref1[1], abs=1e-3)  # LM head included

        server.restart(tiny_qwen_dir)
        assert server.port == port and server.running and server.model_dir == tiny_qwen_dir.resolve()
        ids, lps = served(server)
        assert ids == ref0[0] and lps == pytest.approx(ref0[1], abs=1e-3)
    finally:
        if server.running and server.model_dir != tiny_qwen_dir.resolve():
            server.reload_weights(tiny_qwen_dir)
