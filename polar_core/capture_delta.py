"""Capture records stored as what is new since an earlier record of the same session (schema 3).

Why: every call of an agent session re-sends the whole conversation, so a record holding its full
prompt ids and full requests makes a session's file grow with the square of its length. Measured
on a live 146-call Pi session: 21.7 MB, its records holding 79 times the ids of the last prompt.
Since schema version 3 the writer stores, for a record that shares a prefix with one of the last
few records of its session, one ``delta`` object instead:

    "prompt_token_ids": null, "native_request": null, "normalized_request": null,
    "delta": {"writer": "<the writer's random id>",
              "ref": "<call_id of an earlier record of this session file, by the same writer>",
              "prompt_shared": n, "prompt_new": [ids after the first n of the ref's prompt],
              "native_request": {KEY: INSTRUCTION, ...},
              "normalized_request": {KEY: INSTRUCTION, ...}}

A request's instructions name its top-level keys in order: ``"="`` (the ref's value, unchanged),
``{"keep": k, "add": [...]}`` (a list: the ref's first ``k`` elements, then these), or
``{"value": v}`` (stored in full). A field the delta does not name is stored in full in the
record as before (a request that is not a JSON object, a prompt that shares too little). Sampled
ids, logprobs and everything else are always stored in full.

Every record a delta writer writes carries ``delta.writer`` (a full record: ``{"writer": ...}``
alone). Crash safety is kept: a record only refers to a record written, completely, before it by
the same writer (a torn or failed write is never referred to), so a torn tail still loses only the
last record and no record depends on one written after it. After a restart the writer is a new
one and knows nothing, so the next record of a session is written in full.

Readers expand records with ``Expander`` (``schema.read_capture_lines`` does it for every file
reader): it keeps, per session and writer, the expanded prompts and requests of the last
``READ_WINDOW`` records only; a writer refers to one of its last ``WRITE_WINDOW`` records, so
memory stays bounded whatever the session's length, and several writers appending to one session
file (proxies sharing a directory) resolve each their own references.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import orjson

#: The fields a delta can stand for (they are null in the record when it does).
REQUEST_FIELDS = ("native_request", "normalized_request")
DELTA_KEY = "delta"
#: An expanded record keeps its writer's id under this key (an unknown field to CallRecord): a
#: reader that resumes mid-file (the analysis cache) knows whose references a record can serve.
WRITER_KEY = "capture_writer"
#: Earlier records of its session a record may refer to (the writer keeps their prompt ids:
#: 4 x 30k ids x 4 bytes = 480 kB per session at most).
WRITE_WINDOW = 4
#: Records a reader keeps expanded per session and writer (more than the writer's window: slack).
READ_WINDOW = 8
#: A prompt sharing fewer ids than this with every kept record is stored in full.
MIN_SHARED = 16


def dumps(value: Any) -> bytes:
    """Compact JSON; integers beyond 64 bits (which orjson refuses) through the standard library."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        import json

        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_std_fragment).encode()


def _std_fragment(obj: Any) -> Any:
    """The standard library's view of the writer's ``prompt_new`` bytes (orjson writes them as is)."""
    if isinstance(obj, orjson.Fragment):
        return orjson.loads(orjson.dumps(obj))  # a Fragment's bytes come back from dumps as they are
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


class DeltaError(ValueError):
    """A record refers to an earlier record the reader does not have (or is malformed)."""


@dataclass
class RequestDigest:
    """A request as the writer remembers it: per top-level key, a hash of the value, and of each
    element when it is a list (a few bytes per message, never the request itself). Python's
    keyed 64-bit hash of the element's JSON: in-process only, never written; it took half the
    time of blake2b (a 200-call session: 84,600 elements hashed, 1.25 s -> 0.46 s)."""

    values: dict[str, int]
    elements: dict[str, list[int]]


def digest_request(req: Any, dumps: Callable[[Any], bytes]) -> RequestDigest | None:
    if not isinstance(req, dict):
        return None
    values: dict[str, int] = {}
    elements: dict[str, list[int]] = {}
    for k, v in req.items():
        if isinstance(v, list):
            hs = [hash(dumps(e)) for e in v]
            elements[k] = hs
            values[k] = hash((len(hs), *hs))
        else:
            values[k] = hash(dumps(v))
    return RequestDigest(values, elements)


def request_delta(req: dict[str, Any], cur: RequestDigest, ref: RequestDigest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in req.items():
        if k in ref.values and ref.values[k] == cur.values[k]:
            out[k] = "="
            continue
        if k in cur.elements and k in ref.elements:
            a, b = ref.elements[k], cur.elements[k]
            n = 0
            for x, y in zip(a, b):
                if x != y:
                    break
                n += 1
            if n:
                out[k] = {"keep": n, "add": v[n:]}
                continue
        out[k] = {"value": v}
    return out


def apply_request_delta(ref: Any, instructions: dict[str, Any]) -> dict[str, Any]:
    """The request an instruction set stands for, given the ref's expanded request. Elements are
    shared with the ref's objects: treat expanded requests as read-only."""
    if not isinstance(ref, dict) or not isinstance(instructions, dict):
        raise DeltaError("request delta without a JSON object to apply it to")
    out: dict[str, Any] = {}
    for k, ins in instructions.items():
        if ins == "=":
            if k not in ref:
                raise DeltaError(f"request delta keeps {k!r}, which its ref does not have")
            out[k] = ref[k]
        elif isinstance(ins, dict) and "value" in ins:
            out[k] = ins["value"]
        elif isinstance(ins, dict) and "keep" in ins:
            base, keep, add = ref.get(k), ins["keep"], ins.get("add") or []
            if not isinstance(base, list) or not isinstance(keep, int) or keep > len(base) or not isinstance(add, list):
                raise DeltaError(f"request delta keeps {keep!r} elements of {k!r}, which its ref does not have")
            out[k] = base[:keep] + add
        else:
            raise DeltaError(f"request delta has an unknown instruction for {k!r}")
    return out


# ------------------------------------------------------------------------------------------------
# Writer side
# ------------------------------------------------------------------------------------------------
@dataclass
class _Kept:
    call_id: str
    #: the prompt's ids as compact JSON without brackets (``b"1,2,3"``): what the writer compares
    #: byte-wise with the next prompt (never parsed into ints: see ``prompt_json``)
    prompt: bytes
    requests: dict[str, RequestDigest | None]


def first_difference(x: np.ndarray, y: np.ndarray, n: int, block: int) -> int:
    """The first index below ``n`` where the arrays differ (``n`` when none), compared in growing
    numpy blocks from ``block`` elements, so a long common prefix costs few calls and an early
    difference costs one small one."""
    start = 0
    while start < n:
        end = min(n, start + block)
        diff = np.flatnonzero(x[start:end] != y[start:end])
        if diff.size:
            return start + int(diff[0])
        start, block = end, block * 4
    return n


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two id arrays (numpy blocks: ~20 us for 30k ids)."""
    return first_difference(a, b, min(a.size, b.size), 256)


def lcp_bytes(a: bytes, b: bytes, *, backwards: bool = False) -> int:
    """Length of the common prefix (``backwards``: suffix) of two byte strings. One
    ``startswith`` (a memcmp, no copy) answers the common case, a prompt that extends the other;
    otherwise growing blocks of numpy views (no copies either: slicing the bytes copied both
    sides, 49 us on a 100 kB prompt against ~15 us now)."""
    n = min(len(a), len(b))
    if not n:
        return 0
    if backwards:
        x, y = np.frombuffer(a, np.uint8)[::-1][:n], np.frombuffer(b, np.uint8)[::-1][:n]
    else:
        if (b.startswith(a) if len(a) <= len(b) else a.startswith(b)):
            return n
        x, y = np.frombuffer(a, np.uint8, n), np.frombuffer(b, np.uint8, n)
    return first_difference(x, y, n, 4096)


def _as_ids(ids: Any) -> np.ndarray | None:
    """Ids as an int32 array (the reader's form), None when they are not plain token ids."""
    if ids is None:
        return np.zeros(0, np.int32)
    if isinstance(ids, list) and ids and any(isinstance(v, (bool, float)) for v in (ids[0], ids[-1])):
        return None  # fromiter would truncate them silently
    try:  # fromiter: half the time of asarray on a 30k-id list
        arr = np.fromiter(ids, dtype=np.int64, count=len(ids)) if isinstance(ids, list) else np.asarray(ids, np.int64)
    except (TypeError, ValueError, OverflowError):
        return None
    if arr.ndim != 1 or (arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max)):
        return None
    return arr.astype(np.int32)


_COMMA, _ZERO, _NINE = ord(","), ord("0"), ord("9")


def _commas(data: bytes, end: int) -> int:
    """Commas in ``data[:end]`` (numpy: 15 us on 125 kB where ``bytes.count`` took 130 us; below
    4 kB ``count`` is quicker than numpy's call overhead)."""
    if end < 4096:
        return data.count(b",", 0, end) if end > 0 else 0
    return int(np.count_nonzero(np.frombuffer(data, np.uint8, end) == _COMMA))


@dataclass
class PromptJSON:
    """A prompt's ids as the writer handles them: compact JSON without brackets (``b"1,2,3"``)."""

    body: bytes
    size: int

    def shared_with(self, ref: bytes, p: int | None = None) -> tuple[int, int]:
        """(ids this prompt shares with the prompt ``ref`` from the start, the byte offset in
        ``body`` where its first unshared id begins). An id counts as shared only when it is whole
        in both: equal bytes up to a comma at the same place (or the end of both). ``p``: their
        common prefix in bytes, when known."""
        a, b = ref, self.body
        if not a or not b:
            return 0, 0
        p = lcp_bytes(a, b) if p is None else p
        at_end_a, at_end_b = p == len(a), p == len(b)
        if (at_end_a and (at_end_b or b[p] == _COMMA)) or (at_end_b and a[p] == _COMMA):
            # one is a prefix of the other at an id boundary: the id ending at p is shared too
            return _commas(b, p) + 1, min(p + 1, len(b))
        last = b.rfind(b",", 0, p)  # the ids before the last comma in the common bytes are whole in both
        return (_commas(b, last) + 1, last + 1) if last >= 0 else (0, 0)


def prompt_json(ids: Any) -> PromptJSON | None:
    """Prompt ids as ``PromptJSON``, or None when they are not plain token ids (a float, a bool, a
    negative number or one of 10 digits, beyond what an int32 surely holds, would not read back
    as the same id: that prompt is stored in full; no vocabulary comes near 1e9).

    ``ids``: a list or an array (serialized and checked here), or the engine's own bytes: an
    object with ``json`` (``b"[1,2,3]"``) and ``len()`` that its maker already checked to be
    digits and commas only (the proxy's ``RawIds``, from ``engines.vllm.lift_prompt_ids``), used
    as they are: never parsed, not scanned again.

    Why bytes: the writer only needs the shared prefix and the new tail. Parsing a 20k-id prompt
    into ints and then into an int32 array cost 2.2 ms on the benchmark machine (loads 1.3 ms +
    fromiter 0.95 ms, load ~2), where the byte comparison takes tens of microseconds; with the
    request parse it was most of the CPU per call the proxy lost (issue 42, benchmarks/history/proxy-overhead.md)."""
    raw = getattr(ids, "json", None)
    if isinstance(raw, (bytes, bytearray)) and raw[:1] == b"[" and raw[-1:] == b"]":
        return PromptJSON(bytes(raw[1:-1]), len(ids))
    if ids is None:
        return PromptJSON(b"", 0)
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if not isinstance(ids, list):
        return None
    try:
        data = orjson.dumps(ids)
    except TypeError:
        return None
    body = data[1:-1]
    if not body:
        return PromptJSON(b"", 0)
    arr = np.frombuffer(body, np.uint8)
    is_comma = arr == _COMMA
    if not (is_comma | ((arr >= _ZERO) & (arr <= _NINE))).all():
        return None  # a sign, a dot, an exponent, true/false
    ends = np.concatenate(([-1], np.flatnonzero(is_comma), [len(body)]))
    gaps = np.diff(ends)
    if gaps.min() < 2 or gaps.max() > 10:
        return None  # an empty id, or one of 10 digits
    return PromptJSON(body, len(ids))


class SessionDeltas:
    """Per session, what the writer needs to write the next record as a delta: the last
    ``window`` written records' prompt ids (as JSON bytes, ~6 bytes an id) and request digests;
    an LRU over ``max_sessions`` (a session pushed out just writes its next record in full).
    Bounded: at most ``max_sessions * window`` prompts (128 x 4 x 30k ids = 92 MB in the worst
    case).

    ``fragment`` wraps the new prompt ids' JSON bytes (``b"[4,5]"``) for the record: by default an
    ``orjson.Fragment``, written verbatim by ``orjson.dumps``; ``parsed(value)``: the parsed form
    of a request field when the caller already holds it (the proxy keeps the harness's body and
    the body it sent as bytes; see ``addon/capture.py``)."""

    def __init__(self, *, window: int = WRITE_WINDOW, max_sessions: int = 128,
                 dumps: Callable[[Any], bytes] = dumps, fragment: Callable[[bytes], Any] = orjson.Fragment,
                 parsed: Callable[[Any], Any] = lambda v: v):
        self.window = window
        self.max_sessions = max_sessions
        self.dumps = dumps
        self.fragment = fragment
        self.parsed = parsed
        self.writer = uuid.uuid4().hex[:12]
        self._sessions: OrderedDict[str, deque[_Kept]] = OrderedDict()

    def encode(self, rec: dict[str, Any]) -> tuple[dict[str, Any], _Kept | None]:
        """(the dict to write, what to remember once it is written). ``rec`` is a shallow dict of
        a full record; the returned dict replaces the fields a delta stands for."""
        sid = rec.get("session_id") or ""
        prompt = prompt_json(rec.get("prompt_token_ids"))
        requests = {f: self.parsed(rec.get(f)) for f in REQUEST_FIELDS}
        digests = {f: digest_request(requests[f], self.dumps) for f in REQUEST_FIELDS}
        kept = _Kept(rec["call_id"], prompt.body, digests) if prompt is not None and rec.get("call_id") else None
        past = self._sessions.get(sid)
        out = dict(rec)
        delta: dict[str, Any] = {"writer": self.writer}
        out[DELTA_KEY] = delta
        if not past or prompt is None:
            return out, kept
        # the longest common prefix in bytes shares the most ids (ids counted only for that one)
        best, best_p = past[-1], -1
        for e in reversed(past):
            p = lcp_bytes(e.prompt, prompt.body)
            if p > best_p:
                best, best_p = e, p
        best_n, best_at = prompt.shared_with(best.prompt, best_p)
        delta["ref"] = best.call_id
        if prompt.size and best_n >= min(MIN_SHARED, prompt.size):
            delta["prompt_shared"] = best_n
            delta["prompt_new"] = self.fragment(b"[" + prompt.body[best_at:] + b"]")
            out["prompt_token_ids"] = None
        for f in REQUEST_FIELDS:
            cur, ref = digests[f], best.requests.get(f)
            if cur is not None and ref is not None:
                delta[f] = request_delta(requests[f], cur, ref)
                out[f] = None
        if len(delta) == 2:
            del delta["ref"]
        return out, kept

    def remember(self, session_id: str, kept: _Kept | None) -> None:
        """After a complete write: the record may now be referred to."""
        if kept is None:
            return
        past = self._sessions.get(session_id)
        if past is None:
            past = self._sessions[session_id] = deque(maxlen=self.window)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        past.append(kept)

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)


# ------------------------------------------------------------------------------------------------
# Reader side
# ------------------------------------------------------------------------------------------------
@dataclass
class _Expanded:
    prompt: np.ndarray
    requests: dict[str, Any]


class Expander:
    """Expands delta records back to full records, file order, keeping per session the last
    ``window`` records (their prompt ids as int32 arrays, their requests as parsed objects)."""

    def __init__(self, window: int = READ_WINDOW, *, arrays: bool = False):
        self.window = window
        #: prompt ids as int32 arrays in the records it returns (the analysis cache: no list round
        #: trip, 1.2 s of a 200-call session's 5 s conversion); lists otherwise
        self.arrays = arrays
        self._sessions: dict[tuple[str, Any], OrderedDict[str, _Expanded]] = {}
        self.expanded = 0

    def _past(self, rec: dict[str, Any]) -> OrderedDict[str, _Expanded]:
        delta = rec.get(DELTA_KEY)
        key = (rec.get("session_id") or "", delta.get("writer") if isinstance(delta, dict) else None)
        past = self._sessions.get(key)
        if past is None:
            past = self._sessions[key] = OrderedDict()
        return past

    def expand(self, rec: dict[str, Any]) -> dict[str, Any]:
        """The full record (``rec`` itself when it holds no delta, else a new dict), remembered
        for the records after it. Raises DeltaError when its ref is not known."""
        delta = rec.get(DELTA_KEY)
        if delta is not None:
            if not isinstance(delta, dict):
                raise DeltaError("delta is not a JSON object")
            past = self._past(rec)
            rec = dict(rec)
            del rec[DELTA_KEY]
            rec[WRITER_KEY] = delta.get("writer")
            if "ref" not in delta:  # written in full by a delta writer
                self._keep(past, rec)
                return rec
            ref = past.get(delta["ref"])
            if ref is None:
                raise DeltaError(f"delta refers to call {delta['ref']!r}, not among the {self.window} records "
                                 f"of session {rec.get('session_id')!r} its writer wrote before it")
            if "prompt_shared" in delta:
                n, new = delta["prompt_shared"], delta.get("prompt_new") or []
                if not isinstance(n, int) or not 0 <= n <= ref.prompt.size or not isinstance(new, list):
                    raise DeltaError(f"prompt delta shares {n!r} ids of a {ref.prompt.size}-id prompt")
                if self.arrays:
                    tail = _as_ids(new)
                    if tail is None:
                        raise DeltaError("prompt delta holds values that are not token ids")
                    rec["prompt_token_ids"] = np.concatenate([ref.prompt[:n], tail])
                else:
                    rec["prompt_token_ids"] = ref.prompt[:n].tolist() + new
            for f in REQUEST_FIELDS:
                if f in delta:
                    rec[f] = apply_request_delta(ref.requests.get(f), delta[f])
            self.expanded += 1
            self._keep(past, rec)
            return rec
        self._keep(self._past(rec), rec)
        return rec

    def remember(self, rec: dict[str, Any], writer: str | None = None) -> None:
        """Keep a full record as a possible ref of ``writer``'s later records (seeds a reader that
        starts mid-file)."""
        self._keep(self._past({"session_id": rec.get("session_id"), DELTA_KEY: {"writer": writer}}), rec)

    def _keep(self, past: OrderedDict[str, _Expanded], rec: dict[str, Any]) -> None:
        prompt = rec.get("prompt_token_ids")
        if not isinstance(prompt, np.ndarray):
            prompt = _as_ids(prompt)
            if self.arrays and prompt is not None:
                rec["prompt_token_ids"] = prompt
        cid = rec.get("call_id")
        if not cid:
            return
        past[cid] = _Expanded(prompt if prompt is not None else np.zeros(0, np.int32),
                              {f: rec.get(f) for f in REQUEST_FIELDS})
        past.move_to_end(cid)
        while len(past) > self.window:
            past.popitem(last=False)


def is_delta(rec: dict[str, Any]) -> bool:
    return isinstance(rec, dict) and rec.get(DELTA_KEY) is not None


# ------------------------------------------------------------------------------------------------
# Conversion (old captures to deltas, and back)
# ------------------------------------------------------------------------------------------------
def convert_file(src: Any, dst: Any, *, delta: bool = True) -> tuple[int, int, int]:
    """Rewrite one session file: every record as a delta where it can be (``delta=False``: every
    record in full, schema version 2's layout). Records are read through ``read_capture_lines``
    (torn and unresolvable lines skipped, as every reader does). Written to a temporary file and
    renamed, so ``dst`` is never half-written. Returns (records, bytes in, bytes out)."""
    import os
    from pathlib import Path

    src, dst = Path(src), Path(dst)
    deltas = SessionDeltas(window=WRITE_WINDOW, max_sessions=1 << 30) if delta else None
    tmp = dst.with_name(dst.name + f".{os.getpid()}.tmp")
    n = out_bytes = 0
    with open(tmp, "wb") as fh:
        for rec in read_capture_lines(src):
            kept = None
            if deltas is not None:
                rec, kept = deltas.encode(rec)
            line = dumps(rec) + b"\n"
            fh.write(line)
            out_bytes += len(line)
            n += 1
            if deltas is not None:
                deltas.remember(rec.get("session_id") or "", kept)
    os.replace(tmp, dst)
    return n, src.stat().st_size, out_bytes


def read_capture_lines(path: Any, *, expand: bool = True) -> Iterator[dict[str, Any]]:
    """The JSON objects of one capture file, in order, delta records expanded to full ones
    (``expand=False``: as written). A torn last line (the proxy died while writing it), a line that
    is not a JSON object, or a delta whose earlier record is unreadable is skipped: what was
    written stays readable. Expanded requests share objects with earlier records: read-only."""
    expander = Expander() if expand else None
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                continue
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                try:  # integers beyond 64 bits (a harness's seed), which orjson refuses
                    rec = json.loads(line)
                except ValueError:
                    continue
            if isinstance(rec, dict):
                if expander is not None:
                    try:
                        rec = expander.expand(rec)
                    except DeltaError:
                        continue
                yield rec
