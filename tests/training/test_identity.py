"""Trajectories carry the model and tokenizer they were sampled with; `polar train` refuses
another tokenizer's ids (naming both), warns on trajectories without the fingerprint, and lets
every size of one family through."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from rich.console import Console
from typer.testing import CliRunner

from polar_core.tokenizer_identity import fingerprint, fingerprint_of_dir
from polar_training.config import LossConfig, TrainConfig
from polar_training.identity import TokenizerMismatch, check_trajectories


class FakeTokenizer:
    """What ``fingerprint`` reads of a transformers tokenizer."""

    def __init__(self, tokens: list[str], padded_to: int, special: dict[int, bool], template: str = "t"):
        self.tokens = tokens + [f"[PAD{i}]" for i in range(len(tokens), padded_to)]
        self.added_tokens_decoder = {i: type("T", (), {"special": s})() for i, s in special.items()}
        self.chat_template = template

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tokens[i] if i < len(self.tokens) else None for i in ids]


VOCAB = [f"tok{i}" for i in range(300)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPECIAL = {300: True, 301: True, 302: True}


def test_the_fingerprint_is_the_vocabulary_and_special_ids_not_padding_or_template() -> None:
    small = fingerprint(FakeTokenizer(VOCAB, 320, SPECIAL))  # a 0.5B: 151,936 rows
    assert fingerprint(FakeTokenizer(VOCAB, 384, SPECIAL, template="other")) == small  # the 7B: 152,064 rows
    assert fingerprint(FakeTokenizer(VOCAB, len(VOCAB), SPECIAL)) == small
    assert small.split(":")[1] == str(len(VOCAB))
    changed = list(VOCAB)
    changed[7] = "tok7x"
    assert fingerprint(FakeTokenizer(changed, 320, SPECIAL)) != small
    assert fingerprint(FakeTokenizer(VOCAB, 320, {**SPECIAL, 5: True})) != small


def test_sizes_of_one_family_share_the_real_fingerprint(tiny_qwen_dir, tmp_path) -> None:
    """tiny-qwen (the real Qwen2.5 tokenizer) as a larger size with another chat template: the
    same fingerprint; its ids are Qwen2.5's whatever the embedding's rows."""
    other = tmp_path / "qwen-7b-like"
    shutil.copytree(tiny_qwen_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 152064}))
    (other / "chat_template.jinja").write_text("{{ messages }}")
    fp = fingerprint_of_dir(tiny_qwen_dir)
    assert fp is not None and fp.startswith("tok1:151665:")
    assert fingerprint_of_dir(other) == fp


def _frame(make_frame, fp: str | None, served: str | None = "Qwen2.5-Coder-0.5B-Instruct") -> pl.DataFrame:
    df = make_frame(groups=2, samples=2, min_len=10, max_len=16, seed=1, vocab=2048)
    if fp is None:
        return df
    return df.with_columns(served_model=pl.lit(served), tokenizer_fingerprint=pl.lit(fp))


def test_polar_train_refuses_another_tokenizers_ids_naming_both(tiny_qwen_dir, make_frame, tmp_path) -> None:
    import typer

    from polar_training import commands

    traj = tmp_path / "smol.parquet"
    _frame(make_frame, "tok1:49152:1ca06e420b650430eb7572c7", "SmolLM2-135M-Instruct").write_parquet(traj)
    app = typer.Typer()
    commands.register(app)
    app.command("noop", hidden=True)(lambda: None)
    res = CliRunner().invoke(app, ["train", "--model", str(tiny_qwen_dir), "-t", str(traj), "-o", str(tmp_path / "run"),
                                   "--no-progress"], env={"COLUMNS": "400"})
    text = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "SmolLM2-135M-Instruct" in text and "tok1:49152:1ca06e420b650430eb7572c7" in text
    assert str(tiny_qwen_dir) in text and fingerprint_of_dir(tiny_qwen_dir) in text
    assert "Traceback" not in res.output and not list((tmp_path / "run").glob("step-*"))


def test_check_passes_the_same_tokenizer_and_warns_without_a_fingerprint(tiny_qwen_dir, make_frame) -> None:
    fp = fingerprint_of_dir(tiny_qwen_dir)
    assert check_trajectories(_frame(make_frame, fp), str(tiny_qwen_dir), fp) is None
    warning = check_trajectories(_frame(make_frame, None), str(tiny_qwen_dir), fp)
    assert warning and "no tokenizer fingerprint" in warning
    with pytest.raises(TokenizerMismatch, match="SmolLM2"):
        check_trajectories(_frame(make_frame, "tok1:49152:x", "SmolLM2"), str(tiny_qwen_dir), fp)


def test_old_trajectories_train_with_a_warning(small_qwen_dir, make_frame, tmp_path) -> None:
    """A Parquet written before the fingerprint existed: trained, and the user is told."""
    from polar_training.run import TrainJob, run_training

    traj = tmp_path / "old.parquet"
    _frame(make_frame, None).write_parquet(traj)
    console = Console(record=True, width=400)
    cfg = TrainConfig(lr=1e-3, token_budget=128, loss=LossConfig(kl_coef=0.0))
    res = run_training(TrainJob(model=str(small_qwen_dir), trajectories=[str(traj)], out=str(tmp_path / "run"),
                                config=cfg, show_progress=False), console=console)
    assert res.step == 1 and Path(res.checkpoint).is_dir()
    text = console.export_text()
    assert "warning" in text and "no tokenizer fingerprint" in text


def test_the_persistent_trainer_refuses_another_tokenizer(small_qwen_dir, make_frame, tmp_path) -> None:
    from polar_training.session import TrainSession

    traj = tmp_path / "smol.parquet"
    _frame(make_frame, "tok1:49152:1ca06e420b650430eb7572c7", "SmolLM2").write_parquet(traj)
    session = TrainSession(small_qwen_dir, tmp_path / "run", TrainConfig(loss=LossConfig(kl_coef=0.0)))
    with pytest.raises(TokenizerMismatch, match="SmolLM2"):
        session.step([str(traj)])
    assert session.step_count == 0
    session.close(checkpoint=False)
