"""JSON encoding for the proxy's hot path: orjson, with the standard library as the fallback.

orjson is several times faster, but refuses integers beyond 64 bits (which a harness body or a
model's tool arguments can contain) and would turn an answer or a capture into an exception.

``RawJSON`` carries bytes that already are JSON (a harness's request body, the body sent to the
engine, the engine's prompt-id list): written back verbatim instead of being parsed into Python
objects and serialized again. On a 10k-token prompt that was most of a call's JSON work.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import orjson


class RawJSON:
    """One JSON value kept as its encoded bytes (no raw newlines: it goes into JSON lines).

    ``parsed``: the value those bytes parse to, when the proxy parsed or built it anyway (the
    harness's body, the chat request it serialized); the capture writer digests it instead of
    parsing the bytes again (issue 42: that parse was ~0.1 ms of the 0.35 ms per call lost).
    Read-only: it must stay equal to the bytes."""

    __slots__ = ("json", "parsed")

    def __init__(self, data: bytes, parsed: Any = None):
        self.json = data
        self.parsed = parsed

    def value(self) -> Any:
        return loads(self.json)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RawJSON):
            return self.json == other.json
        return self.value() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RawJSON({self.json[:60]!r}{'...' if len(self.json) > 60 else ''})"


class RawIds(RawJSON):
    """A token-id list as the engine sent it (``[1,2,3]``): its length without parsing it."""

    __slots__ = ("_n",)

    def __init__(self, data: bytes, count: int):
        super().__init__(data, None)
        self._n = count

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return iter(self.value())

    def __getitem__(self, index: Any) -> Any:
        return self.value()[index]

    def __bool__(self) -> bool:
        return self._n > 0


def raw_json(data: bytes, parsed: Any = None) -> RawJSON | None:
    """``data`` as a RawJSON when it can go into a JSON line as is (no raw line breaks);
    ``parsed``: what ``data`` parses to, if the caller has it (see ``RawJSON.parsed``)."""
    if b"\n" in data or b"\r" in data:
        return None
    return RawJSON(data, parsed)


def loads(data: bytes | str) -> Any:
    """Parse JSON; big integers (which orjson refuses) go through the standard library."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def _orjson_raw(obj: Any) -> Any:
    if isinstance(obj, RawJSON):
        return orjson.Fragment(obj.json)
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


def _std_raw(obj: Any) -> Any:
    if isinstance(obj, RawJSON):
        return obj.value()
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


def dumps(obj: Any, *, default: Callable[[Any], Any] | None = None, option: int | None = None) -> bytes:
    """Compact UTF-8 JSON bytes; never fails on big integers. RawJSON values are written verbatim."""
    hook = _orjson_raw if default is None else _chain(_orjson_raw, default)
    try:
        if option is None:
            return orjson.dumps(obj, default=hook)
        return orjson.dumps(obj, default=hook, option=option)
    except TypeError:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            obj = dataclasses.asdict(obj)
        std = _std_raw if default is None else _chain(_std_raw, default)
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=std).encode()


def _chain(first: Callable[[Any], Any], then: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def hook(obj: Any) -> Any:
        if isinstance(obj, RawJSON):
            return first(obj)
        return then(obj)
    return hook
