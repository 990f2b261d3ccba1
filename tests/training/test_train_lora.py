"""`polar train --lora-rank`: LoRA adapters trained from one's own trajectories, as in `polar demo`;
merged into full weights by default, or saved as a PEFT adapter directory (``--lora-save adapter``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import typer
from safetensors import safe_open
from typer.testing import CliRunner

from polar_training import checkpoint as ckpt
from polar_training import commands, lora
from polar_training.config import LossConfig, TrainConfig
from polar_training.run import TrainJob, run_training
from polar_training.trainer import load_model


def _cfg() -> TrainConfig:
    return TrainConfig(lr=1e-2, token_budget=128, loss=LossConfig(kl_coef=0.0))


def _data(make_frame, tmp_path: Path) -> str:
    path = tmp_path / "traj.parquet"
    make_frame(groups=2, samples=2, min_len=10, max_len=20, seed=3, vocab=2048).write_parquet(path)
    return str(path)


def _keys(path: Path) -> set[str]:
    with safe_open(path, "pt") as f:
        return set(f.keys())


def _train(small_qwen_dir, traj, out, **kw):
    return run_training(TrainJob(model=str(small_qwen_dir), trajectories=[traj], out=str(out), config=_cfg(),
                                 show_progress=False, lora=lora.LoraSettings(rank=4, alpha=8), **kw))


def test_lora_checkpoint_is_merged_full_weights_by_default(small_qwen_dir, make_frame, tmp_path):
    res = _train(small_qwen_dir, _data(make_frame, tmp_path), tmp_path / "run")
    c = res.checkpoint
    keys = _keys(c / "model.safetensors")
    assert not any("lora_" in k for k in keys) and "model.layers.0.self_attn.q_proj.weight" in keys
    assert any(".lora_A." in k for k in _keys(c / ckpt.ADAPTER_FILE))  # the adapters alone, for --resume
    meta = ckpt.read_meta(c)
    assert meta["lora"]["rank"] == 4 and meta["lora_save"] == "merged" and meta["lora_base"] == str(small_qwen_dir)
    # an ordinary model: loaded alone it gives what the trained policy gave (the probe), not the base's
    probe = meta["probe"]
    assert ckpt.probe_logprobs(load_model(str(c)), probe["ids"]) == pytest.approx(probe["logprobs"], abs=1e-5)
    assert probe["logprobs"] != pytest.approx(probe["logprobs_before"], abs=1e-4)


def test_lora_save_adapter_writes_a_peft_adapter_directory_that_resumes(small_qwen_dir, make_frame, tmp_path):
    from peft import PeftModel

    traj = _data(make_frame, tmp_path)
    res = _train(small_qwen_dir, traj, tmp_path / "run", lora_save="adapter")
    c = res.checkpoint
    assert not (c / "model.safetensors").exists()  # megabytes, not the model's gigabytes
    cfg = json.loads((c / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert all(k.startswith("base_model.model.") and ".default." not in k for k in _keys(c / "adapter_model.safetensors"))
    # PEFT (whose layout vLLM's --enable-lora reads) loads it onto the base: the trained policy
    probe = ckpt.read_meta(c)["probe"]
    served = PeftModel.from_pretrained(load_model(str(small_qwen_dir)), str(c)).merge_and_unload()
    assert ckpt.probe_logprobs(served, probe["ids"]) == pytest.approx(probe["logprobs"], abs=1e-5)
    # and the run resumes from it (a LoRA run stays one, adapters read back under PEFT's names)
    again = run_training(TrainJob(model=str(small_qwen_dir), trajectories=[traj], out=str(tmp_path / "run"),
                                  config=_cfg(), resume="auto", show_progress=False))
    assert again.step == 2 and ckpt.read_meta(again.checkpoint)["lora_save"] == "adapter"
    assert ckpt.read_meta(again.checkpoint)["probe"]["logprobs_before"] == pytest.approx(probe["logprobs"], abs=1e-5)


def test_lora_is_refused_under_fsdp(small_qwen_dir, make_frame, tmp_path, monkeypatch):
    """FSDP is not covered: LoRA's merged and PEFT state dicts are taken from unsharded parameters."""
    from polar_training import distributed as pdist

    monkeypatch.setattr(pdist, "is_distributed", lambda: True)
    with pytest.raises(ValueError, match="torchrun"):
        _train(small_qwen_dir, _data(make_frame, tmp_path), tmp_path / "run")


def _cli(args: list[str]):
    app = typer.Typer()
    commands.register(app)
    app.command("noop", hidden=True)(lambda: None)
    return CliRunner().invoke(app, args, env={"COLUMNS": "300"})


def test_polar_train_offers_lora_and_refuses_pushing_an_adapter(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr("polar_training.run.run_training", lambda job, console=None: seen.setdefault("job", job) and exit(0))
    help_text = _cli(["train", "--help"]).output
    assert "--lora-rank" in help_text and "--lora-save" in help_text
    base = ["train", "--model", str(tmp_path), "-t", str(tmp_path / "t.parquet"), "-o", str(tmp_path / "run")]
    res = _cli(base + ["--lora-rank", "8"])
    assert res.exit_code == 0, res.output
    assert seen["job"].lora == lora.LoraSettings(rank=8, alpha=16.0) and seen["job"].lora_save is None
    res = _cli(base + ["--lora-rank", "8", "--lora-save", "adapter", "--push-to", "http://127.0.0.1:1"])
    assert res.exit_code == 2 and "enable-lora" in res.output
    seen.clear()
    assert _cli(base).exit_code == 0 and seen["job"].lora is None  # full fine-tuning by default
