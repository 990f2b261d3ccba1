"""Checkpoints: reload gives identical logits; resume continues with the identical next step."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from polar_training import checkpoint as ckpt
from polar_training.trainer import GRPOTrainer, TrainConfig, load_model
from polar_training.loss import LossConfig


def test_save_then_reload_gives_identical_logits(tiny_qwen_dir, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with torch.no_grad():  # make it differ from the base model
        tiny_model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    x = torch.tensor([[151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645]])
    out = ckpt.save_checkpoint(tmp_path / "step-000001", tiny_model, tiny_qwen_dir, meta={"step": 1}, probe_ids=x[0].tolist())
    assert (tmp_path / "latest").read_text().strip() == "step-000001"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        a = tiny_model(x, use_cache=False).logits
        b = reloaded(x, use_cache=False).logits
    assert torch.equal(a, b)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    meta = ckpt.read_meta(out)
    assert meta["step"] == 1 and len(meta["probe"]["logprobs"]) == x.shape[1] - 1
    expected = torch.log_softmax(a[0, :-1], -1).gather(-1, x[0, 1:, None]).squeeze(-1)
    assert meta["probe"]["logprobs"] == pytest.approx(expected.tolist(), abs=1e-6)


def test_tied_models_are_saved_untied_for_vllm_and_retied_for_training(tiny_qwen_dir, tiny_model, tmp_path):
    tiny_model.config.tie_word_embeddings = True
    tiny_model.tie_weights()
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight
    out = ckpt.save_checkpoint(tmp_path / "c", tiny_model, tiny_qwen_dir)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(out / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
    back = load_model(str(out))
    assert back.lm_head.weight is back.model.embed_tokens.weight


def _frame(make_frame, seed):
    return make_frame(groups=2, samples=4, min_len=10, max_len=24, seed=seed, vocab=2048)


def test_resume_continues_with_identical_next_step(small_qwen_dir, make_frame, tmp_path):
    """Two steps in one go == one step, checkpoint, fresh process state, resume, one step."""
    cfg = TrainConfig(lr=1e-3, warmup_steps=2, num_minibatches=2, token_budget=128, loss=LossConfig(kl_coef=0.0))
    data1, data2 = _frame(make_frame, 1), _frame(make_frame, 2)

    torch.manual_seed(0)
    straight = GRPOTrainer(load_model(str(small_qwen_dir)), cfg)
    straight.fit(data1)
    want = straight.fit(data2)

    torch.manual_seed(0)
    first = GRPOTrainer(load_model(str(small_qwen_dir)), cfg)
    first.fit(data1)
    d = ckpt.save_checkpoint(tmp_path / "step-000002", first.model, small_qwen_dir, trainer_state=first.state_dict())
    del first
    torch.manual_seed(123)  # the resumed run must not depend on the fresh process's RNG
    resumed = GRPOTrainer(load_model(str(ckpt.resolve_resume(tmp_path))), cfg)
    resumed.load_state_dict(ckpt.load_trainer_state(d))
    got = resumed.fit(data2)

    assert resumed.step == straight.step == 4
    for w, g in zip(want, got):
        assert g["loss"] == w["loss"]
        assert g["lr"] == w["lr"] and g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-6)
    for (n, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), n
