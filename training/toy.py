"""A self-contained GRPO loop for checking that the trainer learns: sampling in torch, a checkable reward.

The real loop samples through vLLM behind the proxy; this one samples with the policy itself
(``generate`` with plain temperature-1 sampling, no top-k/top-p, so the behaviour logprobs taken
from the raw logits are exactly the sampling distribution's, as vLLM's raw logprobs are) and emits
rows in the trajectory Parquet schema, so the trainer sees the same input either way.

Rewards: ``contains_token_reward`` (the answer contains a target token) and ``word_share_reward``
(share of the answer's tokens that are space-prefixed English words, decoded through the real
tokenizer). A random-weight model over the full 151,936-token Qwen vocabulary samples almost
uniformly (entropy ~11.9 nats): a target token appears with probability ~5e-5 per token, so
there is no signal to learn from in a few iterations; the unit-level learning test therefore uses
tiny-qwen's architecture with a 64-token vocabulary, where the target appears in ~12% of answers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import polars as pl
import torch

WORD_RE = re.compile(r"^ [A-Za-z]+$")


def word_token_ids(tokenizer) -> torch.Tensor:
    """Boolean table over the vocabulary: is the token a space-prefixed alphabetic word?"""
    vocab_size = max(len(tokenizer), tokenizer.vocab_size)
    table = torch.zeros(vocab_size, dtype=torch.bool)
    for tok, idx in tokenizer.get_vocab().items():
        if idx < vocab_size and WORD_RE.match(tokenizer.convert_tokens_to_string([tok])):
            table[idx] = True
    return table


def word_share_reward(tokenizer) -> Callable[[Sequence[int]], float]:
    table = word_token_ids(tokenizer)

    def reward(answer_ids: Sequence[int]) -> float:
        if not answer_ids:
            return 0.0
        ids = torch.tensor(list(answer_ids), dtype=torch.long)
        return float(table[ids.clamp(max=table.numel() - 1)].float().mean())

    return reward


@torch.no_grad()
def sample_groups(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    samples_per_prompt: int,
    max_new_tokens: int,
    reward_fn: Callable[[Sequence[int]], float],
    step: int,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
) -> pl.DataFrame:
    """Sample a group per prompt; return trajectory rows (one sequence per sample) with rewards."""
    model.eval()
    rows = []
    for p_idx, prompt in enumerate(prompts):
        inp = torch.tensor([list(prompt)] * samples_per_prompt, dtype=torch.long)
        out = model.generate(
            input_ids=inp,
            attention_mask=torch.ones_like(inp),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            repetition_penalty=1.0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=1,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        gen = out.sequences[:, inp.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, V] raw, before any processor
        lps = torch.log_softmax(logits, dim=-1).gather(-1, gen.unsqueeze(-1)).squeeze(-1)
        for b in range(samples_per_prompt):
            ids = gen[b].tolist()
            n = len(ids)
            if eos_token_id is not None and eos_token_id in ids:
                n = ids.index(eos_token_id) + 1
            answer = ids[:n]
            sid = f"toy-{step}-{p_idx}-{b}"
            full = list(prompt) + answer
            mask = [0] * len(prompt) + [1] * n
            logp = [0.0] * len(prompt) + lps[b, :n].tolist()
            rows.append(
                {
                    "trajectory_id": f"{sid}/0",
                    "session_id": sid,
                    "task_id": f"prompt-{p_idx}",
                    "group_id": f"step{step}-prompt{p_idx}",
                    "segment_index": 0,
                    "chain_index": 0,
                    "input_ids": full,
                    "loss_mask": mask,
                    "logprobs": logp,
                    "reward": reward_fn(answer),
                    "status": "ok",
                    "n_calls": 1,
                    "policy_version": step,
                }
            )
    return pl.DataFrame(rows)


def chat_prompts(tokenizer, questions: Sequence[str]) -> list[list[int]]:
    """Prompt ids through the model's own chat template (the same rendering vLLM would do)."""
    out = []
    for q in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def contains_token_reward(target: int) -> Callable[[Sequence[int]], float]:
    """1.0 when the answer contains ``target`` anywhere, else 0.0."""
    return lambda answer_ids: float(target in answer_ids)


def run_toy_grpo(
    trainer,
    prompts: Sequence[Sequence[int]],
    reward_fn: Callable[[Sequence[int]], float],
    iterations: int,
    samples_per_prompt: int = 8,
    max_new_tokens: int = 8,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
) -> list[float]:
    """Sample -> reward -> GRPO update, ``iterations`` times; the mean reward of each rollout."""
    torch.manual_seed(seed)
    curve = []
    for it in range(iterations):
        frame = sample_groups(
            trainer.model,
            prompts,
            samples_per_prompt,
            max_new_tokens,
            reward_fn,
            step=trainer.step,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        mean_reward = float(frame["reward"].mean())
        curve.append(mean_reward)
        history = trainer.fit(frame)
        if not history:  # every group scored alike: dropped as zero-variance, nothing to learn
            if log:
                log(f"iter {it}: reward {mean_reward:.3f}  every group zero-variance: no update")
            continue
        metrics = history[-1]
        if log:
            log(
                f"iter {it}: reward {mean_reward:.3f}  loss {metrics['loss']:+.4f}  kl {metrics['kl']:.4f}  "
                f"entropy {metrics['entropy']:.3f}  clip {metrics['clip_frac_low'] + metrics['clip_frac_high']:.3f}"
            )
    return curve
