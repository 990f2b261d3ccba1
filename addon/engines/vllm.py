"""vLLM: ask for ``logprobs`` and ``return_token_ids``; read ids back from the places vLLM puts them.

Non-streaming: top-level ``prompt_token_ids``, per-choice ``token_ids`` and
``logprobs.content[].logprob``. Streaming: ``prompt_token_ids`` only in the first chunk,
``token_ids`` as each chunk's delta (vLLM sends a chunk, possibly with an empty ``delta``, for
every token when ids are requested, so none is lost to the tool parser).
"""

from __future__ import annotations

from typing import Any

from .base import Engine, TokenData


def _choice0(obj: dict[str, Any]) -> dict[str, Any] | None:
    choices = obj.get("choices") or []
    for c in choices:
        if c.get("index", 0) == 0:
            return c
    return None


def _logprob_values(choice: dict[str, Any]) -> list[float]:
    lp = choice.get("logprobs") or {}
    return [float(e.get("logprob", 0.0)) for e in (lp.get("content") or [])]


class VLLMEngine(Engine):
    name = "vllm"

    def prepare(self, chat_request: dict[str, Any]) -> dict[str, Any]:
        chat_request["logprobs"] = True
        chat_request["return_token_ids"] = True
        # Never let a harness ask for ids-as-strings: the capture wants the token texts untouched.
        chat_request.pop("return_tokens_as_token_ids", None)
        return chat_request

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
