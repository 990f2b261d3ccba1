"""Fixtures for trainer tests: the tiny Qwen2 (real tokenizer) loaded once, and trajectory frames."""

from __future__ import annotations

import copy
import random

import polars as pl
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny matrices: with two OpenMP threads on a busy 2-core machine every op waits at a barrier
    for the other thread to be scheduled (measured: a toy GRPO loop took 26.5 s vs 1.3 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_qwen_loaded(tiny_qwen_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_qwen_dir, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    return model


@pytest.fixture
def tiny_model(tiny_qwen_loaded):
    """A fresh copy of tiny-qwen for a test to train or modify."""
    return copy.deepcopy(tiny_qwen_loaded)


SMALL_VOCAB = 2048


@pytest.fixture
def small_qwen(tiny_qwen_dir):
    """tiny-qwen's architecture (transformers' Qwen2, sdpa) with a 2,048-token vocabulary.

    For the mechanics tests (packing, gradients): the 151,936-row output projection of the real
    vocabulary costs most of a step on these CPUs and tests nothing more.
    """
    from transformers import AutoConfig, Qwen2ForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_qwen_dir, local_files_only=True)
    cfg.vocab_size = SMALL_VOCAB
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = SMALL_VOCAB - 1
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def synthetic_frame(
    groups: int = 2,
    samples: int = 4,
    min_len: int = 12,
    max_len: int = 40,
    vocab: int = 151000,
    seed: int = 0,
    sequences_per_sample: int = 1,
    behaviour_logp: float = -11.9,
) -> pl.DataFrame:
    """Trajectory rows in the schema's shape: prompt then sampled tokens (then, sometimes, a tool
    result and a second sampled span), rewards varying within each group."""
    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        for s in range(samples):
            sid = f"g{g}-s{s}"
            reward = ((1.0, 0.0, 0.25, 0.75), (0.0, 1.0, 1.0, 0.5))[g % 2][s % 4]
            for seg in range(sequences_per_sample):
                n = rng.randint(min_len, max_len)
                ids = [rng.randrange(vocab) for _ in range(n)]
                p = rng.randint(2, n // 2)
                mask = [0] * p + [1] * (n - p)
                if n - p > 6:  # a tool-result span inside the answer
                    k = p + (n - p) // 2
                    mask[k : k + 2] = [0, 0]
                lps = [behaviour_logp + rng.uniform(-0.3, 0.3) if m else 0.0 for m in mask]
                rows.append(
                    {
                        "trajectory_id": f"{sid}/{seg}",
                        "session_id": sid,
                        "task_id": f"task{g}",
                        "group_id": f"grp{g}",
                        "segment_index": seg,
                        "chain_index": 0,
                        "input_ids": ids,
                        "loss_mask": mask,
                        "logprobs": lps,
                        "reward": reward,
                        "status": "ok",
                        "n_calls": 1,
                        "policy_version": 0,
                    }
                )
    return pl.DataFrame(rows)


@pytest.fixture
def make_frame():
    return synthetic_frame


@pytest.fixture
def small_qwen_dir(small_qwen, tiny_qwen_dir, tmp_path):
    """``small_qwen`` saved as a model directory (with tiny-qwen's tokenizer files)."""
    from polar_training.checkpoint import copy_tokenizer_files

    out = tmp_path / "small-qwen"
    small_qwen.save_pretrained(out)
    copy_tokenizer_files(tiny_qwen_dir, out)
    return out
