"""LoRA (training/lora.py): only the adapters train, vLLM gets the merged weights under the base
names, and a LoRA session resumes from its checkpoint exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from polar_training import checkpoint as ckpt
from polar_training import lora
from polar_training.config import LossConfig, TrainConfig
from polar_training.session import TrainSession
from polar_training.trainer import load_model


def _cfg() -> TrainConfig:
    return TrainConfig(lr=1e-2, num_minibatches=2, token_budget=128, loss=LossConfig(kl_coef=0.0))


def _data(make_frame, tmp_path: Path, seed: int) -> str:
    path = tmp_path / f"traj-{seed}.parquet"
    make_frame(groups=2, samples=4, min_len=10, max_len=24, seed=seed, vocab=2048).write_parquet(path)
    return str(path)


def test_only_adapters_train_and_the_handoff_is_the_merged_model(small_qwen_dir, make_frame, tmp_path):
    base = load_model(str(small_qwen_dir))
    session = TrainSession(small_qwen_dir, tmp_path / "run", _cfg(), lora=lora.LoraSettings(rank=4, alpha=8))
    model = session.trainer.model
    c = model.config
    d, f, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    per_layer = 4 * ((d + d) + (d + kv) * 2 + (d + d) + (d + f) * 3)
    assert lora.trainable_parameters(model) == per_layer * c.num_hidden_layers
    assert {id(p) for g in session.trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if "lora_" in n}

    out = session.step([_data(make_frame, tmp_path, 1)])
    assert out.updated
    with safe_open(Path(out.handoff) / "model.safetensors", "pt") as fh:
        merged = {k: fh.get_tensor(k) for k in fh.keys()}
    base_sd = base.state_dict()
    assert set(base_sd) - {"lm_head.weight"} <= set(merged) <= set(base_sd) | {"lm_head.weight"}  # base names only
    # frozen base: the LoRA model's base weights are the original ones; the merged ones moved
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(dict(model.named_parameters())["model.layers.0.self_attn.q_proj.base_layer.weight"], base_sd[q])
    assert not torch.equal(merged[q], base_sd[q])
    assert torch.equal(merged["model.embed_tokens.weight"], base_sd["model.embed_tokens.weight"])
    # the served (merged, plain) model computes what the trainer's LoRA model computes: the probe agrees
    served = load_model(out.handoff)
    probe = ckpt.read_meta(out.handoff)["probe"]
    assert ckpt.probe_logprobs(served, probe["ids"]) == pytest.approx(probe["logprobs"], abs=2e-5)
    assert max(abs(a - b) for a, b in zip(probe["logprobs"], probe["logprobs_before"])) > 1e-3
    meta = ckpt.read_meta(out.handoff)
    assert meta["lora"]["rank"] == 4 and meta["lora_base"] == str(small_qwen_dir)


@pytest.mark.slow  # three LoRA sessions, three steps
def test_a_lora_session_resumes_from_its_checkpoint(small_qwen_dir, make_frame, tmp_path):
    d1, d2 = _data(make_frame, tmp_path, 1), _data(make_frame, tmp_path, 2)
    settings = lora.LoraSettings(rank=4, alpha=8)
    torch.manual_seed(0)
    straight = TrainSession(small_qwen_dir, tmp_path / "a", _cfg(), lora=settings)
    straight.step([d1], handoff=False)
    want = straight.step([d2], handoff=False).metrics

    torch.manual_seed(0)
    first = TrainSession(small_qwen_dir, tmp_path / "b", _cfg(), lora=settings)
    first.step([d1], handoff=False)
    saved = first.close()
    assert (saved / ckpt.ADAPTER_FILE).is_file() and (saved / ckpt.STATE_FILE).is_file()
    del first
    resumed = TrainSession(small_qwen_dir, tmp_path / "b", _cfg(), resume="auto")  # LoRA from the checkpoint
    assert resumed.lora == settings and resumed.step_count == 2
    got = resumed.step([d2], handoff=False).metrics
    assert got["loss"] == want["loss"] and got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    a = {k: v for k, v in straight.trainer.model.state_dict().items()}
    for k, v in resumed.trainer.model.state_dict().items():
        assert torch.equal(v, a[k]), k
