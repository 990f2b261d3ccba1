"""The rollout's sampling parameters, enforced on every call whatever the harness sends.

Why: a harness picks its own temperature/top-p (or none, and vLLM then applies the model's
``generation_config.json``: Qwen2.5-Coder ships T=0.7, top-p 0.8, top-k 20, repetition penalty
1.1), while the trainer computes the policy's logprobs from plain logits. A token is only on-policy
when both sides use the same distribution, so a rollout fixes the distribution here, in one place,
and the capture records it (the body sent upstream is written verbatim).

``polar_sampling`` is ``name=value`` pairs separated by commas, e.g.
``temperature=1,top_p=1,top_k=-1,seed=7``. ``seed`` is a base: each call gets its own seed derived
from it, the session id and the call index, so that a rerun of the same rollout samples the same
tokens (vLLM seeds per request) while calls within a run still differ.
"""

from __future__ import annotations

import hashlib
from typing import Any

#: Request fields of vLLM's chat completions that shape the sampling distribution, with their type.
FIELDS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "seed": int,
}


def parse(spec: str | None) -> dict[str, Any]:
    """``"temperature=1,top_k=-1"`` -> ``{"temperature": 1.0, "top_k": -1}``; ValueError names the bad part."""
    out: dict[str, Any] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in FIELDS:
            raise ValueError(f"polar_sampling: {part!r} is not name=value with a name among {', '.join(FIELDS)}")
        try:
            out[name] = FIELDS[name](value.strip())
        except ValueError:
            raise ValueError(f"polar_sampling: {name} must be {FIELDS[name].__name__}, not {value!r}") from None
    if out.get("temperature", 1.0) < 0:
        raise ValueError("polar_sampling: temperature must be >= 0")
    return out


def call_seed(base: int, session_id: str, call_index: int) -> int:
    """A per-call seed (31 bits): the same for the same base, session and call, different across them."""
    digest = hashlib.blake2b(f"{base}:{session_id}:{call_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def apply(chat: dict[str, Any], sampling: dict[str, Any], session_id: str, call_index: int) -> None:
    """Overwrite the chat request's sampling fields with the rollout's (in place)."""
    if not sampling:
        return
    chat.update(sampling)
    if "seed" in sampling:
        chat["seed"] = call_seed(sampling["seed"], session_id, call_index)


#: vLLM's defaults for a chat request's sampling fields when neither the request nor the server's
#: generation config sets them (``ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS``, vLLM 0.32).
NEUTRAL: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
#: generation_config.json keys vLLM turns into server-side sampling defaults (``get_diff_sampling_param``).
GENERATION_CONFIG_KEYS = tuple(NEUTRAL)


def effective(chat: dict[str, Any], server: dict[str, Any] | None, enforced: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling parameters the engine applies to ``chat`` (what ``CallRecord.sampling`` holds).

    Priority as in vLLM: the request's field, else the server's generation-config default, else
    the neutral default. ``server`` is ``{"defaults": dict | None, "defaults_from": str,
    "logprobs_mode": str | None}`` (see ``engines.vllm.server_sampling``); ``defaults: None``
    means the server's defaults could not be read, so a field the request leaves out is None.
    ``top_k`` <= 0 is normalized to 0 (no top-k), as vLLM does. ``enforced``: the proxy's
    ``polar_sampling`` (its field names are recorded as ``enforced``).
    """
    server = server or {}
    defaults = server.get("defaults")
    out: dict[str, Any] = {}
    for name, neutral in NEUTRAL.items():
        value = chat.get(name)
        if value is None:
            value = neutral if defaults is not None and name not in defaults else (defaults or {}).get(name)
        if value is not None:
            value = FIELDS[name](value)
            if name == "top_k" and value < 0:
                value = 0
        out[name] = value
    out["seed"] = chat.get("seed")
    out["enforced"] = sorted(enforced or ())
    out["defaults_from"] = server.get("defaults_from") or "unknown"
    out["logprobs_mode"] = server.get("logprobs_mode")
    found = constraints(chat)
    if found:
        out["constraints"] = found
    return out


#: vLLM request fields that constrain decoding (structured outputs, token masks) besides
#: ``response_format`` and ``tool_choice``.
CONSTRAINT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "allowed_token_ids", "bad_words")


def constraints(chat: dict[str, Any]) -> dict[str, Any]:
    """What in ``chat`` makes vLLM change the distribution before it samples (and before it computes
    processed logprobs): a json_schema/json_object ``response_format`` (Google's responseSchema
    arrives as one) or a required/named ``tool_choice`` (both decoded under a grammar),
    ``logit_bias``, ``min_tokens`` (stop tokens masked until then), vLLM's own structured-output and
    token-mask fields. Recorded in ``CallRecord.sampling["constraints"]``; the trainer refuses such
    calls (it computes logprobs from the plain logits)."""
    out: dict[str, Any] = {}
    fmt = chat.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        out["response_format"] = str(fmt.get("type"))
    choice = chat.get("tool_choice")
    if choice == "required":
        out["tool_choice"] = "required"
    elif isinstance(choice, dict):
        out["tool_choice"] = "named:" + str((choice.get("function") or {}).get("name") or choice.get("name") or "")
    if chat.get("logit_bias"):
        out["logit_bias"] = len(chat["logit_bias"])  # how many ids are biased
    if (chat.get("min_tokens") or 0) > 0:
        out["min_tokens"] = int(chat["min_tokens"])
    for name in CONSTRAINT_FIELDS:
        if chat.get(name):
            out[name] = True
    return out


def confirm_from_render(recorded: dict[str, Any] | None, params: dict[str, Any]) -> dict[str, Any] | None:
    """Overwrite the recorded effective sampling with the ``sampling_params`` vLLM's render endpoint
    says it will apply (exact-history mode): the server's own answer, defaults included."""
    if recorded is None:
        return None
    out = dict(recorded)
    for name, kind in FIELDS.items():
        if params.get(name) is not None:
            value = kind(params[name])
            out[name] = 0 if name == "top_k" and value < 0 else value
    out["confirmed_by"] = "render"
    return out
