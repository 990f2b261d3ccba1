"""What a saved mitmproxy flow of a model call carries: ``flow.metadata["polar"]``.

The proxy annotates every model call's flow so that a flow file (``save_stream_file`` / ``-w``) is
self-contained: the Polar content view and ``polar flows`` work from the file alone, on any machine,
and still point to the capture record (``capture_file``, ``call_id``) when it is there.

Keys (all of mitmproxy's serializable kinds: str, int, float, bool, None, bytes, lists, dicts):

* identity: ``session``, ``call_index``, ``call_id``, ``provider``, ``harness``, ``task_id``,
  ``group_id``, ``sample_index``, ``policy_version``, ``native_url`` (what the harness called);
* outcome: ``status``, ``http_status``, ``error_kind``, ``error``, ``finish_reason``,
  ``prompt_tokens`` / ``sampled_tokens`` (counts), ``output_text``, ``output_reasoning``,
  ``output_tool_calls`` ({id, name, arguments}), ``translation_notes``;
* serving: ``served_model``, ``requested_model``, ``upstream``, ``stream``, ``stream_mode``,
  ``sampling`` (the record's: what the engine applied), ``max_tokens_sent``, ``history`` /
  ``history_cause`` (exact-history mode), ``t_*`` timestamps;
* ``tokens``: the token ids and behaviour logprobs, each list as its JSON text in bytes
  (``pack_tokens``): a list of 10k ints costs mitmproxy's pure-Python tnetstring writer ~40 ms
  (inside the proxy's event loop), bytes cost nothing. ``unpack_tokens`` gives the lists back;
* ``capture_file``: the capture record's file, relative to the capture directory
  (``sessions/<session>.jsonl``), and ``capture_dir`` (absolute, on the machine that recorded);
* ``response_body``: how much of a streamed answer the flow keeps (``{"kept", "sent"}`` bytes).

Control-API flows carry ``{"control": name}``; passthrough flows ``{"passthrough": True}``.
"""

from __future__ import annotations

from typing import Any

import orjson

META_KEY = "polar"
TOKENS_KEY = "tokens"
#: Layout of the ``tokens`` entry: each list as its JSON text, in bytes (the proxy has the prompt ids as
#: the engine's own JSON bytes already: stored as they are, never parsed on the hot path).
TOKENS_FORMAT = "json-bytes"
TOKEN_FIELDS = ("prompt_token_ids", "sampled_token_ids", "sampled_logprobs")


def _encode(values: Any) -> bytes:
    if isinstance(values, (bytes, bytearray)):
        return bytes(values)  # already a JSON list
    return orjson.dumps(list(values))


def pack_tokens(prompt_ids: Any, sampled_ids: Any, sampled_logprobs: Any) -> dict[str, Any]:
    """The ``tokens`` entry of a flow's metadata; each argument a list, or its JSON text as bytes."""
    return {"format": TOKENS_FORMAT, "prompt_token_ids": _encode(prompt_ids),
            "sampled_token_ids": _encode(sampled_ids), "sampled_logprobs": _encode(sampled_logprobs)}


def unpack_tokens(meta: dict[str, Any] | None) -> dict[str, list[Any]] | None:
    """``{"prompt_token_ids", "sampled_token_ids", "sampled_logprobs"}`` (lists) from a flow's Polar
    metadata, or None when the flow does not carry them (flows saved before they did)."""
    tokens = (meta or {}).get(TOKENS_KEY)
    if not isinstance(tokens, dict) or tokens.get("format") != TOKENS_FORMAT:
        return None
    out: dict[str, list[Any]] = {}
    for name in TOKEN_FIELDS:
        data = tokens.get(name)
        try:
            value = orjson.loads(data) if data else []
        except orjson.JSONDecodeError:
            return None
        if not isinstance(value, list):
            return None
        out[name] = value
    return out
