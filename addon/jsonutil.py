"""JSON encoding for the proxy's hot path: orjson, with the standard library as the fallback.

orjson is several times faster, but refuses integers beyond 64 bits (which a harness body or a
model's tool arguments can contain) and would turn an answer or a capture into an exception.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import orjson


def dumps(obj: Any, *, default: Callable[[Any], Any] | None = None, option: int | None = None) -> bytes:
    """Compact UTF-8 JSON bytes; never fails on big integers."""
    try:
        if option is None:
            return orjson.dumps(obj, default=default)
        return orjson.dumps(obj, default=default, option=option)
    except TypeError:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            obj = dataclasses.asdict(obj)
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=default).encode()
