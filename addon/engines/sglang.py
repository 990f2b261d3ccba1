"""SGLang: ask for ``logprobs``, ``return_prompt_token_ids`` and ``return_meta_info``.

SGLang answers with ``choice.prompt_token_ids`` and ``choice.meta_info.output_token_logprobs``,
a list of ``[logprob, token_id, token_text]`` triples (the sampled ids are the second items).
Stream chunks carry the same fields for the tokens of that chunk.
"""

from __future__ import annotations

from typing import Any

from .base import Engine, TokenData
from .vllm import _choice0


def _read(obj: dict[str, Any], choice: dict[str, Any] | None, into: TokenData) -> None:
    prompt = (choice or {}).get("prompt_token_ids") or obj.get("prompt_token_ids")
    if prompt and not into.prompt_token_ids:
        into.prompt_token_ids = list(prompt)
    if choice is None:
        return
    meta = choice.get("meta_info") or obj.get("meta_info") or {}
    triples = meta.get("output_token_logprobs")
    if triples:
        for item in triples:
            into.sampled_logprobs.append(float(item[0]) if item[0] is not None else None)  # never a made-up 0.0
            into.sampled_token_ids.append(int(item[1]))
        return
    # Fall back to plain ids (and OpenAI-style logprobs) when meta_info carries no triples.
    ids = choice.get("token_ids") or meta.get("output_ids") or []
    into.sampled_token_ids.extend(ids)
    lp = choice.get("logprobs") or {}
    into.sampled_logprobs.extend(
        None if e.get("logprob") is None else float(e["logprob"]) for e in (lp.get("content") or [])
    )


class SGLangEngine(Engine):
    name = "sglang"

    def prepare(self, chat_request: dict[str, Any]) -> dict[str, Any]:
        chat_request["logprobs"] = True
        chat_request["return_prompt_token_ids"] = True
        chat_request["return_meta_info"] = True
        return chat_request

    def read_response(self, response: dict[str, Any], into: TokenData) -> None:
        _read(response, _choice0(response), into)

    def read_chunk(self, chunk: dict[str, Any], into: TokenData) -> None:
        _read(chunk, _choice0(chunk), into)
