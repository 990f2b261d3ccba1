"""The contract of an inference-engine adapter: which fields to ask for, how to read tokens back.

Everything upstream of the engine speaks OpenAI Chat Completions; engines differ only in how
they are asked for token ids and logprobs and where they put them in answers and stream chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson


@dataclass
class TokenData:
    """Token-level facts of one call, accumulated across stream chunks. Never re-derived."""

    prompt_token_ids: list[int] = field(default_factory=list)  # or a RawIds: the engine's own bytes
    sampled_token_ids: list[int] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)


class Engine:
    name: ClassVar[str]

    def prepare(self, chat_request: dict[str, Any]) -> dict[str, Any]:
        """Add the engine's token-id / logprob request fields (in place, returned for chaining)."""
        raise NotImplementedError

    def parse(self, payload: bytes, into: TokenData) -> dict[str, Any]:
        """Parse an answer or a stream chunk (``orjson.JSONDecodeError`` if it is not JSON).

        An adapter may first lift bulky id lists out of the bytes into ``into`` (kept verbatim)."""
        return orjson.loads(payload)

    def read_response(self, response: dict[str, Any], into: TokenData) -> None:
        """Collect token data from a whole (non-streaming) chat.completion."""
        raise NotImplementedError

    def read_chunk(self, chunk: dict[str, Any], into: TokenData) -> None:
        """Collect token data from one streamed chat.completion.chunk."""
        raise NotImplementedError
