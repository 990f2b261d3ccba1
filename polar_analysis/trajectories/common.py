"""Shared pieces of the trajectory builders: calls as numpy arrays, template facts, output frame.

Token ids are taken from the calls frame as they were captured and sliced with numpy views; a
builder only concatenates them. Every sampled token of every usable call must end up with loss
mask 1 in exactly one sequence (``coverage``); calls that cannot contribute (status error, no
sampled ids) are counted, never silently dropped. A harness's own side calls (a title, a
next-speaker check: ``polar_core.compaction.HARNESS_SIDE_CALLS``) are not the agent's turns: every
builder leaves them out here, in ``count_skipped``, and counts them as auxiliary by kind.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from polar_core.capture_delta import lcp  # one common-prefix routine for the writer and the builders
import orjson
import polars as pl
import pyarrow as pa

from polar_core.compaction import HARNESS_SIDE_CALLS, side_call_of
from polar_core.schema import TRAJECTORY_COLUMNS

#: Polars types of the trajectory Parquet (names and order from schema.TRAJECTORY_COLUMNS).
TRAJECTORY_SCHEMA: dict[str, pl.DataType] = {
    "trajectory_id": pl.String,
    "session_id": pl.String,
    "task_id": pl.String,
    "group_id": pl.String,
    "segment_index": pl.Int32,
    "chain_index": pl.Int32,
    "input_ids": pl.List(pl.Int32),
    "loss_mask": pl.List(pl.Int8),
    "logprobs": pl.List(pl.Float64),
    "reward": pl.Float64,
    "status": pl.String,
    "n_calls": pl.Int32,
    "call_ids": pl.List(pl.String),
    "span_call_index": pl.List(pl.Int32),
    "span_start": pl.List(pl.Int64),
    "span_end": pl.List(pl.Int64),
    "span_kind": pl.List(pl.String),
    "merge_exact": pl.List(pl.Boolean),
    "merge_kind": pl.List(pl.String),
    "policy_version": pl.Int64,
    "temperature": pl.Float64,
    "top_k": pl.Int32,
    "top_p": pl.Float64,
    "sampling_issue": pl.String,
    "served_model": pl.String,
    "tokenizer_fingerprint": pl.String,
}
assert set(TRAJECTORY_COLUMNS) <= set(TRAJECTORY_SCHEMA), "every schema column must have a type"

#: What the next call's prompt did with the previous answer (``merge_kind``), mildest first.
#: the proxy's ``history_cause`` for a call prompted with the template's rendering of an earlier
#: answer whose reasoning the template drops (addon/exact_history.py): the trainer must not see
#: the sampled reasoning in that call's context (prefix_merge splits there; drift names it)
TEMPLATE_DROPPED_REASONING = "template_dropped_reasoning"
#: the proxy's ``history_cause`` for a call prompted with the template's rendering of the whole
#: history because the template no longer renders the earlier prompt as a prefix (addon/ledger.py;
#: DeepSeek-R1's tool markup is plain text, so ``<｜tool▁outputs▁end｜>`` re-tokenizes with the
#: answer after it)
TEMPLATE_NOT_PREFIX = "template_not_prefix"
#: proxy causes saying the call's context is the template's rendering, not the sampled ids: a
#: non-exact merge would put ids in its context that the model never saw (prefix_merge splits)
TEMPLATE_RERENDERED = (TEMPLATE_DROPPED_REASONING, TEMPLATE_NOT_PREFIX)

MERGE_KINDS = (
    "exact",  # previous prompt + sampled ids are a prefix of the next prompt
    "retokenized",  # same text / same tool call, different ids (JSON re-serialized, [fish,ing] vs [fishing])
    "prompt_changed",  # answer found, but the previous generation prompt was rendered differently (Qwen3 empty think)
    "content_changed",  # the answer was re-rendered with different content (reasoning stripped, truncated turn emptied)
)

#: Columns a builder reads from the calls frame.
CALL_COLUMNS = (
    "call_id", "session_id", "task_id", "group_id", "call_index", "status", "finish_reason",
    "policy_version", "prompt_token_ids", "sampled_token_ids", "sampled_logprobs",
    "normalized_request", "output_text", "output_reasoning", "output_tool_calls", "t_request_in", "sampling",
    "history_cause", "served_model",
)


@dataclass(eq=False)
class Call:
    """One captured call; token arrays are views into the collected columns (never re-derived)."""

    call_id: str
    session_id: str
    task_id: str | None
    group_id: str | None
    call_index: int
    status: str
    finish_reason: str | None
    policy_version: int | None
    prompt: np.ndarray
    sampled: np.ndarray
    logprobs: np.ndarray
    request_json: str | None = None
    output_text: str = ""
    output_reasoning: str = ""
    output_tool_calls_json: str | None = None
    sampling_json: str | None = None  # CallRecord.sampling (JSON), None on records before schema 2
    has_logprobs: bool = True  # one finite logprob per sampled id (else excluded, counted)
    history_cause: str | None = None  # the proxy's exact-history cause (CallRecord.history_cause)
    served_model: str | None = None  # the model the engine served (CallRecord.served_model)
    side_call: str | None = None  # the kind of a known harness side call (compaction.side_call_of), else None
    _request: Any = field(default=None, repr=False)
    _request_src: Any = field(default=None, repr=False)  # (Series or _SessionRequests, key): JSON read on first use

    @property
    def usable(self) -> bool:
        return self.status == "ok" and self.sampled.size > 0 and self.has_logprobs

    @property
    def label(self) -> str:
        return f"call {self.call_id} (session {self.session_id}, call #{self.call_index})"

    @property
    def trainer_sampling(self) -> tuple[float | None, int, float, str | None]:
        """(temperature, top_k, top_p, issue) of the distribution this call sampled from, as the
        trainer must reproduce it; ``issue`` (naming the call) when it cannot."""
        cached = self.__dict__.get("_trainer_sampling")
        if cached is None:
            cached = self.__dict__["_trainer_sampling"] = trainer_sampling(
                orjson.loads(self.sampling_json) if self.sampling_json else None, self.label
            )
        return cached

    @property
    def request(self) -> dict[str, Any] | None:
        if self._request is None:
            if self.request_json is None and self._request_src is not None:
                series, row = self._request_src
                self.request_json = series[row]
            if self.request_json:
                self._request = orjson.loads(self.request_json)
        return self._request

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return orjson.loads(self.output_tool_calls_json) if self.output_tool_calls_json else []


def _list_arrays(series: pl.Series, dtype: Any) -> list[np.ndarray]:
    lengths = series.list.len().fill_null(0).to_numpy().astype(np.int64)
    flat = series.explode().drop_nulls().to_numpy().astype(dtype, copy=False)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return [flat[offsets[i] : offsets[i + 1]] for i in range(lengths.size)]


#: Columns of a capture directory's calls frame (``frames.calls``) that place each prompt in the
#: cache's id arena: the builders take numpy views there instead of one copy per call (a 200-call
#: session's prompts share one arena about the size of its final prompt).
_ARENA = ("prompt_arena", "prompt_ids_start", "n_prompt_ids")

_SCALARS = ("call_id", "session_id", "task_id", "group_id", "call_index", "status", "finish_reason",
            "policy_version", "output_text", "output_reasoning", "output_tool_calls", "sampling", "history_cause",
            "served_model")


def trainer_sampling(sampling: dict[str, Any] | None, label: str) -> tuple[float | None, int, float, str | None]:
    """See :attr:`Call.trainer_sampling`. The trainer divides logits by the temperature and applies
    top-k/top-p as vLLM does; it does not reproduce min-p or penalties, constrained decoding
    (structured output, required or named tool_choice, logit_bias, min_tokens: see
    ``polar_proxy.sampling.constraints``), greedy decoding, unknown server defaults, or raw
    (pre-processing) logprobs of a non-plain distribution."""
    if not sampling:
        return None, 0, 1.0, f"{label}: no effective sampling parameters recorded (captured before schema version 2)"
    unknown = [k for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty") if sampling.get(k) is None]
    if unknown:
        return None, 0, 1.0, (f"{label}: sampling {', '.join(unknown)} unknown (the server's generation-config "
                              "defaults could not be read)")
    t, top_k, top_p = float(sampling["temperature"]), int(sampling["top_k"]), float(sampling["top_p"])
    top_k = max(top_k, 0)
    if t < 1e-5:
        return None, 0, 1.0, f"{label}: greedy decoding (temperature {t:g}) is not a sample of a distribution"
    others = []
    if float(sampling["min_p"]) > 0:
        others.append(f"min_p={sampling['min_p']}")
    for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        if float(sampling[name]) != neutral:
            others.append(f"{name}={sampling[name]}")
    others += [f"{k}={v}" for k, v in (sampling.get("constraints") or {}).items()]  # grammars, biases, masks
    if others:
        return None, 0, 1.0, f"{label}: sampled with {', '.join(others)}, which the trainer does not reproduce"
    plain = t == 1.0 and top_k == 0 and top_p >= 1.0
    mode = sampling.get("logprobs_mode")
    if not plain and mode != "processed_logprobs":
        what = "raw (before temperature/top-k/top-p)" if mode == "raw_logprobs" else f"of unknown mode ({mode})"
        return None, 0, 1.0, (f"{label}: sampled at temperature={t:g}, top_k={top_k}, top_p={top_p:g} but its logprobs "
                              f"are {what}; serve with --logprobs-mode processed_logprobs")
    return t, top_k, top_p, None


class _SessionRequests:
    """The normalized requests of a capture's calls, read one session at a time when a builder
    first asks for one (``(session_id, call_id)`` keys). Each call re-sends the whole conversation,
    so all of them at once cost the square of the session: 24 MB of JSON for a 200-call session
    with 30k-id prompts, 1.5 GB for 64 of them, where an exact-history session needs none."""

    def __init__(self, calls_lf: pl.LazyFrame, keep: int = 2):
        self.lf = calls_lf
        self.keep = keep
        self._sessions: dict[str, dict[str, str | None]] = {}

    def __getitem__(self, key: tuple[str, str]) -> str | None:
        sid, call_id = key
        got = self._sessions.get(sid)
        if got is None:
            df = self.lf.filter(pl.col("session_id") == sid).select("call_id", "normalized_request").collect()
            got = dict(zip(df["call_id"].to_list(), df["normalized_request"].to_list()))
            self._sessions[sid] = got
            while len(self._sessions) > self.keep:
                self._sessions.pop(next(iter(self._sessions)))
        return got.get(call_id)


def collect_calls(calls_lf: pl.LazyFrame) -> list[Call]:
    """Materialize the columns the builders need, ordered by session, call index, arrival time.

    Token lists become numpy views of one flat buffer per column; request JSON stays in the Polars
    column until a builder asks for it (most calls never need their messages).
    """
    names = calls_lf.collect_schema().names()
    cols = [c for c in CALL_COLUMNS if c in names]
    arena = all(c in names for c in _ARENA)  # a capture directory's frame: its prompts by reference
    if arena:  # requests too are read per session, when a builder first asks (_SessionRequests)
        cols = [c for c in cols if c not in ("prompt_token_ids", "normalized_request")] + list(_ARENA)
    df = calls_lf.select(cols).collect()
    if arena and df["prompt_arena"].null_count():  # rows not from a capture directory's cache
        arena, cols = False, [c for c in CALL_COLUMNS if c in names]
        df = calls_lf.select(cols).collect()
    order = (
        df.select("session_id", "call_index", *(["t_request_in"] if "t_request_in" in cols else []))
        .with_row_index("_i")
        .sort("session_id", "call_index", *(["t_request_in"] if "t_request_in" in cols else []), nulls_last=True, maintain_order=True)["_i"]
    )
    if not (order.diff().drop_nulls() == 1).all():  # capture files are already in order: no gather
        df = df[order]
    if arena:
        from polar_analysis.frames import prompt_views

        prompts = prompt_views(df["prompt_arena"].to_list(), df["prompt_ids_start"].to_list(), df["n_prompt_ids"].to_list())
    else:
        prompts = _list_arrays(df["prompt_token_ids"], np.int32)
    sampled = _list_arrays(df["sampled_token_ids"], np.int32)
    logprobs = _list_arrays(df["sampled_logprobs"], np.float64)
    if arena and "normalized_request" in names:
        requests: Any = _SessionRequests(calls_lf)
        keys: list[Any] = [(s, c) for s, c in zip(df["session_id"].to_list(), df["call_id"].to_list())]
    else:
        requests = df["normalized_request"] if "normalized_request" in df.columns else pl.Series([None] * df.height, dtype=pl.String)
        keys = list(range(df.height))
    get = {c: (df[c].to_list() if c in df.columns else [None] * df.height) for c in _SCALARS}
    maybe_side = _side_call_candidates(calls_lf) if "normalized_request" in names else set()
    out = []
    for i in range(df.height):
        lp = logprobs[i]
        # A call without one finite logprob per sampled id is excluded from training (counted as
        # skipped_no_logprobs), never trained on made-up values.
        has_lp = lp.size == sampled[i].size and bool(np.isfinite(lp).all() if lp.size else True)
        out.append(
            Call(
                call_id=get["call_id"][i],
                session_id=get["session_id"][i],
                task_id=get["task_id"][i],
                group_id=get["group_id"][i],
                call_index=get["call_index"][i] or 0,
                status=get["status"][i] or "ok",
                finish_reason=get["finish_reason"][i],
                policy_version=get["policy_version"][i],
                prompt=prompts[i],
                sampled=sampled[i],
                logprobs=lp,
                output_text=get["output_text"][i] or "",
                output_reasoning=get["output_reasoning"][i] or "",
                output_tool_calls_json=get["output_tool_calls"][i],
                sampling_json=get["sampling"][i],
                has_logprobs=has_lp,
                history_cause=get["history_cause"][i],
                served_model=get["served_model"][i] or None,
                _request_src=(requests, keys[i]),
            )
        )
        if get["call_id"][i] in maybe_side:
            out[-1].side_call = side_call_of(((out[-1].request or {}).get("messages")))
    return out


def _side_call_candidates(calls_lf: pl.LazyFrame) -> set[str]:
    """Call ids whose request JSON holds one of the side-call phrases: one string scan of the column
    in Polars, so only these few requests are parsed (the phrases are plain ASCII with no quote or
    backslash, so they appear in the JSON as written). One regex of escaped literals, not
    ``contains_any``: on 1,600 synthetic calls with 116 MB of request JSON the search took 0.04 s
    (0.5 s with ``contains_any``) after 0.16 s of reading the requests from the capture cache."""
    pattern = "|".join(pl.escape_regex(phrase) for phrase in sorted({p for _, p, _ in HARNESS_SIDE_CALLS}))
    hit = calls_lf.select("call_id", pl.col("normalized_request").str.contains(pattern).alias("_side"))
    return set(hit.filter(pl.col("_side")).select("call_id").collect(engine="streaming")["call_id"].to_list())


def by_session(calls: list[Call]) -> Iterator[tuple[str, list[Call]]]:
    start = 0
    for i in range(1, len(calls) + 1):
        if i == len(calls) or calls[i].session_id != calls[start].session_id:
            yield calls[start].session_id, calls[start:i]
            start = i


# ------------------------------------------------------------------------------------------------
# Template facts
# ------------------------------------------------------------------------------------------------
@dataclass
class TemplateInfo:
    """What a builder must know about the chat template, as token ids.

    ``eot_ids``: tokens that end a turn (``<|im_end|>``); ``generation_prompt``: what
    ``add_generation_prompt=True`` appends (``<|im_start|>assistant\\n`` — with Qwen3 and
    ``enable_thinking=false`` also ``<think>\\n\\n</think>\\n\\n``); ``assistant_header``: how an
    assistant turn of the history starts. ``decode`` turns ids into text (None: not available).
    Without a tokenizer, ``infer_template_info`` guesses ``eot_ids`` from the captures and leaves
    the rest unknown, which only disables merging across a changed generation prompt.
    """

    eot_ids: frozenset[int]
    generation_prompt: tuple[int, ...] = ()
    assistant_header: tuple[int, ...] = ()
    decode: Callable[[list[int]], str] | None = None
    source: str = "inferred"


def infer_template_info(calls: list[Call]) -> TemplateInfo:
    """End-of-turn id = the most common last sampled id of calls that stopped on their own."""
    last = Counter(int(c.sampled[-1]) for c in calls if c.sampled.size and c.finish_reason in ("stop", "tool_calls"))
    eot = frozenset([last.most_common(1)[0][0]]) if last else frozenset()
    return TemplateInfo(eot_ids=eot, source="inferred")




def is_prefix(a: np.ndarray, b: np.ndarray) -> bool:
    """True when ``a`` is a prefix of ``b``; rejects most non-prefixes in O(1) before comparing."""
    n = a.size
    if n > b.size:
        return False
    if n == 0:
        return True
    if a[n - 1] != b[n - 1] or a[n // 2] != b[n // 2] or a[0] != b[0]:
        return False
    return bool(np.array_equal(a, b[:n]))


# ------------------------------------------------------------------------------------------------
# Sequences and the output frame
# ------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Sequence:
    """One training sequence under construction: spans of prompt (mask 0) and sampled (mask 1) ids."""

    session_id: str
    chain_index: int
    segment_index: int
    calls: list[Call] = field(default_factory=list)
    pieces: list[np.ndarray] = field(default_factory=list)
    span_kind: list[str] = field(default_factory=list)
    span_call: list[int] = field(default_factory=list)  # call_index of the call each span came from
    span_pos: list[int] = field(default_factory=list)  # position of that call in ``calls``
    merge_kinds: list[str] = field(default_factory=list)
    length: int = 0

    def add(self, ids: np.ndarray, kind: str) -> None:
        if ids.size == 0:
            return
        self.pieces.append(ids)
        self.span_kind.append(kind)
        self.span_call.append(self.calls[-1].call_index)
        self.span_pos.append(len(self.calls) - 1)
        self.length += int(ids.size)

    def start(self, call: Call) -> None:
        self.calls.append(call)
        self.add(call.prompt, "prompt")
        self.add(call.sampled, "sampled")

    def extend(self, call: Call, tail: np.ndarray, kind: str) -> None:
        self.calls.append(call)
        self.merge_kinds.append(kind)
        self.add(tail, "prompt")
        self.add(call.sampled, "sampled")


@dataclass
class BuildStats:
    """Counts a builder reports (and `polar trajectories` / `polar inspect` print)."""

    mode: str = ""
    calls: int = 0
    sessions: int = 0
    skipped_error: int = 0
    skipped_empty: int = 0  # status ok but no sampled ids
    skipped_error_sampled_tokens: int = 0  # sampled ids of error calls (not trained on, counted)
    skipped_no_logprobs: int = 0  # status ok, sampled ids, but not one finite logprob per id
    skipped_no_logprobs_sampled_tokens: int = 0
    #: known harness side calls (titles, next-speaker checks) by kind: left out of every sequence
    auxiliary: Counter = field(default_factory=Counter)
    auxiliary_sampled_tokens: int = 0
    sequences: int = 0
    chains: int = 0
    merges: int = 0
    breaks: int = 0  # a call continued an existing chain's conversation but started a new segment
    break_reasons: Counter = field(default_factory=Counter)
    merge_kinds: Counter = field(default_factory=Counter)
    sampled_tokens: int = 0  # sampled ids of usable calls
    covered_tokens: int = 0  # of those, found with loss mask 1 in the output rows of their session
    sequence_tokens: int = 0
    template: str = ""
    #: per session, the sampled ids of its usable calls (what coverage is counted against)
    session_sampled: dict[str, list[np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def usable_calls(self) -> int:
        return self.calls - self.skipped_error - self.skipped_empty - self.skipped_no_logprobs - self.auxiliary_calls

    @property
    def auxiliary_calls(self) -> int:
        return sum(self.auxiliary.values())

    @property
    def auxiliary_summary(self) -> str:
        """"N auxiliary calls (kind: n, ...) left out", or "" when there were none."""
        if not self.auxiliary:
            return ""
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(self.auxiliary.items()))
        return f"{self.auxiliary_calls} auxiliary calls ({kinds}) left out"

    @property
    def coverage(self) -> float:
        return self.covered_tokens / self.sampled_tokens if self.sampled_tokens else 1.0

    @property
    def merge_rate(self) -> float:
        """Of the calls that continued a conversation already seen, the share merged into it."""
        return self.merges / (self.merges + self.breaks) if self.merges + self.breaks else 0.0

    @property
    def exact_merge_rate(self) -> float:
        return self.merge_kinds.get("exact", 0) / self.merges if self.merges else 0.0

    @property
    def calls_per_sequence(self) -> float:
        return self.usable_calls / self.sequences if self.sequences else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if not isinstance(v, (Counter, dict))}
        d.update(
            break_reasons=dict(self.break_reasons),
            merge_kinds=dict(self.merge_kinds),
            auxiliary=dict(self.auxiliary),
            auxiliary_calls=self.auxiliary_calls,
            coverage=self.coverage,
            merge_rate=self.merge_rate,
            exact_merge_rate=self.exact_merge_rate,
            calls_per_sequence=self.calls_per_sequence,
            usable_calls=self.usable_calls,
        )
        return d


def count_skipped(call: Call, stats: BuildStats) -> bool:
    """Count a call that cannot contribute, or must not (a harness side call); True when it was skipped."""
    if call.side_call is not None:
        stats.auxiliary[call.side_call] += 1
        stats.auxiliary_sampled_tokens += int(call.sampled.size)
        return True
    if call.status != "ok":
        stats.skipped_error += 1
        stats.skipped_error_sampled_tokens += int(call.sampled.size)
        return True
    if call.sampled.size == 0:
        stats.skipped_empty += 1
        return True
    if not call.has_logprobs:
        stats.skipped_no_logprobs += 1
        stats.skipped_no_logprobs_sampled_tokens += int(call.sampled.size)
        return True
    stats.sampled_tokens += int(call.sampled.size)
    stats.session_sampled.setdefault(call.session_id, []).append(call.sampled)
    return False


def seqs_session_ids(seqs: list[Sequence]) -> list[str]:
    return [seq.session_id for seq in seqs]


def _multiset_overlap(a: np.ndarray, b: np.ndarray) -> int:
    """Size of the multiset intersection of two id arrays."""
    if a.size == 0 or b.size == 0:
        return 0
    ua, ca = np.unique(a, return_counts=True)
    ub, cb = np.unique(b, return_counts=True)
    _, ia, ib = np.intersect1d(ua, ub, assume_unique=True, return_indices=True)
    return int(np.minimum(ca[ia], cb[ib]).sum())


def covered_count(
    sampled_by_session: dict[str, list[np.ndarray]], session_ids: list[str], ids: list[np.ndarray], masks: list[np.ndarray]
) -> int:
    """Sampled ids (per session, as a multiset) found with loss mask 1 in that session's output rows.

    Computed from the output arrays, not from the pieces they were built from, so a token that a
    builder loses or moves to another session lowers it."""
    out_by_session: dict[str, list[np.ndarray]] = {}
    for sid, a, m in zip(session_ids, ids, masks):
        out_by_session.setdefault(sid, []).append(a[m.astype(bool)])
    total = 0
    for sid, arrays in sampled_by_session.items():
        got = out_by_session.get(sid)
        if arrays and got:
            total += _multiset_overlap(np.concatenate(arrays), np.concatenate(got))
    return total


def capture_coverage(capture_dir: str | Any, trajectories: pl.DataFrame) -> pl.DataFrame:
    """Per session: sampled ids in the raw capture lines (calls with status ok, sampled ids and one
    finite logprob each, not a known harness side call: what a builder must keep) vs those with
    loss mask 1 in ``trajectories``.

    Independent of the calls frame and the builders: a token lost anywhere between the JSONL lines
    and the written Parquet lowers ``coverage``. Columns: session_id, sampled, covered, coverage."""
    from pathlib import Path

    from polar_core.schema import SESSIONS_SUBDIR, read_capture_lines

    root = Path(capture_dir)
    files = sorted((root / SESSIONS_SUBDIR).glob("*.jsonl")) if (root / SESSIONS_SUBDIR).is_dir() else sorted(root.glob("*.jsonl"))
    sampled: dict[str, list[np.ndarray]] = {}
    for f in files:
        for rec in read_capture_lines(f):
            if rec.get("record_type", "call") != "call" or rec.get("status", "ok") != "ok":
                continue
            toks, lps = rec.get("sampled_token_ids") or [], rec.get("sampled_logprobs") or []
            if not toks or len(lps) != len(toks) or any(v is None for v in lps):
                continue
            if side_call_of((rec.get("normalized_request") or {}).get("messages")):
                continue
            sampled.setdefault(rec.get("session_id") or "", []).append(np.asarray(toks, dtype=np.int64))
    got: dict[str, list[np.ndarray]] = {}
    for sid, a, m in zip(trajectories["session_id"].to_list(), trajectories["input_ids"].to_list(),
                         trajectories["loss_mask"].to_list()):
        a, m = np.asarray(a, dtype=np.int64), np.asarray(m, dtype=bool)
        got.setdefault(sid, []).append(a[m])
    rows = []
    for sid in sorted(sampled):
        total = sum(x.size for x in sampled[sid])
        covered = _multiset_overlap(np.concatenate(sampled[sid]), np.concatenate(got[sid])) if sid in got else 0
        rows.append({"session_id": sid, "sampled": total, "covered": covered, "coverage": covered / total if total else 1.0})
    return pl.DataFrame(rows, schema={"session_id": pl.String, "sampled": pl.Int64, "covered": pl.Int64, "coverage": pl.Float64})


def _large_list(arrays: list[np.ndarray], dtype: Any, pl_dtype: pl.DataType) -> pl.Series:
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pl.from_arrow(pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))).cast(pl_dtype)


def sequences_frame(seqs: list[Sequence], stats: BuildStats) -> pl.DataFrame:
    """The trajectory frame (TRAJECTORY_SCHEMA) of finished sequences; verifies coverage."""
    ids, masks, lps = [], [], []
    rows: dict[str, list[Any]] = {k: [] for k in TRAJECTORY_SCHEMA if k not in ("input_ids", "loss_mask", "logprobs")}
    for seq in seqs:
        input_ids = np.concatenate(seq.pieces).astype(np.int32, copy=False)
        mask = np.zeros(input_ids.size, dtype=np.int8)
        logprobs = np.zeros(input_ids.size, dtype=np.float64)
        starts, ends = [], []
        pos = 0
        for piece, kind, cp in zip(seq.pieces, seq.span_kind, seq.span_pos):
            starts.append(pos)
            ends.append(pos + piece.size)
            if kind == "sampled":
                call = seq.calls[cp]
                mask[pos : pos + piece.size] = 1
                logprobs[pos : pos + piece.size] = call.logprobs
            pos += piece.size
        ids.append(input_ids)
        masks.append(mask)
        lps.append(logprobs)
        first = seq.calls[0]
        versions = [c.policy_version for c in seq.calls if c.policy_version is not None]
        rows["trajectory_id"].append(f"{seq.session_id}/{seq.chain_index}.{seq.segment_index}")
        rows["session_id"].append(seq.session_id)
        rows["task_id"].append(next((c.task_id for c in seq.calls if c.task_id), None))
        rows["group_id"].append(next((c.group_id for c in seq.calls if c.group_id), None))
        rows["segment_index"].append(seq.segment_index)
        rows["chain_index"].append(seq.chain_index)
        rows["reward"].append(None)
        rows["status"].append("ok")
        rows["n_calls"].append(len(seq.calls))
        rows["call_ids"].append([c.call_id for c in seq.calls])
        rows["span_call_index"].append(seq.span_call)
        rows["span_start"].append(starts)
        rows["span_end"].append(ends)
        rows["span_kind"].append(seq.span_kind)
        rows["merge_exact"].append([k == "exact" for k in seq.merge_kinds])
        rows["merge_kind"].append(list(seq.merge_kinds))
        rows["policy_version"].append(min(versions) if versions else first.policy_version)
        t, top_k, top_p, issue = first.trainer_sampling
        for c in seq.calls[1:]:  # builders never merge calls of different distributions; guard anyway
            if issue is None and c.trainer_sampling[:3] != (t, top_k, top_p):
                issue = f"{c.label}: sampled from another distribution than {first.label} of the same sequence"
            issue = issue or c.trainer_sampling[3]
        rows["temperature"].append(t)
        rows["top_k"].append(top_k)
        rows["top_p"].append(top_p)
        rows["sampling_issue"].append(issue)
        rows["served_model"].append(next((c.served_model for c in seq.calls if c.served_model), None))
        rows["tokenizer_fingerprint"].append(None)  # the builder has no tokenizer: see stamp_tokenizer
        stats.sequence_tokens += int(input_ids.size)
    stats.sequences = len(seqs)
    stats.covered_tokens = covered_count(stats.session_sampled, seqs_session_ids(seqs), ids, masks)
    cols: dict[str, pl.Series] = {}
    for name, dtype in TRAJECTORY_SCHEMA.items():
        if name == "input_ids":
            cols[name] = _large_list(ids, np.int32, dtype)
        elif name == "loss_mask":
            cols[name] = _large_list(masks, np.int8, dtype)
        elif name == "logprobs":
            cols[name] = _large_list(lps, np.float64, dtype)
        else:
            cols[name] = pl.Series(name, rows[name], dtype=dtype)
    return pl.DataFrame({n: s.alias(n) for n, s in cols.items()})


def stamp_tokenizer(traj: pl.DataFrame, fingerprint: str | None) -> pl.DataFrame:
    """Every sequence's ``tokenizer_fingerprint``: the tokenizer the captures' ids belong to (the
    served model's, as found for the chat template), which ``polar train`` checks."""
    if fingerprint is None:
        return traj
    return traj.with_columns(tokenizer_fingerprint=pl.lit(fingerprint, dtype=pl.String))


def attach_rewards(traj: pl.DataFrame, rewards: pl.LazyFrame | None) -> pl.DataFrame:
    """Fill reward/status (and missing task/group ids) from a rewards table keyed by session_id."""
    if rewards is None:
        return traj
    table = rewards.select(
        "session_id",
        pl.col("reward").alias("_reward"),
        pl.col("status").alias("_status"),
        pl.col("task_id").alias("_task_id"),
        pl.col("group_id").alias("_group_id"),
    ).collect()
    out = traj.join(table, on="session_id", how="left", maintain_order="left")
    return out.with_columns(
        reward=pl.col("_reward"),
        status=pl.col("_status").fill_null(pl.col("status")),
        task_id=pl.col("task_id").fill_null(pl.col("_task_id")),
        group_id=pl.col("group_id").fill_null(pl.col("_group_id")),
    ).select(list(TRAJECTORY_SCHEMA))


# ---- conversations: what two calls' messages say (shared by prefix merging and drift) ----------

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def canonical_json(text: str) -> str:
    """JSON text (a tool call, its arguments) in one canonical spelling; other text stripped."""
    try:
        obj = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(obj, dict) and isinstance(obj.get("arguments"), str):
        try:
            obj["arguments"] = json.loads(obj["arguments"])
        except ValueError:
            pass
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_answer(text: str) -> str:
    """Answer text with Hermes ``<tool_call>`` JSON canonicalized, whitespace around the tags and
    at both ends dropped: what must be equal for two renderings to say the same thing."""
    text = _TOOL_CALL_RE.sub(lambda m: "<tool_call>" + canonical_json(m.group(1)) + "</tool_call>", text)
    return re.sub(r"\s*(</?tool_call>)\s*", r"\1", text).strip()


def message_text(content) -> str:
    """The text of a message's content (a string or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    return str(content)


def conversation(call: Call) -> list[dict] | None:
    """The request's messages without system/developer ones (None when it has no message list)."""
    req = call.request
    if not req or not isinstance(req.get("messages"), list):
        return None
    return [m for m in req["messages"] if isinstance(m, dict) and m.get("role") not in ("system", "developer")]


def continues(prev: Call, nxt: Call) -> bool:
    """True when ``nxt`` carries on ``prev``'s conversation (same opening message, more turns)."""
    pm, nm = conversation(prev), conversation(nxt)
    if pm is None or nm is None:
        return lcp(prev.prompt, nxt.prompt) * 2 > prev.prompt.size
    if not pm or len(nm) <= len(pm):
        return False
    if [m.get("role") for m in pm] != [m.get("role") for m in nm[: len(pm)]]:
        return False
    return message_text(pm[0].get("content")).strip() == message_text(nm[0].get("content")).strip()
