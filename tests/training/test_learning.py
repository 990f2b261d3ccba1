"""GRPO learns: a toy task with a checkable reward improves over a few iterations (fixed seed)."""

from __future__ import annotations

import torch

from polar_training.loss import LossConfig
from polar_training.toy import contains_token_reward, run_toy_grpo
from polar_training.trainer import GRPOTrainer, TrainConfig

VOCAB = 64
TARGET = 3


def test_reward_improves_on_a_toy_task(tiny_qwen_dir, capsys):
    """Policy = tiny-qwen's architecture (Qwen2, 2 layers) with a 64-token vocabulary, sampled in
    torch; reward = the answer contains token 3. Default loss (TIS, KL 0.001), lr 3e-2."""
    import copy

    from transformers import AutoConfig, Qwen2ForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_qwen_dir, local_files_only=True)
    cfg.vocab_size = VOCAB
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = VOCAB - 1
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(cfg)
    reference = copy.deepcopy(policy)
    trainer = GRPOTrainer(policy, TrainConfig(lr=3e-2, token_budget=512, loss=LossConfig()), ref_model=reference)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (6,), generator=gen).tolist() for _ in range(2)]
    curve = run_toy_grpo(
        trainer, prompts, contains_token_reward(TARGET), iterations=7, samples_per_prompt=8, max_new_tokens=8,
        pad_token_id=VOCAB - 1,
    )
    with capsys.disabled():
        print("\nreward curve:", " ".join(f"{r:.2f}" for r in curve))
    assert curve[0] < 0.4
    assert max(curve[-2:]) >= 0.75
    assert sum(curve[-3:]) / 3 > sum(curve[:3]) / 3 + 0.3
    assert 1 <= trainer.step <= 7  # an iteration whose groups all scored alike makes no update (zero variance)
