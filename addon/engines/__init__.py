"""Engine adapters by name (``polar_engine`` option)."""

from __future__ import annotations

from .base import Engine, TokenData
from .sglang import SGLangEngine
from .vllm import VLLMEngine

ENGINES: dict[str, Engine] = {"vllm": VLLMEngine(), "sglang": SGLangEngine()}


def get_engine(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None


__all__ = ["ENGINES", "Engine", "TokenData", "get_engine"]
