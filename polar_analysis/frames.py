"""Captures as Polars frames, lazily.

A capture directory holds ``sessions/<session>.jsonl`` files (one ``CallRecord`` per line, see
``schema.py``). Parsing JSON is the expensive part, so every JSONL file is converted once into
Parquet "parts" under a cache directory, validated line by line, and every frame is a
``pl.scan_parquet`` over those parts: a large capture directory is never loaded into memory just
to count its calls. Conversion is incremental: the files are append-only, so when a JSONL file grew
only the new complete lines are parsed into an extra part (size, mtime and a fingerprint of the
first bytes decide; a rewritten or truncated file is converted again from scratch).

Lines that cannot be used are counted, never fatal: a torn last line (no ``\\n`` yet, or a crash
mid-write) is left for the next scan; an invalid line is skipped and counted; when a crash left a
torn line and the proxy appended after it, the record glued behind the torn bytes is recovered.

Prompt ids are not stored per row in the cache: each session file gets one id arena
(``<stem>.ids``, raw int32, append-only) and a row holds where its prompt starts there and its
length. A prompt that extends the previous one (every call of an exact-history session, whatever
the capture format: full records or deltas) only appends its new ids, so the arena of a session is
about its final prompt, not the sum of all its prompts (a 200-call session growing to 30k ids:
``benchmarks/bench_capture_growth.py``). ``prompt_token_ids`` is computed from the arena only
when a query asks for it (a lazy, row-wise expression; ``n_prompt_ids`` is stored), and the
trajectory builders read the arena directly (``prompt_views``): numpy views, never a copy per call.
The two request columns likewise: each a byte file per session where a request that starts as
the previous one did refers to those bytes and appends the rest (``_Ropes``), expanded lazily.

Frames:
- ``calls(dir)``: one row per model call; token ids as ``list[i32]``, logprobs ``list[f64]``,
  nested dicts (native_request, normalized_request, output_tool_calls) as JSON strings, unknown
  future fields in ``extra_json``; plus ``n_prompt_ids``, ``n_sampled_ids``, latencies and the
  session's ``reward`` / ``rollout_status`` when rollout results exist.
- ``sessions(calls)``: one row per session.
- ``tokens(calls, which=...)``: one row per token (explode), only when asked.
- ``flows_calls(path)``: the same columns from a saved mitmproxy flow file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import orjson
import polars as pl
import pyarrow as pa

from polar_core.capture_delta import READ_WINDOW, WRITER_KEY, DeltaError, Expander, lcp_bytes
from polar_core.flowmeta import unpack_tokens
from polar_core.schema import CALL_FIELDS, JSON_COLUMNS, SESSIONS_SUBDIR, CallRecord, harness_name

#: Bump when the Parquet layout of the cache changes: older caches are converted again.
#: 4: prompt ids live in one id arena per session file (``_Arena``), requests in byte ropes
#: (``_Ropes``), not in the parts.
CACHE_VERSION = 4
CACHE_DIRNAME = ".polar-cache"

_STR = pl.String
#: Column types of the calls frame (CallRecord fields first, in schema order).
_FIELD_TYPES: dict[str, pl.DataType] = {
    "schema_version": pl.Int32,
    "record_type": _STR,
    "call_id": _STR,
    "session_id": _STR,
    "session_source": _STR,
    "task_id": _STR,
    "group_id": _STR,
    "sample_index": pl.Int32,
    "call_index": pl.Int32,
    "provider": _STR,
    "engine": _STR,
    "harness": _STR,
    "user_agent": _STR,
    "requested_model": _STR,
    "served_model": _STR,
    "upstream": _STR,
    "policy_version": pl.Int64,
    "stream": pl.Boolean,
    "stream_mode": _STR,
    "status": _STR,
    "http_status": pl.Int32,
    "error_kind": _STR,
    "error": _STR,
    "finish_reason": _STR,
    "native_request": _STR,
    "native_path": _STR,
    "normalized_request": _STR,
    "translation_notes": pl.List(_STR),
    "prompt_token_ids": pl.List(pl.Int32),
    "sampled_token_ids": pl.List(pl.Int32),
    "sampled_logprobs": pl.List(pl.Float64),
    "output_text": _STR,
    "output_reasoning": _STR,
    "output_tool_calls": _STR,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "t_request_in": pl.Float64,
    "t_upstream_sent": pl.Float64,
    "t_upstream_first_byte": pl.Float64,
    "t_upstream_end": pl.Float64,
    "t_response_out": pl.Float64,
    "proxy_id": _STR,
    "history": _STR,
    "history_cause": _STR,
    "rendered_prompt_diff": _STR,
    "sampling": _STR,  # JSON object: the effective sampling parameters (schema.CallRecord.sampling)
}
#: CallRecord fields without a type above (added since, e.g. ``stop_reason``: an id or a string)
#: are JSON strings, like the nested ones: a new field never makes a capture unreadable.
_JSON_FIELDS = frozenset(JSON_COLUMNS) | {n for n in CALL_FIELDS if n not in _FIELD_TYPES}
CALL_SCHEMA: dict[str, pl.DataType] = {
    **{n: _FIELD_TYPES.get(n, _STR) for n in CALL_FIELDS},
    # not CallRecord fields: provenance and forward compatibility
    "extra_json": _STR,  # fields this version does not know, as one JSON object (or null)
    "source_file": _STR,
    "source_line": pl.Int64,  # 1-based line number in the JSONL file (0 for flow files)
}

_TOKEN_LISTS = ("prompt_token_ids", "sampled_token_ids")
_DEFAULTS = CallRecord().to_dict()


# ------------------------------------------------------------------------------------------------
# Validation of one record
# ------------------------------------------------------------------------------------------------
class InvalidRecord(ValueError):
    pass


def _check_ints(name: str, value: Any) -> np.ndarray:
    if value is None:
        return np.zeros(0, dtype=np.int32)
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == np.int32:
        return value  # from the expander, already checked
    if not isinstance(value, list):
        raise InvalidRecord(f"{name} is not a list")
    try:
        arr = np.asarray(value, dtype=np.int64) if value else np.zeros(0, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRecord(f"{name}: {exc}") from None
    if arr.ndim != 1 or (arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max)):
        raise InvalidRecord(f"{name} holds values that are not token ids")
    if arr.size and any(isinstance(v, (bool, float)) for v in (value[0], value[-1])):
        raise InvalidRecord(f"{name} holds non-integers")
    return arr.astype(np.int32)


def normalize_record(data: Any) -> dict[str, Any]:
    """Validate one parsed line and return the row dict of the calls frame (without provenance).

    Missing fields take the CallRecord defaults (older schema versions); unknown fields are kept
    in ``extra_json``. Raises InvalidRecord when a field has the wrong type.
    """
    if not isinstance(data, dict):
        raise InvalidRecord("line is not a JSON object")
    row: dict[str, Any] = {}
    for name in CALL_FIELDS:
        value = data.get(name, _DEFAULTS[name])
        dtype = CALL_SCHEMA[name]
        if name in _TOKEN_LISTS:
            row[name] = _check_ints(name, value)
        elif name == "sampled_logprobs":
            if value and None in value:  # a token without a logprob: NaN, never a made-up 0.0
                value = [np.nan if v is None else v for v in value]
            try:
                row[name] = np.asarray(value or [], dtype=np.float64)
            except (TypeError, ValueError):
                raise InvalidRecord("sampled_logprobs holds non-numbers") from None
            if row[name].ndim != 1:
                raise InvalidRecord("sampled_logprobs is not a flat list")
        elif name in _JSON_FIELDS:
            row[name] = None if value is None else orjson.dumps(value).decode()
        elif name == "translation_notes":
            if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise InvalidRecord("translation_notes is not a list of strings")
            row[name] = value
        elif value is None:
            row[name] = None
        elif dtype == _STR:
            if not isinstance(value, str):
                raise InvalidRecord(f"{name} is not a string")
            row[name] = value
        elif dtype == pl.Boolean:
            if not isinstance(value, bool):
                raise InvalidRecord(f"{name} is not a boolean")
            row[name] = value
        elif dtype == pl.Float64:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRecord(f"{name} is not a number")
            row[name] = float(value)
        else:  # integers
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRecord(f"{name} is not an integer")
            row[name] = value
    if not row["session_id"]:
        raise InvalidRecord("session_id is empty")
    extra = {k: v for k, v in data.items() if k not in _DEFAULTS}
    row["extra_json"] = orjson.dumps(extra).decode() if extra else None
    return row


def rows_to_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Build a calls DataFrame with the exact CALL_SCHEMA from validated row dicts.

    Token lists go through numpy + Arrow offsets (no per-element Python objects in Polars).
    """
    columns: dict[str, Any] = {}
    for name, dtype in CALL_SCHEMA.items():
        if name in ("prompt_token_ids", "sampled_token_ids", "sampled_logprobs"):
            arrays = [r[name] for r in rows]
            np_dtype = np.float64 if name == "sampled_logprobs" else np.int32
            lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
            offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            values = np.concatenate(arrays).astype(np_dtype, copy=False) if arrays else np.zeros(0, np_dtype)
            columns[name] = pl.from_arrow(pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values)))
            columns[name] = columns[name].cast(dtype)
        else:
            columns[name] = pl.Series(name, [r.get(name) for r in rows], dtype=dtype)
    return pl.DataFrame(columns).select([pl.col(n).alias(n) for n in CALL_SCHEMA])


def empty_calls() -> pl.DataFrame:
    return pl.DataFrame(schema=CALL_SCHEMA)


# ------------------------------------------------------------------------------------------------
# JSONL -> Parquet cache
# ------------------------------------------------------------------------------------------------
_RECOVERY_MARKERS = (b'{"schema_version"', b'{"record_type"')


@dataclass
class FileStats:
    """What the validator saw in one JSONL file (cumulative over incremental conversions)."""

    path: str
    records: int = 0
    other_records: int = 0  # valid JSON objects whose record_type is not "call"
    invalid: int = 0  # lines that are not a valid record (skipped)
    recovered: int = 0  # records found behind torn bytes on the same line
    torn_tail: int = 0  # an incomplete last line (no newline yet): left for the next scan
    errors: list[str] = field(default_factory=list)  # first few reasons, for `polar inspect`


@dataclass
class ScanReport:
    files: list[FileStats] = field(default_factory=list)
    converted: int = 0  # files (re)converted during this scan
    appended: int = 0  # files that only got an incremental part
    cached: int = 0  # files served from the cache untouched

    def totals(self) -> dict[str, int]:
        keys = ("records", "other_records", "invalid", "recovered", "torn_tail")
        return {k: sum(getattr(f, k) for f in self.files) for k in keys}


def _parse_line(line: bytes, stats: FileStats, expander: Expander | None = None) -> list[dict[str, Any]]:
    """Rows parsed from one complete line; counts what had to be skipped. Delta records (schema 3)
    are expanded by ``expander`` against the records before them."""
    stripped = line.strip()
    if not stripped:
        return []
    try:
        data = orjson.loads(stripped)
    except orjson.JSONDecodeError as exc:
        # A torn write followed by a complete record on the same physical line.
        for marker in _RECOVERY_MARKERS:
            pos = stripped.find(marker, 1)
            if pos > 0:
                rows = _parse_line(stripped[pos:], stats, expander)
                if rows:
                    stats.recovered += len(rows)
                    stats.invalid += 1
                    return rows
        stats.invalid += 1
        if len(stats.errors) < 5:
            stats.errors.append(f"invalid JSON: {exc}")
        return []
    if isinstance(data, dict) and data.get("record_type", "call") != "call":
        stats.other_records += 1
        return []
    try:
        if expander is not None and isinstance(data, dict):
            data = expander.expand(data)
        row = normalize_record(data)
    except (InvalidRecord, DeltaError) as exc:
        stats.invalid += 1
        if len(stats.errors) < 5:
            stats.errors.append(str(exc))
        return []
    stats.records += 1
    return [row]


#: Columns of the cache parts that place a row's prompt in its file's id arena.
ARENA_SCHEMA: dict[str, pl.DataType] = {"prompt_arena": _STR, "prompt_ids_start": pl.Int64, "n_prompt_ids": pl.Int64}
#: Request columns kept as byte ropes (``_Ropes``): each call re-sends the whole conversation.
ROPE_COLUMNS = ("native_request", "normalized_request")
ROPE_SCHEMA: dict[str, pl.DataType] = {f"{c}_rope": pl.List(pl.Int64) for c in ROPE_COLUMNS}
PART_SCHEMA: dict[str, pl.DataType] = {**CALL_SCHEMA, **ARENA_SCHEMA, **ROPE_SCHEMA}


class _Ropes:
    """One request column's JSON texts of a session file, in a byte file: a text sharing its first
    bytes with the previous row's refers to them where they are (a list of ``start, length``
    pairs) and appends only the rest. Consecutive requests of a session share everything up to
    their first new message, so the file grows with the session, not with its square."""

    def __init__(self, path: Path, length: int = 0, prev: list[int] | None = None):
        self.path = path
        self.length = length
        self.pending: list[bytes] = []
        self.prev_ranges = list(prev or [])
        self.prev = _read_rope(str(path), self.prev_ranges, {}) if self.prev_ranges else b""

    def place(self, text: str | None) -> list[int] | None:
        """The ``start, length`` pairs of ``text``: the previous text's common head and tail where
        they already are (the tools after the messages are not stored again), the middle appended."""
        if text is None:
            return None
        data = text.encode()
        prev, n = self.prev, lcp_bytes(self.prev, data)
        m = lcp_bytes(prev[n:], data[n:], backwards=True)
        ranges = _slice(self.prev_ranges, 0, n)
        middle = data[n : len(data) - m]
        if middle:
            if ranges and ranges[-2] + ranges[-1] == self.length:
                ranges[-1] += len(middle)
            else:
                ranges += [self.length, len(middle)]
            self.pending.append(middle)
            self.length += len(middle)
        for s, ln in zip(*[iter(_slice(self.prev_ranges, len(prev) - m, len(prev)))] * 2):
            if ranges and ranges[-2] + ranges[-1] == s:
                ranges[-1] += ln
            else:
                ranges += [s, ln]
        self.prev, self.prev_ranges = data, ranges
        return ranges

    def flush(self, base: int) -> None:
        with open(self.path, "r+b" if self.path.exists() else "wb") as fh:
            fh.truncate(base)
            fh.seek(base)
            fh.write(b"".join(self.pending))
        self.pending = []


def _slice(ranges: list[int], a: int, b: int) -> list[int]:
    """The pairs covering bytes ``a`` to ``b`` of the text that ``ranges`` spell."""
    out: list[int] = []
    pos = 0
    for i in range(0, len(ranges), 2):
        s, ln = ranges[i], ranges[i + 1]
        lo, hi = max(a, pos), min(b, pos + ln)
        if lo < hi:
            out += [s + lo - pos, hi - lo]
        pos += ln
        if pos >= b:
            break
    return out


def _read_rope(path: str, ranges: list[int], files: dict[str, Any]) -> bytes:
    mm = files.get(path)
    if mm is None:
        mm = files[path] = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint8)
    out = b"".join(mm[ranges[i] : ranges[i] + ranges[i + 1]].tobytes() for i in range(0, len(ranges), 2))
    if len(out) != sum(ranges[1::2]):
        raise FileNotFoundError(f"bytes missing from {path} (cache changed underneath: delete the .polar-cache directory)")
    return out


def _rope_path(arena: str, column: str) -> str:
    return arena[: -len(".ids")] + f".{column}.bytes"


def _expand_ropes(column: str) -> Callable[[pl.Series], pl.Series]:
    def expand(s: pl.Series) -> pl.Series:
        arenas = s.struct.field("prompt_arena").to_list()
        ropes = s.struct.field(f"{column}_rope").to_list()
        stored = s.struct.field(column).to_list()
        files: dict[str, Any] = {}
        out = [v if r is None or a is None else _read_rope(_rope_path(a, column), r, files).decode()
               for a, r, v in zip(arenas, ropes, stored)]
        return pl.Series(column, out, dtype=pl.String)

    return expand


class _Arena:
    """The prompt ids of one session file, appended in row order: a prompt that starts with the
    previous row's whole prompt (the ``tip``) shares its ids and only appends the rest."""

    def __init__(self, path: Path, length: int = 0, tip: tuple[int, int] | None = None,
                 ropes: dict[str, "_Ropes"] | None = None):
        self.path = path
        self.ropes = ropes  # the request columns' byte files, beside it
        self.length = length  # ids already in the file (what the meta recorded)
        self.pending: list[np.ndarray] = []
        self.tip_start, self.tip = 0, np.zeros(0, np.int32)
        if tip is not None and tip[1] and path.exists():
            self.tip_start = tip[0]
            self.tip = np.fromfile(path, dtype=np.int32, count=tip[1], offset=4 * tip[0])

    def place(self, ids: np.ndarray) -> int:
        if ids.size == 0:
            return self.length
        n = self.tip.size
        if n and self.tip_start + n == self.length and ids.size >= n and np.array_equal(ids[:n], self.tip):
            start = self.tip_start
            self._append(ids[n:])
        else:
            start = self.length
            self._append(ids)
        self.tip_start, self.tip = start, ids
        return start

    def _append(self, ids: np.ndarray) -> None:
        if ids.size:
            self.pending.append(ids.astype(np.int32, copy=False))
            self.length += int(ids.size)

    def flush(self, base: int) -> None:
        """Write what was placed since ``base`` ids (the file is cut there first: a crash between
        an arena write and its part's meta leaves ids nobody refers to)."""
        with open(self.path, "r+b" if self.path.exists() else "wb") as fh:
            fh.truncate(4 * base)
            fh.seek(4 * base)
            for a in self.pending:
                fh.write(a.tobytes())
        self.pending = []

    @property
    def tip_meta(self) -> list[int]:
        return [self.tip_start, int(self.tip.size)]

    @classmethod
    def open(cls, cache_dir: Path, stem: str, meta: dict[str, Any] | None = None) -> "_Arena":
        """The arena (and request ropes) of one session file: as the meta left them, or new ones
        (new files, never the old ones cut: views of them may still be mapped; cutting: SIGBUS)."""
        if meta is None:
            for p in [cache_dir / f"{stem}.ids", *(cache_dir / f"{stem}.{c}.bytes" for c in ROPE_COLUMNS)]:
                p.unlink(missing_ok=True)
            return cls(cache_dir / f"{stem}.ids", ropes={c: _Ropes(cache_dir / f"{stem}.{c}.bytes") for c in ROPE_COLUMNS})
        ropes = {c: _Ropes(cache_dir / f"{stem}.{c}.bytes", *meta["ropes"][c]) for c in ROPE_COLUMNS}
        return cls(cache_dir / f"{stem}.ids", meta["arena"][0], tuple(meta["arena"][1]), ropes)

    def flush_all(self, meta: dict[str, Any] | None = None) -> None:
        self.flush(meta["arena"][0] if meta else 0)
        for c, r in (self.ropes or {}).items():
            r.flush(meta["ropes"][c][0] if meta else 0)

    def meta(self) -> dict[str, Any]:
        return {"arena": [self.length, self.tip_meta],
                "ropes": {c: [r.length, r.prev_ranges] for c, r in (self.ropes or {}).items()}}


def _convert_range(path: Path, start: int, stats: FileStats, expander: Expander | None = None,
                   arena: _Arena | None = None) -> tuple[pl.DataFrame, int]:
    """Parse complete lines of ``path`` from byte ``start``; returns (frame, new consumed offset).
    ``expander``: the records before ``start`` a delta may refer to (a fresh one from the start)."""
    expander = expander or Expander(arrays=True)
    with open(path, "rb") as fh:
        fh.seek(start)
        data = fh.read()
    end = data.rfind(b"\n") + 1  # only complete lines; a torn tail waits for the next scan
    stats.torn_tail = 1 if data[end:].strip() else 0
    rows: list[dict[str, Any]] = []
    line_no = _count_lines_before(path, start) if start else 0
    pos = 0
    while pos < end:
        nl = data.index(b"\n", pos)
        line_no += 1
        for row in _parse_line(data[pos:nl], stats, expander):
            row["source_file"] = str(path)
            row["source_line"] = line_no
            rows.append(row)
        pos = nl + 1
    if arena is None:
        return rows_to_frame(rows), start + end
    starts, counts = [], []
    for row in rows:
        ids = row["prompt_token_ids"]
        starts.append(arena.place(ids))
        counts.append(int(ids.size))
        row["prompt_token_ids"] = ids[:0]
    placed = {}
    for c, ropes in (arena.ropes or {}).items():
        placed[f"{c}_rope"] = pl.Series([ropes.place(row[c]) for row in rows], dtype=pl.List(pl.Int64))
        for row in rows:
            row[c] = None
    df = rows_to_frame(rows).with_columns(
        prompt_arena=pl.lit(arena.path.name, _STR),
        prompt_ids_start=pl.Series(starts, dtype=pl.Int64),
        n_prompt_ids=pl.Series(counts, dtype=pl.Int64),
        **placed,
    )
    return df, start + end


def _count_lines_before(path: Path, offset: int) -> int:
    n = 0
    with open(path, "rb") as fh:
        remaining = offset
        while remaining > 0:
            chunk = fh.read(min(remaining, 1 << 24))
            if not chunk:
                break
            n += chunk.count(b"\n")
            remaining -= len(chunk)
    return n


def _fingerprint(path: Path, consumed: int) -> str:
    """Hash of the first bytes already converted, plus the newline that ended the last line."""
    with open(path, "rb") as fh:
        head = fh.read(min(consumed, 4096))
        if consumed:
            fh.seek(consumed - 1)
            head += fh.read(1)
    return hashlib.sha1(head).hexdigest()


def _same_head(path: Path, consumed: int, expected: str) -> bool:
    return _fingerprint(path, consumed) == expected


def default_cache_dir(capture_dir: Path) -> Path:
    """``<capture_dir>/.polar-cache`` when writable, else a per-directory cache under POLAR_HOME."""
    local = capture_dir / CACHE_DIRNAME
    try:
        local.mkdir(parents=True, exist_ok=True)
        probe = local / ".probe"
        probe.touch()
        probe.unlink()
        return local
    except OSError:
        from polar_core.paths import polar_home

        digest = hashlib.sha1(str(capture_dir.resolve()).encode()).hexdigest()[:16]
        return polar_home() / "capture-cache" / digest


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _write_part(df: pl.DataFrame, path: Path) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    df.write_parquet(tmp, compression="zstd", compression_level=1, statistics=True)
    os.replace(tmp, path)


def sync_file(jsonl: Path, cache_dir: Path) -> tuple[list[Path], FileStats, str]:
    """Bring the Parquet parts of one JSONL file up to date. Returns (parts, stats, action)."""
    stem = jsonl.name[: -len(".jsonl")] if jsonl.name.endswith(".jsonl") else jsonl.name
    meta_path = cache_dir / f"{stem}.meta.json"
    st = jsonl.stat()
    meta: dict[str, Any] | None = None
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            meta = None
    if meta and meta.get("cache_version") == CACHE_VERSION and all((cache_dir / p).exists() for p in meta["parts"]):
        stats = FileStats(path=str(jsonl), **meta["stats"])
        if meta["size"] == st.st_size and meta["mtime_ns"] == st.st_mtime_ns:
            return [cache_dir / p for p in meta["parts"]], stats, "cached"
        if st.st_size >= meta["consumed"] and _same_head(jsonl, meta["consumed"], meta["head"]):
            arena = _Arena.open(cache_dir, stem, meta)
            df, consumed = _convert_range(jsonl, meta["consumed"], stats,
                                          _seeded_expander([cache_dir / p for p in meta["parts"]]), arena)
            parts = list(meta["parts"])
            if df.height:
                arena.flush_all(meta)
                part = f"{stem}.{len(parts):04d}.parquet"
                _write_part(df, cache_dir / part)
                parts.append(part)
            _save_meta(meta_path, jsonl, st, consumed, parts, stats, arena)
            return [cache_dir / p for p in parts], stats, "appended"
    # (re)convert from scratch
    if meta:
        for p in meta.get("parts", []):
            (cache_dir / p).unlink(missing_ok=True)
    stats = FileStats(path=str(jsonl))
    arena = _Arena.open(cache_dir, stem)
    df, consumed = _convert_range(jsonl, 0, stats, None, arena)
    arena.flush_all()
    part = f"{stem}.0000.parquet"
    _write_part(df, cache_dir / part)
    _save_meta(meta_path, jsonl, st, consumed, [part], stats, arena)
    return [cache_dir / part], stats, "converted"


def _seeded_expander(parts: list[Path]) -> Expander:
    """An expander that knows the last records already converted (the ones a delta appended since
    may refer to), read back from the cache's parts."""
    ex = Expander(arrays=True)
    if not parts:
        return ex
    lf = scan_parts(parts).with_row_index("_i")
    keys = lf.select(
        "_i", "session_id", writer=pl.col("extra_json").str.json_path_match(f"$.{WRITER_KEY}")
    ).collect()
    keep = keys.filter(
        pl.col("_i").rank("ordinal", descending=True).over(["session_id", "writer"]) <= READ_WINDOW
    )
    writers = dict(zip(keep["_i"].to_list(), keep["writer"].to_list()))
    cols = ["_i", "call_id", "session_id", "prompt_token_ids", "native_request", "normalized_request"]
    tail = lf.filter(pl.col("_i").is_in(list(writers))).select(cols).collect()
    for r in tail.iter_rows(named=True):
        ex.remember({
            "call_id": r["call_id"], "session_id": r["session_id"], "prompt_token_ids": r["prompt_token_ids"] or [],
            "native_request": decode_json(r["native_request"]), "normalized_request": decode_json(r["normalized_request"]),
        }, writers[r["_i"]])
    return ex


def _save_meta(meta_path: Path, jsonl: Path, st: os.stat_result, consumed: int, parts: list[str], stats: FileStats,
               arena: _Arena) -> None:
    meta = {
        "cache_version": CACHE_VERSION,
        **arena.meta(),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "consumed": consumed,
        "head": _fingerprint(jsonl, consumed),
        "parts": parts,
        "stats": {k: v for k, v in stats.__dict__.items() if k != "path"},
    }
    _atomic_write_bytes(meta_path, json.dumps(meta).encode())


def session_files(capture_dir: str | Path) -> list[Path]:
    d = Path(capture_dir)
    sub = d / SESSIONS_SUBDIR
    if sub.is_dir():
        return sorted(sub.glob("*.jsonl"))
    return sorted(d.glob("*.jsonl"))  # a bare directory of session files


def sync_capture(
    capture_dir: str | Path,
    cache_dir: str | Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Path], ScanReport]:
    """Convert what changed in a capture directory; returns the Parquet parts and a report."""
    capture_dir = Path(capture_dir)
    if not capture_dir.is_dir():
        raise FileNotFoundError(f"capture directory {capture_dir} does not exist")
    cache = Path(cache_dir) if cache_dir else default_cache_dir(capture_dir)
    cache.mkdir(parents=True, exist_ok=True)
    files = session_files(capture_dir)
    parts: list[Path] = []
    report = ScanReport()
    for i, f in enumerate(files):
        p, stats, action = sync_file(f, cache)
        parts.extend(p)
        report.files.append(stats)
        setattr(report, action, getattr(report, action) + 1)
        if progress:
            progress(i + 1, len(files))
    return parts, report


# ------------------------------------------------------------------------------------------------
# Frames
# ------------------------------------------------------------------------------------------------
def _with_derived(lf: pl.LazyFrame) -> pl.LazyFrame:
    names = lf.collect_schema().names()
    n_prompt = pl.col("n_prompt_ids") if "n_prompt_ids" in names else pl.col("prompt_token_ids").list.len()
    return lf.with_columns(
        n_prompt_ids=n_prompt.cast(pl.Int64),  # stored: counting must not expand the prompts
        n_sampled_ids=pl.col("sampled_token_ids").list.len().cast(pl.Int64),
        latency_s=pl.col("t_response_out") - pl.col("t_request_in"),
        ttfb_s=pl.col("t_upstream_first_byte") - pl.col("t_upstream_sent"),
        upstream_s=pl.col("t_upstream_end") - pl.col("t_upstream_sent"),
    )


def _arena_file(path: str, cache: dict[str, np.ndarray]) -> np.ndarray:
    arr = cache.get(path)
    if arr is None:
        arr = cache[path] = np.memmap(path, dtype=np.int32, mode="r") if os.path.getsize(path) else np.zeros(0, np.int32)
    return arr


def prompt_views(arenas: Iterable[str | None], starts: Iterable[int | None], counts: Iterable[int | None]) -> list[np.ndarray | None]:
    """Each row's prompt ids as a read-only view into its arena (memory-mapped: prompts sharing a
    prefix share its pages); None for a row without an arena."""
    files: dict[str, np.ndarray] = {}
    out: list[np.ndarray | None] = []
    for a, s, n in zip(arenas, starts, counts):
        if a is None or s is None:
            out.append(None)
        elif not n:
            out.append(np.zeros(0, np.int32))
        else:
            view = _arena_file(a, files)[s : s + n]
            if view.size != n:
                raise FileNotFoundError(f"prompt ids {s}..{s + n} missing from {a} (cache changed underneath: "
                                        "delete the .polar-cache directory)")
            out.append(view)
    return out


def _expand_prompts(s: pl.Series) -> pl.Series:
    """The ``prompt_token_ids`` column, built from the arena only for the rows a query reaches."""
    views = prompt_views(s.struct.field("prompt_arena").to_list(), s.struct.field("prompt_ids_start").to_list(),
                         s.struct.field("n_prompt_ids").to_list())
    stored = s.struct.field("prompt_token_ids")
    if any(v is None for v in views):
        views = [np.asarray(stored[i], dtype=np.int32) if v is None else v for i, v in enumerate(views)]
    lengths = np.fromiter((v.size for v in views), dtype=np.int64, count=len(views))
    offsets = np.zeros(len(views) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(views).astype(np.int32, copy=False) if views else np.zeros(0, np.int32)
    arr = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
    return pl.Series("prompt_token_ids", arr).cast(pl.List(pl.Int32))


def scan_parts(parts: Iterable[str | Path]) -> pl.LazyFrame:
    parts = [Path(p) for p in parts]
    if not parts:
        return empty_calls().lazy()
    lf = pl.scan_parquet([str(p) for p in parts], schema=PART_SCHEMA, missing_columns="insert", extra_columns="ignore")
    # the arena's path from where the parts are now (a moved capture directory keeps its cache)
    lf = lf.with_columns(prompt_arena=pl.lit(str(parts[0].parent) + os.sep) + pl.col("prompt_arena"))
    return lf.with_columns(
        prompt_token_ids=pl.struct("prompt_arena", "prompt_ids_start", "n_prompt_ids", "prompt_token_ids")
        .map_batches(_expand_prompts, return_dtype=pl.List(pl.Int32), is_elementwise=True),
        **{c: pl.struct("prompt_arena", f"{c}_rope", c).map_batches(_expand_ropes(c), return_dtype=pl.String,
                                                                     is_elementwise=True) for c in ROPE_COLUMNS},
    )


def calls(
    capture_dir: str | Path,
    *,
    cache_dir: str | Path | None = None,
    rewards: str | Path | pl.LazyFrame | None = "auto",
    report: ScanReport | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> pl.LazyFrame:
    """The calls frame of a capture directory (lazy), in file order (one file per session, each
    in call order); sort explicitly when needed, so that sinking to Parquet can stream.

    ``rewards="auto"`` joins ``<capture_dir>/rollouts.parquet`` when it exists (columns ``reward``
    and ``rollout_status``); pass a path / LazyFrame to use another source, or None for none.
    """
    parts, rep = sync_capture(capture_dir, cache_dir, progress)
    if report is not None:
        report.files, report.converted, report.appended, report.cached = rep.files, rep.converted, rep.appended, rep.cached
    lf = _with_derived(scan_parts(parts))
    return attach_session_rewards(lf, capture_dir, rewards)


def session_calls(capture_dir: str | Path, session_id: str, *, cache_dir: str | Path | None = None) -> pl.LazyFrame:
    """The calls of one session (its capture file alone, converted if it changed), without rewards:
    what a node of the Ray placement hands over per finished sample. :func:`calls` would re-check
    every session file of the directory: on a node that has run n samples, n times the work."""
    capture_dir = Path(capture_dir)
    path = capture_dir / SESSIONS_SUBDIR / f"{session_id}.jsonl"
    if not path.is_file():
        return empty_calls().lazy()
    cache = Path(cache_dir) if cache_dir else default_cache_dir(capture_dir)
    cache.mkdir(parents=True, exist_ok=True)
    parts, _, _ = sync_file(path, cache)
    return attach_session_rewards(_with_derived(scan_parts(parts)), None, None)


def attach_session_rewards(lf: pl.LazyFrame, capture_dir: str | Path | None, rewards: Any) -> pl.LazyFrame:
    from polar_analysis import rewards as rw

    source = rewards
    if isinstance(rewards, str) and rewards == "auto":
        source = rw.default_rewards_path(capture_dir) if capture_dir else None
    if source is None:
        return lf.with_columns(reward=pl.lit(None, pl.Float64), rollout_status=pl.lit(None, pl.String))
    table = source if isinstance(source, pl.LazyFrame) else rw.load_rewards(source)
    table = table.select("session_id", "reward", pl.col("status").alias("rollout_status"))
    return lf.join(table, on="session_id", how="left", maintain_order="left")


def sessions(calls_lf: pl.LazyFrame) -> pl.LazyFrame:
    """One row per session: ids, harness/provider, call and token counts, errors, time span, reward."""
    agg = [
        pl.col("task_id").drop_nulls().first().alias("task_id"),
        pl.col("group_id").drop_nulls().first().alias("group_id"),
        pl.col("sample_index").drop_nulls().first().alias("sample_index"),
        pl.col("harness").filter(pl.col("harness") != "").first().alias("harness"),
        pl.col("provider").unique().sort().str.join(",").alias("providers"),
        pl.col("served_model").filter(pl.col("served_model") != "").first().alias("served_model"),
        pl.len().alias("n_calls"),
        (pl.col("status") == "ok").sum().alias("n_ok"),
        (pl.col("status") != "ok").sum().alias("n_error"),
        (pl.col("finish_reason") == "length").sum().alias("n_length"),
        pl.col("n_prompt_ids").sum().alias("prompt_ids"),
        pl.col("n_sampled_ids").sum().alias("sampled_ids"),
        pl.col("n_prompt_ids").max().alias("max_prompt_ids"),
        pl.col("t_request_in").min().alias("t_start"),
        pl.col("t_response_out").max().alias("t_end"),
        pl.col("policy_version").min().alias("min_policy_version"),
        pl.col("policy_version").max().alias("max_policy_version"),
    ]
    names = calls_lf.collect_schema().names()
    if "reward" in names:
        agg += [pl.col("reward").first().alias("reward"), pl.col("rollout_status").first().alias("rollout_status")]
    return (
        calls_lf.group_by("session_id", maintain_order=True)
        .agg(agg)
        .with_columns(duration_s=pl.col("t_end") - pl.col("t_start"))
    )


def tokens(calls_lf: pl.LazyFrame, which: str = "sampled") -> pl.LazyFrame:
    """One row per token of every call (``which`` = "sampled" with logprobs, or "prompt")."""
    keys = ["session_id", "call_id", "call_index"]
    if which == "sampled":
        lf = calls_lf.select(*keys, token_id=pl.col("sampled_token_ids"), logprob=pl.col("sampled_logprobs"))
        lf = lf.with_columns(
            logprob=pl.when(pl.col("logprob").list.len() == pl.col("token_id").list.len())
            .then(pl.col("logprob"))
            .otherwise(pl.col("token_id").list.eval(pl.lit(None, pl.Float64)))
        )
        cols = ["token_id", "logprob"]
    elif which == "prompt":
        lf = calls_lf.select(*keys, token_id=pl.col("prompt_token_ids"))
        cols = ["token_id"]
    else:
        raise ValueError("which must be 'sampled' or 'prompt'")
    lf = lf.with_columns(position=pl.int_ranges(0, pl.col("token_id").list.len(), dtype=pl.Int32))
    return lf.explode([*cols, "position"]).drop_nulls("token_id")


# ------------------------------------------------------------------------------------------------
# mitmproxy flow files
# ------------------------------------------------------------------------------------------------
def _json_body(message: Any) -> Any:
    if message is None or not message.raw_content:
        return None
    try:
        return json.loads(message.get_text(strict=False) or "")
    except (ValueError, TypeError):
        return None


#: flow.metadata["polar"] keys written by the proxy that are not CallRecord field names.
_FLOW_META_ALIASES = {"session": "session_id", "sampled_tokens": "completion_tokens"}


#: ``(provider, native body, path, query) -> normalized chat request`` (None when impossible): the
#: proxy's translators, ``polar_proxy.providers.chat_request_of``. The analysis does not import the
#: proxy; whoever wires the two (the ``polar`` CLI, a notebook) passes it in.
Translate = Callable[[str, Any, str, dict[str, str]], dict[str, Any] | None]


def flow_to_record(flow: Any, translate: Translate | None = None) -> dict[str, Any] | None:
    """A CallRecord-like dict from one saved HTTP flow, or None when it is not an annotated model call.

    The proxy annotates each model call in ``flow.metadata["polar"]`` (session, provider,
    call_index, call_id, finish_reason, status, error_kind, upstream, policy_version, token
    counts); a full record under ``"record"`` or token id lists there are used as they are. The rest
    comes from the flow: the request body is the native request (and, run through the proxy's
    translator ``translate``, the normalized request), path, user agent and timestamps from request/response.
    Flows saved since the proxy keeps token ids and logprobs in the metadata (``polar_core.flowmeta``)
    carry them; for older ones join them from the capture directory by call_id (``fill_from_capture``).
    """
    meta = getattr(flow, "metadata", None) or {}
    polar = meta.get("polar")
    if not isinstance(polar, dict) or not (polar.get("session") or polar.get("session_id") or polar.get("record")):
        return None
    data: dict[str, Any] = dict(polar.get("record") or {})
    for k, v in (unpack_tokens(polar) or {}).items():  # the ids and logprobs the proxy kept in the flow
        data.setdefault(k, v)
    for k, v in polar.items():
        k = _FLOW_META_ALIASES.get(k, k)
        if k in _DEFAULTS and k not in data and v is not None:
            data[k] = v
    req, resp = flow.request, getattr(flow, "response", None)
    native = _json_body(req)
    path = req.path.split("?", 1)[0]
    data.setdefault("native_request", native)
    data.setdefault("native_path", path)
    data.setdefault("user_agent", req.headers.get("user-agent", ""))
    if "harness" not in data:
        data["harness"] = harness_name(req.headers)
    if "normalized_request" not in data and data.get("provider") and translate is not None:
        data["normalized_request"] = translate(data["provider"], native, path, dict(req.query))
    data.setdefault("t_request_in", req.timestamp_end or req.timestamp_start)
    data.setdefault("call_id", flow.id.replace("-", ""))
    if resp is not None:
        data.setdefault("http_status", resp.status_code)
        data.setdefault("t_response_out", resp.timestamp_end)
    if getattr(flow, "error", None) is not None and "status" not in data:
        data["status"] = "error"
        data.setdefault("error", flow.error.msg)
    elif resp is not None and resp.status_code >= 400 and "status" not in data:
        data["status"] = "error"
    return data


#: Columns a capture directory contributes to flow rows (by call_id).
CAPTURE_FILL = ("prompt_token_ids", "sampled_token_ids", "sampled_logprobs", "output_text", "output_reasoning",
                "output_tool_calls", "normalized_request", "served_model", "requested_model", "task_id", "group_id",
                "sample_index", "t_upstream_sent", "t_upstream_first_byte", "t_upstream_end", "sampling")


def fill_from_capture(flows: pl.DataFrame, calls_lf: pl.LazyFrame) -> pl.DataFrame:
    """Complete flow rows with what only the capture records hold (token ids first), by call_id."""
    cap = calls_lf.select("call_id", *[pl.col(c).alias(f"_cap_{c}") for c in CAPTURE_FILL]).collect()
    out = flows.join(cap, on="call_id", how="left", maintain_order="left")
    fills = []
    for c in CAPTURE_FILL:
        cap_c = pl.col(f"_cap_{c}")
        if c in ("prompt_token_ids", "sampled_token_ids", "sampled_logprobs"):
            fills.append(pl.when(pl.col(c).list.len() == 0).then(cap_c.fill_null(pl.col(c))).otherwise(pl.col(c)).alias(c))
        elif c == "normalized_request":
            fills.append(pl.coalesce(cap_c, pl.col(c)).alias(c))  # what was really sent wins
        elif CALL_SCHEMA[c] == _STR:
            fills.append(pl.when(pl.col(c).is_null() | (pl.col(c) == "")).then(cap_c).otherwise(pl.col(c)).alias(c))
        else:
            fills.append(pl.coalesce(pl.col(c), cap_c).alias(c))
    return out.with_columns(fills).select(list(CALL_SCHEMA))


def flows_calls(path: str | Path, *, stats: FileStats | None = None, translate: Translate | None = None) -> pl.DataFrame:
    """The calls frame rows of a saved mitmproxy flow file (``mitmdump -w FILE``); ``translate``
    rebuilds the normalized request of flows whose metadata does not carry one."""
    from mitmproxy import http, io

    stats = stats or FileStats(path=str(path))
    rows = []
    with open(path, "rb") as fh:
        for i, flow in enumerate(io.FlowReader(fh).stream()):
            if not isinstance(flow, http.HTTPFlow):
                continue
            data = flow_to_record(flow, translate)
            if data is None:
                stats.other_records += 1
                continue
            try:
                row = normalize_record(data)
            except InvalidRecord as exc:
                stats.invalid += 1
                if len(stats.errors) < 5:
                    stats.errors.append(str(exc))
                continue
            row["source_file"], row["source_line"] = str(path), i + 1
            stats.records += 1
            rows.append(row)
    return rows_to_frame(rows)


def load(source: str | Path, *, translate: Translate | None = None, **kwargs: Any) -> pl.LazyFrame:
    """Calls frame of a capture directory, a flow file (``translate``: see ``flows_calls``), a calls
    Parquet file or a JSONL file."""
    p = Path(source)
    if p.is_dir():
        return calls(p, **kwargs)
    if p.suffix == ".parquet":
        return pl.scan_parquet(p)
    if p.suffix == ".jsonl":
        df, _ = _convert_range(p, 0, FileStats(path=str(p)))
        return _with_derived(df.lazy())
    return _with_derived(flows_calls(p, translate=translate).lazy())


def decode_json(value: str | None) -> Any:
    """A JSON column value back to Python (None stays None)."""
    return None if value is None else orjson.loads(value)
