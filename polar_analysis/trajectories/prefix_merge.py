"""Prefix-merged trajectories: the turns of one conversation become one training sequence.

A call joins the open sequence whose latest call's prompt ids are a prefix of its own prompt ids;
when several are, the longest wins, so interleaved sub-agents and parallel calls stay separate.
The merged sequence keeps every call's sampled ids exactly as sampled (loss mask 1, behaviour
logprobs). What lies between one call's sampled ids and the next call's new content — the
re-rendered answer's end, tool results, template glue — comes from the next call's
server-tokenized prompt (loss mask 0). Every merge is labelled (``merge_kind``):

- ``exact``: the next prompt starts with previous prompt + sampled ids;
- ``retokenized``: it re-rendered the answer to other ids for the same text or tool call
  (tool-call JSON re-serialized, ``[fish, ing]`` re-encoded as ``[fishing]``);
- ``content_changed``: the answer came back with other content (reasoning stripped, an empty
  ``finish_reason=length`` turn);
- ``prompt_changed``: the previous prompt is not a prefix because its generation prompt is not how
  the history renders an assistant turn (Qwen3 with ``enable_thinking=false`` puts an empty
  ``<think>\\n\\n</think>\\n\\n`` only in the generation prompt); the history before it and the
  assistant header match. Needs the template facts (a tokenizer).

For a non-exact merge the tail starts where the re-rendered answer ends (the first end-of-turn id
after it). ``strict=True`` starts a new segment wherever a merge would not be exact. A call that
cannot merge starts a new segment — of the chain whose conversation it continues (same first
message, more messages), or of a new chain — so no sampled token is ever dropped; the break is
counted with its cause (see ``drift.py``). A call with exactly the prompt of an open sequence's
latest call is a parallel call or a retry: it starts a chain of its own; when several open sequences
share the longest matching prompt (a retry next to the call it repeated), every one is tried and
the mildest merge wins (exact first), so a continuation lands on the answer it actually re-sent.
Calls sampled from different distributions (temperature, top-k, top-p) are never merged: the
break is counted as ``sampling_changed``.

What a non-exact merge costs the trainer: the later calls' sampled ids were generated after the
history as the harness re-sent it, not after the merged sequence, so their behaviour logprobs
belong to another context. Measured on the demo's Pi + Qwen2.5-Coder-0.5B capture (every merge
``content_changed``): the trainer, in float32, reproduces vLLM's logprobs to 1e-5 on each first
turn and on unmerged calls, but on later turns of merged sequences vLLM's logprob exceeds the
trainer's by 0.05-0.27 nats on average (single tokens up to 17 nats); that is the trainer's
``mismatch_kl`` of 0.14. Truncated importance sampling bounds those tokens' weight; ``strict=True``
(or per-request sequences) trains every token in exactly the context it was sampled in, at the
price of repeating the shared prefix in each sequence.

Cost: each call is compared with the open sequences' latest prompts by numpy slices, most
rejected in O(1) (first, middle and last id), so reconstruction is linear in total tokens times
the (small) number of concurrent chains of a session.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import polars as pl

from polar_analysis.trajectories.common import (
    BuildStats,
    MERGE_KINDS,
    Call,
    Sequence,
    TemplateInfo,
    by_session,
    canonical_answer,
    canonical_json,
    collect_calls,
    continues,
    conversation,
    count_skipped,
    infer_template_info,
    is_prefix,
    message_text,
    sequences_frame,
)



@dataclass
class Merge:
    index: int  # of the sequence in SessionMerger.sequences
    seq: Sequence
    kind: str  # one of common.MERGE_KINDS
    tail_start: int  # index in the next prompt where its mask-0 tail starts


_KIND_RANK = {k: n for n, k in enumerate(MERGE_KINDS)}


def _same_answer_by_messages(prev: Call, nxt: Call) -> bool:
    """Message-level check (no tokenizer): the next request re-sent prev's answer unchanged."""
    pm, nm = conversation(prev), conversation(nxt)
    if pm is None or nm is None or len(nm) <= len(pm) or prev.output_reasoning:
        return False
    msg = nm[len(pm)]
    if msg.get("role") != "assistant" or message_text(msg.get("content")).strip() != prev.output_text.strip():
        return False
    sent = [(tc.get("function") or {}) for tc in msg.get("tool_calls") or []]
    got = prev.tool_calls
    if len(sent) != len(got):
        return False
    for s, g in zip(sent, got):
        if s.get("name") != g.get("name") or canonical_json(_as_json(s.get("arguments"))) != canonical_json(_as_json(g.get("arguments"))):
            return False
    return True


def _as_json(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class SessionMerger:
    """Prefix merging within one session; feed calls in call order, then read ``sequences``."""

    def __init__(self, template: TemplateInfo, stats: BuildStats, *, strict: bool = False, classify_break=None):
        self.t = template
        self.stats = stats
        self.strict = strict
        self.sequences: list[Sequence] = []
        self._touched: list[int] = []  # per sequence: when it last grew (ties go to the freshest)
        self._clock = 0
        self._segments: dict[int, int] = {}  # chain -> segments so far
        self._eot = np.fromiter(template.eot_ids, dtype=np.int32) if template.eot_ids else np.zeros(0, np.int32)
        self._gen = np.asarray(template.generation_prompt, dtype=np.int32)
        self._hdr = np.asarray(template.assistant_header, dtype=np.int32)
        self._classify_break = classify_break

    # -- matching ---------------------------------------------------------------------------------
    def _find_eot(self, p: np.ndarray, start: int) -> int | None:
        if self._eot.size == 0:
            return None
        pos, block = start, 1024
        while pos < p.size:
            end = min(p.size, pos + block)
            hit = np.flatnonzero(np.isin(p[pos:end], self._eot))
            if hit.size:
                return pos + int(hit[0])
            pos, block = end, block * 4
        return None

    def _answer_kind(self, prev: Call, region: np.ndarray, nxt: Call) -> str:
        sampled = prev.sampled
        if sampled.size and int(sampled[-1]) in self.t.eot_ids:
            sampled = sampled[:-1]
        if self.t.decode is not None:
            a, b = self.t.decode(sampled.tolist()), self.t.decode(region.tolist())
            if a == b or canonical_answer(a) == canonical_answer(b):
                return "retokenized"
            return "content_changed"
        return "retokenized" if _same_answer_by_messages(prev, nxt) else "content_changed"

    def _merge_at(self, index: int, p: np.ndarray, s: int, lenient: bool, nxt: Call) -> Merge | None:
        seq = self.sequences[index]
        prev = seq.calls[-1]
        n = prev.sampled.size
        if p.size >= s + n and np.array_equal(p[s : s + n], prev.sampled):
            return Merge(index, seq, "prompt_changed" if lenient else "exact", s + n)
        e = self._find_eot(p, s)
        if e is None:
            return None
        tail = e + 1 if n and int(prev.sampled[-1]) in self.t.eot_ids else e
        kind = self._answer_kind(prev, p[s:e], nxt)
        if lenient and kind == "retokenized":
            kind = "prompt_changed"
        return Merge(index, seq, kind, tail)

    def _best(self, cands: list[int], p: np.ndarray, s: int, lenient: bool, call: Call) -> tuple[Merge | None, Sequence]:
        """Of the sequences whose latest prompt matches ``p`` up to ``s``, the best merge: every
        candidate is tried (a retry or a parallel call shares the prompt of the call a later turn
        continues), the mildest kind wins (exact first), recency breaks ties."""
        order = sorted(cands, key=lambda i: -self._touched[i])
        best: Merge | None = None
        for i in order:
            m = self._merge_at(i, p, s, lenient, call)
            if m is not None and (best is None or _KIND_RANK[m.kind] < _KIND_RANK[best.kind]):
                best = m
                if _KIND_RANK[m.kind] == 0:
                    break
        return best, (best.seq if best is not None else self.sequences[order[0]])

    def find(self, call: Call) -> tuple[Merge | None, Sequence | None]:
        """(merge, best sequence): the merge to do, or None with the sequence it failed to extend."""
        p = call.prompt
        cands: list[int] = []
        best_len = -1
        for i, seq in enumerate(self.sequences):
            a = seq.calls[-1].prompt
            if a.size >= best_len and is_prefix(a, p):
                if a.size > best_len:
                    cands, best_len = [], a.size
                cands.append(i)
        if cands:
            return self._best(cands, p, best_len, False, call)
        if self._gen.size and self._hdr.size:
            g, h = self._gen, self._hdr
            for i, seq in enumerate(self.sequences):
                a = seq.calls[-1].prompt
                hist = a.size - g.size
                if hist < 0 or not np.array_equal(a[hist:], g) or hist + h.size > p.size:
                    continue
                if hist >= best_len and is_prefix(a[:hist], p) and np.array_equal(p[hist : hist + h.size], h):
                    if hist > best_len:
                        cands, best_len = [], hist
                    cands.append(i)
            if cands:
                return self._best(cands, p, best_len + h.size, True, call)
        return None, None

    # -- feeding ----------------------------------------------------------------------------------
    def add(self, call: Call) -> None:
        if count_skipped(call, self.stats):
            return
        self._clock += 1
        merge, near = self.find(call)
        same_dist = merge is not None and merge.seq.calls[-1].trainer_sampling[:3] == call.trainer_sampling[:3]
        # the proxy prompted this call with a rendering of its history, not the sampled ids: the
        # template's rule (reasoning dropped, the old prompt no longer a prefix) or the harness's
        # edit (an answer changed or dropped): the earlier sampled ids are not in its context, so
        # it is not merged after them (tiny-r1: a merge put 48 unseen reasoning ids before it, gap
        # 4.2e-2 nats, 2.9e-6 split; with tool calls, mismatch_kl 4.1e-2 merged; Claude Code x
        # Qwen2.5-Coder-0.5B, an Edit call re-sent with "replace_all" added: 5 later calls merged
        # after it, mismatch_kl 6.95e-3, one token 13.2 nats off). Without exact history no call
        # carries a cause, and the default builder's merges stay as they were.
        dropped = merge is not None and merge.kind != "exact" and call.history_cause is not None
        if merge is not None and same_dist and (not self.strict or merge.kind == "exact") and not dropped:
            merge.seq.extend(call, call.prompt[merge.tail_start :], merge.kind)
            self._touched[merge.index] = self._clock
            self.stats.merges += 1
            self.stats.merge_kinds[merge.kind] += 1
            return
        chain = None
        if merge is not None and not same_dist:
            # sampled from another distribution (temperature/top-k/top-p): the trainer applies one
            # per sequence, so this call starts a new segment of the chain it continues
            chain, reason = merge.seq.chain_index, "sampling_changed"
        elif merge is not None and dropped:
            chain, reason = merge.seq.chain_index, call.history_cause
        elif merge is not None:  # strict mode: a merge that was not exact
            chain, reason = merge.seq.chain_index, f"strict:{merge.kind}"
        elif near is not None and near.calls[-1].prompt.size == call.prompt.size:
            pass  # the same prompt again: a parallel call or a retry, a chain of its own
        else:
            prev = near
            if prev is None:
                for i in sorted(range(len(self.sequences)), key=lambda i: -self._touched[i]):
                    if continues(self.sequences[i].calls[-1], call):
                        prev = self.sequences[i]
                        break
            if prev is not None:
                chain = prev.chain_index
                reason = self._classify_break(prev.calls[-1], call) if self._classify_break else "prefix_break"
        if chain is None:
            chain = len(self._segments)
            self._segments[chain] = 0
            self.stats.chains += 1
        else:
            self.stats.breaks += 1
            self.stats.break_reasons[reason] += 1
        seq = Sequence(session_id=call.session_id, chain_index=chain, segment_index=self._segments[chain])
        self._segments[chain] += 1
        seq.start(call)
        self.sequences.append(seq)
        self._touched.append(self._clock)


def build(
    calls_lf: pl.LazyFrame,
    *,
    strict: bool = False,
    template: TemplateInfo | None = None,
    classify_breaks: bool = True,
) -> tuple[pl.DataFrame, BuildStats]:
    """Prefix-merge every session of a calls frame; returns (trajectory frame, statistics)."""
    calls = collect_calls(calls_lf)
    template = template or infer_template_info(calls)
    stats = BuildStats(mode="prefix-merge-strict" if strict else "prefix-merge", calls=len(calls), template=template.source)
    classify = None
    if classify_breaks:
        from polar_analysis import drift

        def classify(prev: Call, nxt: Call) -> str:
            return drift.classify_pair(prev, nxt, template).cause

    seqs: list[Sequence] = []
    for _, session_calls in by_session(calls):
        stats.sessions += 1
        merger = SessionMerger(template, stats, strict=strict, classify_break=classify)
        for call in session_calls:
            merger.add(call)
        seqs.extend(merger.sequences)
    seqs.sort(key=lambda s: (s.session_id, s.chain_index, s.segment_index))
    return sequences_frame(seqs, stats), stats
