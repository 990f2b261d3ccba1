"""vLLM: ask for ``logprobs`` and ``return_token_ids``; read ids back from the places vLLM puts them.

Non-streaming: top-level ``prompt_token_ids``, per-choice ``token_ids`` and
``logprobs.content[].logprob``. Streaming: ``prompt_token_ids`` only in the first chunk,
``token_ids`` as each chunk's delta (vLLM sends a chunk, possibly with an empty ``delta``, for
every token when ids are requested, so none is lost to the tool parser).
"""

from __future__ import annotations

from typing import Any

import orjson

from ..jsonutil import RawIds
from .base import Engine, TokenData

_PROMPT_IDS_KEY = b'"prompt_token_ids":['
_DIGITS = b"0123456789"


def lift_prompt_ids(payload: bytes) -> tuple[bytes, RawIds | None]:
    """``payload`` without its ``"prompt_token_ids":[...]`` member, and that list as raw bytes.

    A long prompt is ten thousand and more ids; parsing them into Python ints and encoding them
    again for the capture was most of the proxy's JSON work. The bytes are vLLM's own, so the
    capture holds exactly what the engine sent. Only a plain top-level list of digits and commas
    is lifted (inside a JSON string the key's quotes would be escaped, so the pattern cannot match
    there); anything else is left to the normal parse.
    """
    i = payload.find(_PROMPT_IDS_KEY)
    if i < 0:
        return payload, None
    start = i + len(_PROMPT_IDS_KEY)
    end = payload.find(b"]", start)
    if end < 0:
        return payload, None
    ids = payload[start:end]
    commas = ids.translate(None, _DIGITS)  # only commas may remain; they also give the count
    if commas != b"," * len(commas) or ids.startswith(b",") or ids.endswith(b",") or b",," in ids:
        return payload, None
    before, after = payload[:i].rstrip(), payload[end + 1:].lstrip()
    if before.endswith(b","):  # "...,"prompt_token_ids":[...]}" or "...,"prompt_token_ids":[...],..."
        rest = before[:-1] + after
    elif after.startswith(b","):  # "{"prompt_token_ids":[...],..."
        rest = before + after[1:]
    else:  # the only member
        rest = before + after
    return rest, RawIds(b"[" + ids + b"]", len(commas) + 1 if ids else 0)


def _choice0(obj: dict[str, Any]) -> dict[str, Any] | None:
    choices = obj.get("choices") or []
    for c in choices:
        if c.get("index", 0) == 0:
            return c
    return None


def _logprob_values(choice: dict[str, Any]) -> list[float | None]:
    """One value per returned token; a missing logprob stays None (the loader reads it as NaN and
    the trajectory builders exclude the call, counted) instead of becoming a plausible 0.0."""
    lp = choice.get("logprobs") or {}
    out: list[float | None] = []
    for e in lp.get("content") or []:
        v = e.get("logprob")
        out.append(None if v is None else float(v))
    return out


def server_sampling(server_info: dict[str, Any] | None, read_file=None) -> dict[str, Any]:
    """Where the server's sampling defaults come from, from vLLM's ``GET /server_info?config_format=json``
    (served with ``VLLM_SERVER_DEV_MODE=1``, as ``polar serve`` does).

    Returns ``{"defaults": dict | None, "defaults_from": str, "logprobs_mode": str | None}``, following
    vLLM's ``ModelConfig.get_diff_sampling_param``: ``--generation-config vllm`` gives no defaults
    (neutral sampling); ``auto`` reads ``generation_config.json`` of the model directory, a path that
    file in the path; ``--override-generation-config`` is applied on top. ``defaults`` is None when
    the info or the file cannot be read (the proxy then records those fields as unknown).
    """
    import json
    from pathlib import Path

    from ..sampling import GENERATION_CONFIG_KEYS

    unknown = {"defaults": None, "defaults_from": "unknown", "logprobs_mode": None}
    cfg = ((server_info or {}).get("vllm_config") or {})
    mc = cfg.get("model_config") if isinstance(cfg, dict) else None
    if not isinstance(mc, dict):
        return unknown
    mode = mc.get("logprobs_mode")
    src = mc.get("generation_config") or "auto"
    override = mc.get("override_generation_config") or {}
    if src == "vllm":
        config: dict[str, Any] | None = {}
        where = "vllm"
    else:
        where = str(Path(mc.get("model") or "" if src == "auto" else src) / "generation_config.json")
        try:
            config = json.loads(read_file(where) if read_file else Path(where).read_text())
        except FileNotFoundError:
            config = {}  # vLLM treats a missing file as no defaults
        except (OSError, ValueError):
            return {**unknown, "logprobs_mode": mode}
    config = {**config, **override}
    defaults = {k: config[k] for k in GENERATION_CONFIG_KEYS if config.get(k) is not None}
    return {"defaults": defaults, "defaults_from": where, "logprobs_mode": mode}


class VLLMEngine(Engine):
    name = "vllm"

    def prepare(self, chat_request: dict[str, Any]) -> dict[str, Any]:
        chat_request["logprobs"] = True
        chat_request["return_token_ids"] = True
        # Never let a harness ask for ids-as-strings: the capture wants the token texts untouched.
        chat_request.pop("return_tokens_as_token_ids", None)
        return chat_request

    def parse(self, payload: bytes, into: TokenData) -> dict[str, Any]:
        known = into.prompt_token_ids
        if known.__class__ is RawIds or known:  # vLLM sends them once (the first chunk)
            return orjson.loads(payload)
        rest, ids = lift_prompt_ids(payload)
        if ids is None:
            return orjson.loads(payload)
        try:
            out = orjson.loads(rest)
        except orjson.JSONDecodeError:  # the cut was not where we thought: parse it all
            return orjson.loads(payload)
        if not isinstance(out, dict) or "prompt_token_ids" in out:
            return orjson.loads(payload)
        if ids:
            into.prompt_token_ids = ids
            # the bytes stay lifted; translators that show a prompt count before the usage
            # chunk (Anthropic's message_start) read its length
            out["prompt_token_ids"] = ids
        return out

    def read_response(self, response: dict[str, Any], into: TokenData) -> None:
        if response.get("prompt_token_ids"):
            into.prompt_token_ids = response["prompt_token_ids"]  # freshly parsed, ours: no copy
        choice = _choice0(response)
        if choice is None:
            return
        into.sampled_token_ids.extend(choice.get("token_ids") or [])
        into.sampled_logprobs.extend(_logprob_values(choice))

    def read_chunk(self, chunk: dict[str, Any], into: TokenData) -> None:
        if chunk.get("prompt_token_ids") and not into.prompt_token_ids:
            into.prompt_token_ids = chunk["prompt_token_ids"]
        choice = _choice0(chunk)
        if choice is None:
            return
        into.sampled_token_ids.extend(choice.get("token_ids") or [])
        into.sampled_logprobs.extend(_logprob_values(choice))
