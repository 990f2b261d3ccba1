"""The capture record and trajectory schemas: the one place both the proxy and the analysis read.

A capture directory holds append-only JSON Lines files, one per session:

    <capture_dir>/sessions/<session_id>.jsonl     one CallRecord per line

Every line is a complete JSON object terminated by "\\n", written with a single ``write`` on an
``O_APPEND`` descriptor before the harness receives the last byte of its answer. A line torn by a
crash (no trailing newline, or not valid JSON) is detected and skipped by the loader, never fatal.

Bump ``SCHEMA_VERSION`` when a field changes meaning or type; loaders accept older versions by
filling missing fields with their defaults.

Since version 3 a record may hold a ``delta`` (``capture_delta.py``): its prompt ids and requests
as what is new since an earlier record of its session, the full fields null. Read files with
``read_capture_lines``, which expands them; a raw ``orjson.loads`` of a line does not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson

from polar_core.capture_delta import read_capture_lines  # noqa: E402,F401 (re-exported: every reader imports it from here)

SCHEMA_VERSION = 3  # 3: prompt ids and requests may be stored as a delta (capture_delta.py)

#: Session ids come from headers, API keys and query strings: validate before using them as file names.
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

SESSIONS_SUBDIR = "sessions"

#: Provider wire formats the proxy understands.
PROVIDERS = ("anthropic", "openai_chat", "openai_responses", "google")


def valid_session_id(value: str | None) -> bool:
    """True when ``value`` is safe to use as a session id (and therefore as a file name)."""
    return bool(value) and SESSION_ID_RE.match(value) is not None and ".." not in value


@dataclass
class CallRecord:
    """One model call as it crossed the proxy.

    Token fields are exactly what the engine returned: never re-derived by re-tokenizing text.
    """

    schema_version: int = SCHEMA_VERSION
    record_type: str = "call"
    call_id: str = ""  # uuid4 hex
    session_id: str = ""
    session_source: str = ""  # header | proxy_auth | api_key | harness_header | connection
    task_id: str | None = None
    group_id: str | None = None
    sample_index: int | None = None
    call_index: int = 0  # 0-based order of this call within its session (assigned by the proxy)
    provider: str = ""  # one of PROVIDERS
    engine: str = "vllm"  # vllm | sglang
    harness: str = ""  # short name derived from the user agent (codex, claude-code, pi, ...)
    user_agent: str = ""
    requested_model: str = ""  # what the harness asked for (restored in answers)
    served_model: str = ""  # what the engine served
    upstream: str = ""  # base URL of the inference server (replica) that answered (or was tried last)
    policy_version: int | None = None  # weights version served at the time of the call
    stream: bool = False
    stream_mode: str = "passthrough"  # passthrough | synthetic
    status: str = "ok"  # ok | error
    http_status: int = 200  # status the harness received
    error_kind: str | None = None  # upstream_refused | upstream_5xx | rate_limited | timeout | ...
    error: str | None = None
    finish_reason: str | None = None  # chat-style: stop | length | tool_calls | ...
    native_request: dict[str, Any] | None = None  # the harness's body, secrets removed
    native_path: str = ""
    normalized_request: dict[str, Any] | None = None  # the chat request sent to the engine
    translation_notes: list[str] = field(default_factory=list)  # e.g. "dropped tool web_search"
    prompt_token_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)
    output_text: str = ""
    output_reasoning: str = ""
    output_tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {id, name, arguments}
    prompt_tokens: int = 0  # usage as reported by the engine
    completion_tokens: int = 0
    # Unix timestamps (seconds, float). None when the phase never happened (e.g. refused upstream).
    t_request_in: float | None = None  # proxy saw the complete harness request
    t_upstream_sent: float | None = None  # normalized request handed to the upstream connection
    t_upstream_first_byte: float | None = None
    t_upstream_end: float | None = None
    t_response_out: float | None = None  # last byte handed to the harness
    proxy_id: str = ""  # which proxy process wrote this (several proxies may share a directory)
    # Exact-history mode (polar_exact_history): how the prompt's history was made.
    # exact: every earlier answer in the prompt is the ids the model sampled; spliced_at=k: the first
    # k messages are (the rest re-rendered by the template); rendered: none are. None: mode off.
    history: str | None = None
    history_cause: str | None = None  # why not exact: answer_changed, history_edited, ... (ledger.py)
    # The template-rendered ids of the same messages when they differ from prompt_token_ids:
    # {"common_prefix": n, "rendered_tail": [...], "rendered_len": m}.
    rendered_prompt_diff: dict[str, Any] | None = None
    # vLLM's stop reason (exact-history mode): None for the end-of-sequence token or a cut answer,
    # a stop token id, or the stop string, whose last sampled id is text and does not end the turn
    # (the ledger closes that turn with the end of turn when it splices after a restart).
    stop_reason: int | str | None = None
    #: The sampling parameters the engine *applied* to this call (request fields, else the server's
    #: generation-config defaults, else the engine's neutral defaults): ``temperature``, ``top_p``,
    #: ``top_k`` (0 = off), ``min_p``, ``repetition_penalty``, ``presence_penalty``,
    #: ``frequency_penalty``, ``seed``; a value is None when it came from server defaults the proxy
    #: could not read. Also ``enforced`` (set by ``polar_sampling``, whatever the harness sent),
    #: ``defaults_from`` (``vllm`` neutral | a generation_config.json path | ``unknown``) and
    #: ``logprobs_mode`` (``processed_logprobs``: returned logprobs are those of the distribution
    #: sampled from; ``raw_logprobs``: before temperature/top-k/top-p; None: unknown).
    #: None on records written before schema version 2.
    sampling: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CallRecord":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


CALL_FIELDS = tuple(f.name for f in fields(CallRecord))

#: Columns of the calls frame that hold nested JSON (kept as JSON strings in Parquet).
JSON_COLUMNS = ("native_request", "normalized_request", "output_tool_calls", "rendered_prompt_diff", "sampling")

#: Trajectory Parquet columns (one row per training sequence), read by the trainer.
TRAJECTORY_COLUMNS = {
    "trajectory_id": "str",  # f"{session_id}/{chain_index}.{segment_index}" (per-request: chain 0, segment = call order)
    "session_id": "str",  # one sample (one harness run)
    "task_id": "str",
    "group_id": "str",  # GRPO group: samples of the same task in the same rollout step; null: the sample is a group of its own (zero advantage)
    "segment_index": "int",  # >0 after a prefix break within one chain
    "chain_index": "int",  # interleaved sub-agents become separate chains
    "input_ids": "list[int]",
    "loss_mask": "list[int]",  # 1 exactly on tokens the model sampled
    "logprobs": "list[float]",  # behaviour logprobs on sampled tokens, 0.0 elsewhere
    "reward": "float",
    "status": "str",  # ok | failed | timeout
    "n_calls": "int",  # calls merged into this sequence
    "call_ids": "list[str]",
    "span_call_index": "list[int]",  # per span: which call it came from
    "span_start": "list[int]",
    "span_end": "list[int]",
    "span_kind": "list[str]",  # prompt | sampled
    "merge_exact": "list[bool]",  # per merge: did the next prompt re-render the answer to the same ids
    "merge_kind": "list[str]",  # per merge: exact | retokenized | prompt_changed | content_changed
    "policy_version": "int",
    # The distribution the sequence's tokens were sampled from, as the trainer reproduces it: logits
    # divided by ``temperature``, then vLLM's top-k (0: off) and top-p (1: off). Null temperature with
    # a ``sampling_issue`` (naming the call) when it cannot (unknown or unsupported parameters, raw
    # logprobs of a processed distribution); the trainer refuses such rows. A frame without these
    # columns (hand-made) is trained as plain sampling at temperature 1.
    "temperature": "float",
    "top_k": "int",
    "top_p": "float",
    "sampling_issue": "str",
    # Which model sampled the sequence and whose token ids they are: the served model's name and
    # ``polar_core.tokenizer_identity.fingerprint`` of its tokenizer (null: no tokenizer found when
    # the trajectories were built). ``polar train`` refuses a model whose tokenizer differs.
    "served_model": "str",
    "tokenizer_fingerprint": "str",
}


# -- the harness field: who made the call, from its headers ------------------------------------

_HARNESS_MARKERS = (
    ("claude-cli", "claude-code"),
    ("claude-code", "claude-code"),
    ("codex", "codex"),
    ("qwencode", "qwen-code"),
    ("qwen-code", "qwen-code"),
    ("geminicli", "gemini-cli"),
    ("gemini-cli", "gemini-cli"),
    ("opencode", "opencode"),
    ("pi-coding-agent", "pi"),
    ("anthropic/js", "anthropic-sdk-js"),
    ("anthropic/python", "anthropic-sdk-python"),
    ("openai/js", "openai-sdk-js"),
    ("openai/python", "openai-sdk-python"),
    ("google-genai-sdk", "google-genai-sdk"),
    ("curl/", "curl"),
    ("python-urllib", "python-urllib"),
    ("aiohttp", "aiohttp"),
)


def harness_name(headers: Mapping[str, str]) -> str:
    """A short harness name: ``x-polar-harness`` if set, else derived from the user agent.

    Pi talks through the provider SDKs, so it shows up as the SDK unless the runner says otherwise.
    """
    explicit = headers.get("x-polar-harness")
    if explicit:
        return explicit.strip()[:64]
    if headers.get("originator", "").startswith("codex"):
        return "codex"
    ua = headers.get("user-agent", "").lower()
    for marker, name in _HARNESS_MARKERS:
        if marker in ua:
            return name
    return ua.split("/", 1)[0][:32] if ua else ""
