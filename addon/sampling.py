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
