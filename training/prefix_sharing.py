"""Shared-prefix packing: sequences that begin with the same tokens run that prefix once.

A GRPO group is several samples of one prompt, and an agent harness's prompt is mostly its own
system prompt and tool list: Pi's is ~1,500 tokens for answers of 2-3 sampled tokens
(benchmarks/history/learning.md, "Learning beyond the noise"). Packed one after another, a group of 8 runs the
same 1,500 tokens forward and backward 8 times. Here the sequences of a *unit* share one copy of
their longest common prefix, and each member's suffix follows it in the row::

    [ prefix (positions 0..P-1) | suffix of member 0 (P..) | suffix of member 1 (P..) | ... ]

with an explicit 4-D mask: a prefix token sees the prefix causally; a suffix token sees the prefix
and the earlier tokens of its own suffix, never another member's. Position ids are the tokens'
positions in their own sequence, so every sampled token is predicted from exactly the hidden
states it would have alone (``tests/training/test_prefix_sharing.py``: logprobs, loss and
gradients equal to packing each sequence alone). The gradient through the shared prefix is the sum
over members, which is what running it once per member adds up to.

A sampled token inside the shared prefix (an identical earlier turn) keeps one loss entry per
member, each with its own behaviour logprob and advantage, at the same logit position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: a shorter common prefix is not worth a unit: the mask is [L, L] and the saving is tiny
MIN_SHARED_TOKENS = 16


@dataclass
class Unit:
    """Sequences (indices) that run one copy of their first ``prefix_len`` tokens."""

    members: list[int]
    prefix_len: int
    tokens: int  # prefix + every member's suffix: what the unit costs in a row


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def group_by_prefix(ids: list[list[int]], budget: int, min_shared: int = MIN_SHARED_TOKENS) -> list[Unit]:
    """Greedy units over the sequences in lexicographic order (so sequences with a long common
    prefix are neighbours): a sequence joins the current unit when that costs fewer row tokens
    than running it alone, the common prefix stays at least ``min_shared`` tokens and the unit
    stays within ``budget``; otherwise it starts a unit of its own."""
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    units: list[Unit] = []
    for i in order:
        n = len(ids[i])
        if units:
            u = units[-1]
            first = ids[u.members[0]]
            p = common_prefix_len(first, ids[i], u.prefix_len)
            suffixes = sum(len(ids[m]) - p for m in u.members) + (n - p)
            joined = p + suffixes
            if p >= min_shared and joined < u.tokens + n and joined <= budget:
                u.members.append(i)
                u.prefix_len = p
                u.tokens = joined
                continue
        units.append(Unit(members=[i], prefix_len=n, tokens=n))
    return units


def prefix_tree_mask(unit_of: list[int], member_of: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive [1, 1, L, L] mask of a row of units. ``unit_of[t]`` is the unit of row token t and
    ``member_of[t]`` its member (-1 for a shared-prefix token). Token i sees token j <= i of its own
    unit when j is a prefix token or a token of i's own member."""
    unit = torch.tensor(unit_of)
    member = torch.tensor(member_of)
    n = unit.numel()
    allowed = (unit[:, None] == unit[None, :]) & ((member[None, :] == -1) | (member[:, None] == member[None, :]))
    allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(n, n, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def lay_out_unit(u: Unit, ids: list[list[int]], row_start: int, unit_index: int) -> tuple[list[int], list[int], list[int], list[int], dict[int, list[int]]]:
    """One unit's row tokens: (ids, positions, unit tags, member tags) and, per member, the row
    index of each of its sequence positions (``where[m][t]``: the hidden state of position t)."""
    p = u.prefix_len
    first = ids[u.members[0]]
    row_ids = list(first[:p])
    positions = list(range(p))
    members = [-1] * p
    where: dict[int, list[int]] = {}
    for m in u.members:
        seq = ids[m]
        start = row_start + len(row_ids)
        where[m] = list(range(row_start, row_start + p)) + list(range(start, start + len(seq) - p))
        row_ids.extend(seq[p:])
        positions.extend(range(p, len(seq)))
        members.extend([m] * (len(seq) - p))
    return row_ids, positions, [unit_index] * len(row_ids), members, where
