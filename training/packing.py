"""Sequence packing: trajectory rows -> token-budget micro-batches with no cross-sequence attention.

Each micro-batch is one packed row ``[1, L]`` (``L <= token_budget``) of whole sequences placed by
first-fit-decreasing. Sequences are kept apart in attention in one of three ways:

* ``attention="position_ids"`` (default): position ids restart at 0 at every sequence start and no
  attention mask is passed. transformers 4.57 detects the restarts (``find_packed_sequence_indices``
  in ``masking_utils``) and builds a block-diagonal causal mask for the sdpa and eager kernels, the
  CPU paths; flash-attention-2 turns the same restarts into varlen ``cu_seqlens`` on GPUs. This
  only holds with ``use_cache=False`` (with a cache, transformers skips the detection and the
  sequences silently attend to each other), which the trainer always passes.
* ``attention="block_mask"``: an explicit 4-D additive block-diagonal causal mask, for kernels or
  versions that do not detect packed positions.
* ``attention="shared_prefix"``: sequences with a common prefix (a GRPO group's prompt, a harness's
  system prompt) run it once, with a 4-D prefix-tree mask (``prefix_sharing.py``). The same
  logprobs and gradients for fewer tokens: 8 samples of one ~1,500-token Pi prompt run ~1,520
  tokens instead of ~12,000.

Only positions that predict a sampled token (loss mask 1) get logits: the token at ``t`` is
predicted by the hidden state at ``t - 1``, and those indices go to the model as
``logits_to_keep``, which saves the vocabulary projection on every prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl
import torch

from .loss import aggregation_weights
from .prefix_sharing import Unit, group_by_prefix, lay_out_unit, prefix_tree_mask

ATTENTION_MODES = ("position_ids", "block_mask", "shared_prefix")


@dataclass
class PackedSequence:
    """One trajectory row, validated: where its sampled tokens are and what they carry."""

    index: int  # row index in the mini-batch (aggregation groups tokens by it)
    input_ids: list[int]
    sampled_positions: list[int]  # t with loss_mask[t] == 1 (always >= 1)
    behaviour_logp: list[float]
    advantage: float
    trajectory_id: str = ""
    temperature: float = 1.0  # the sampling distribution of its calls (trajectory columns)
    top_k: int = 0
    top_p: float = 1.0

    @property
    def length(self) -> int:
        return len(self.input_ids)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [1, L] long
    position_ids: torch.Tensor  # [1, L] long, restarting at each sequence
    logit_positions: torch.Tensor  # [K] positions whose logits predict the sampled tokens
    target_ids: torch.Tensor  # [K]
    behaviour_logp: torch.Tensor  # [K] float32 (vLLM's)
    advantages: torch.Tensor  # [K]
    seq_index: torch.Tensor  # [K] sequence index within the mini-batch
    weights: torch.Tensor  # [K] aggregation weights (float64)
    seq_lengths: list[int]
    attention_mask: torch.Tensor | None = None  # [1, 1, L, L] additive, only for block_mask
    old_logp: torch.Tensor | None = None  # [K], filled when the trainer precomputes it
    ref_logp: torch.Tensor | None = None
    temperature: torch.Tensor | None = None  # [K] float32, None when every token was sampled at T=1
    top_k: torch.Tensor | None = None  # [K] long (0: off), None when no token used top-k
    top_p: torch.Tensor | None = None  # [K] float32 (1: off), None when no token used top-p
    is_padding: bool = False  # a zero-weight filler so that every rank runs as many passes
    target_positions: torch.Tensor | None = None  # [K] index of each target in its own sequence (token_record.py)
    seq_ids: list[str] | None = None  # trajectory_id of each sequence index of the mini-batch

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def n_sampled(self) -> int:
        return int(self.target_ids.numel())


@dataclass
class PackStats:
    n_sequences: int = 0
    n_bins: int = 0
    n_tokens: int = 0
    n_sampled_tokens: int = 0
    token_budget: int = 0
    n_oversize: int = 0  # sequences (units) longer than the budget, each trained alone in its own bin
    n_shared_tokens: int = 0  # tokens not run because a shared prefix ran once (attention="shared_prefix")
    bin_tokens: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return sum(max(self.token_budget, t) for t in self.bin_tokens)

    @property
    def padding_waste(self) -> float:
        """Share of the bins' token capacity left empty (what padding every bin to the budget costs)."""
        return 1.0 - self.n_tokens / self.capacity if self.capacity else 0.0

    def describe(self) -> str:
        return (
            f"packed {self.n_sequences} sequences ({self.n_tokens} tokens, {self.n_sampled_tokens} sampled) "
            f"into {self.n_bins} bins of <= {self.token_budget} tokens: padding waste "
            f"{100 * self.padding_waste:.1f}%" + (f", {self.n_oversize} oversize" if self.n_oversize else "")
            + (f", {self.n_shared_tokens} tokens of shared prefixes run once" if self.n_shared_tokens else "")
        )


def sequences_from_frame(frame: pl.DataFrame) -> list[PackedSequence]:
    """Validate trajectory rows (with an ``advantage`` column) and extract their sampled tokens.

    Raises instead of dropping: mismatched list lengths, a sampled token at position 0 (nothing
    predicts it) or a non-finite advantage would otherwise silently remove or corrupt tokens.
    """
    cols = ["input_ids", "loss_mask", "logprobs", "advantage"]
    missing = [c for c in cols if c not in frame.columns]
    if missing:
        raise ValueError(f"trajectory frame lacks columns {missing}")
    tid = frame["trajectory_id"].to_list() if "trajectory_id" in frame.columns else [str(i) for i in range(frame.height)]
    if "sampling_issue" in frame.columns:
        bad = [(t, why) for t, why in zip(tid, frame["sampling_issue"].to_list()) if why]
        if bad:
            more = f" (and {len(bad) - 1} more sequences)" if len(bad) > 1 else ""
            raise ValueError(
                f"{bad[0][0]}: {bad[0][1]}{more}. The trainer cannot reproduce the distribution these tokens were "
                "sampled from; enforce the rollout's sampling (polar_sampling / polar rollout --temperature) and serve "
                "with --logprobs-mode processed_logprobs, or drop these sequences"
            )
    n = frame.height
    temps = frame["temperature"].to_list() if "temperature" in frame.columns else [1.0] * n
    top_ks = frame["top_k"].to_list() if "top_k" in frame.columns else [0] * n
    top_ps = frame["top_p"].to_list() if "top_p" in frame.columns else [1.0] * n
    out: list[PackedSequence] = []
    for i, (ids, mask, lps, adv) in enumerate(
        zip(frame["input_ids"].to_list(), frame["loss_mask"].to_list(), frame["logprobs"].to_list(), frame["advantage"].to_list())
    ):
        if temps[i] is not None and not temps[i] > 0:
            raise ValueError(f"{tid[i]}: sampling temperature {temps[i]} (greedy calls are not samples of a distribution)")
        if not (len(ids) == len(mask) == len(lps)):
            raise ValueError(f"{tid[i]}: input_ids/loss_mask/logprobs lengths differ ({len(ids)}/{len(mask)}/{len(lps)})")
        if adv is None or adv != adv:
            raise ValueError(f"{tid[i]}: advantage is missing or NaN")
        positions = [t for t, m in enumerate(mask) if m]
        if positions and positions[0] == 0:
            raise ValueError(f"{tid[i]}: a sampled token at position 0 has no context to be predicted from")
        bad_lp = next((t for t in positions if lps[t] is None or lps[t] != lps[t] or lps[t] == float("inf")), None)
        if bad_lp is not None:  # NaN would turn the importance ratio and the loss into NaN
            raise ValueError(f"{tid[i]}: behaviour logprob {lps[bad_lp]} at sampled position {bad_lp} (not a logprob)")
        out.append(
            PackedSequence(
                index=i,
                input_ids=list(ids),
                sampled_positions=positions,
                behaviour_logp=[float(lps[t]) for t in positions],
                advantage=float(adv),
                trajectory_id=tid[i],
                temperature=1.0 if temps[i] is None else float(temps[i]),
                top_k=int(top_ks[i] or 0),
                top_p=1.0 if top_ps[i] is None else float(top_ps[i]),
            )
        )
    return out


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Bin-pack item indices by first-fit-decreasing; an item over the budget gets a bin of its own."""
    if budget <= 0:
        raise ValueError("token budget must be positive")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(max(budget - n, 0))
    return bins


def block_diagonal_causal_mask(seq_lengths: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive [1, 1, L, L] mask: causal inside each sequence, -inf (dtype min) across them."""
    total = sum(seq_lengths)
    seg = torch.repeat_interleave(torch.arange(len(seq_lengths)), torch.tensor(seq_lengths))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    mask = torch.zeros(total, total, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def build_microbatches(
    sequences: list[PackedSequence],
    token_budget: int,
    aggregation: str = "token-mean",
    attention: str = "position_ids",
    mask_dtype: torch.dtype = torch.float32,
) -> tuple[list[MicroBatch], PackStats]:
    """Pack one optimizer mini-batch. Aggregation weights are computed over all of its tokens."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, not {attention!r}")
    # Re-index sequences 0..n-1 within this mini-batch and compute global aggregation weights.
    local = {s.index: k for k, s in enumerate(sequences)}
    seq_of_token = torch.tensor([local[s.index] for s in sequences for _ in s.sampled_positions], dtype=torch.long)
    weights_all = aggregation_weights(seq_of_token, len(sequences), aggregation)
    offsets, acc = [], 0
    for s in sequences:
        offsets.append(acc)
        acc += len(s.sampled_positions)

    ids_all = [s.input_ids for s in sequences]
    seq_ids = [s.trajectory_id for s in sequences]
    if attention == "shared_prefix":
        units = group_by_prefix(ids_all, token_budget)
    else:  # every sequence a unit of its own, whole
        units = [Unit(members=[k], prefix_len=s.length, tokens=s.length) for k, s in enumerate(sequences)]
    lengths = [s.length for s in sequences]
    bins = first_fit_decreasing([u.tokens for u in units], token_budget)
    stats = PackStats(
        n_sequences=len(sequences),
        n_bins=len(bins),
        n_tokens=sum(u.tokens for u in units),
        n_sampled_tokens=int(seq_of_token.numel()),
        token_budget=token_budget,
        n_oversize=sum(1 for u in units if u.tokens > token_budget),
        n_shared_tokens=sum(lengths) - sum(u.tokens for u in units),
    )
    micro: list[MicroBatch] = []
    for b in bins:
        ids: list[int] = []
        pos: list[int] = []
        unit_of: list[int] = []
        member_of: list[int] = []
        logit_pos: list[int] = []
        targets: list[int] = []
        blp: list[float] = []
        adv: list[float] = []
        sidx: list[int] = []
        widx: list[int] = []
        tpos: list[int] = []
        tk: list[float] = []
        kk: list[int] = []
        pk: list[float] = []
        seq_lengths: list[int] = []
        for u_index in b:
            u = units[u_index]
            u_ids, u_pos, u_units, u_members, where = lay_out_unit(u, ids_all, len(ids), u_index)
            ids.extend(u_ids)
            pos.extend(u_pos)
            unit_of.extend(u_units)
            member_of.extend(u_members)
            for k in u.members:
                s = sequences[k]
                seq_lengths.append(s.length)
                for j, t in enumerate(s.sampled_positions):
                    logit_pos.append(where[k][t - 1])
                    targets.append(s.input_ids[t])
                    tpos.append(t)
                    blp.append(s.behaviour_logp[j])
                    adv.append(s.advantage)
                    sidx.append(k)
                    widx.append(offsets[k] + j)
                    tk.append(s.temperature)
                    kk.append(s.top_k)
                    pk.append(s.top_p)
        stats.bin_tokens.append(len(ids))
        if attention == "block_mask":
            mask = block_diagonal_causal_mask(seq_lengths, mask_dtype)
        elif attention == "shared_prefix":
            mask = prefix_tree_mask(unit_of, member_of, mask_dtype)
        else:
            mask = None
        micro.append(
            MicroBatch(
                input_ids=torch.tensor([ids], dtype=torch.long),
                position_ids=torch.tensor([pos], dtype=torch.long),
                logit_positions=torch.tensor(logit_pos, dtype=torch.long),
                target_ids=torch.tensor(targets, dtype=torch.long),
                behaviour_logp=torch.tensor(blp, dtype=torch.float32),
                advantages=torch.tensor(adv, dtype=torch.float32),
                seq_index=torch.tensor(sidx, dtype=torch.long),
                weights=weights_all[torch.tensor(widx, dtype=torch.long)] if widx else torch.zeros(0, dtype=torch.float64),
                seq_lengths=seq_lengths,
                attention_mask=mask,
                temperature=torch.tensor(tk, dtype=torch.float32) if any(t != 1.0 for t in tk) else None,
                top_k=torch.tensor(kk, dtype=torch.long) if any(k > 0 for k in kk) else None,
                top_p=torch.tensor(pk, dtype=torch.float32) if any(p < 1.0 for p in pk) else None,
                target_positions=torch.tensor(tpos, dtype=torch.int32),
                seq_ids=seq_ids,
            )
        )
    return micro, stats


def padding_microbatch() -> MicroBatch:
    """A one-token micro-batch with zero weight: keeps FSDP ranks in lock-step, changes nothing."""
    return MicroBatch(
        input_ids=torch.zeros(1, 1, dtype=torch.long),
        position_ids=torch.zeros(1, 1, dtype=torch.long),
        logit_positions=torch.zeros(1, dtype=torch.long),
        target_ids=torch.zeros(1, dtype=torch.long),
        behaviour_logp=torch.zeros(1),
        advantages=torch.zeros(1),
        seq_index=torch.zeros(1, dtype=torch.long),
        weights=torch.zeros(1, dtype=torch.float64),
        seq_lengths=[1],
        is_padding=True,
    )
