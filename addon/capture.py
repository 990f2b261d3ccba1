"""Crash-safe, append-only capture writer: one CallRecord per line, one ``os.write`` per record.

Why this shape: a harness may be killed, the proxy may crash, and several proxy processes may
share one capture directory. Each record is serialized first (orjson, cheap on the event loop),
then handed to the kernel in a single ``write`` on an ``O_APPEND`` descriptor, so concurrent
writers never interleave inside a line and a crash leaves at most one torn last line (which
loaders skip). No fsync per call unless asked (``fsync=True``): it costs milliseconds per call.

A record that shares its prompt's prefix with one of the session's last records is written as a
delta against it (``polar_core.capture_delta``, schema version 3): the new prompt ids and what is
new in its requests. A session then grows with its length, not its square (a 200-call session
with prompts growing to 30k ids: see ``benchmarks/bench_capture_growth.py``). Only a record whose
write completed can be referred to, so a torn write still loses that record alone.
"""

from __future__ import annotations

import errno
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import orjson

from polar_proxy import jsonutil

from polar_core.capture_delta import SessionDeltas
from polar_core.schema import CALL_FIELDS, SESSIONS_SUBDIR, CallRecord, valid_session_id

_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


class CaptureError(Exception):
    pass


def _default(obj: Any) -> Any:
    """orjson fallback for odd values that slipped into a request (bytes, sets, ...)."""
    if isinstance(obj, (bytes, bytearray)):
        return obj.decode("utf-8", "replace")
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def encode_record(record: CallRecord | dict[str, Any]) -> bytes:
    """One JSON line. orjson serializes the dataclass natively: ``asdict`` would deep-copy every
    token list first (50x slower on a long call)."""
    return jsonutil.dumps(record, default=_default, option=orjson.OPT_NON_STR_KEYS) + b"\n"


def _dumps(value: Any) -> bytes:
    try:  # orjson straight (the wrapper's hooks doubled the digest's cost); odd values below
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return jsonutil.dumps(value, default=_default, option=orjson.OPT_NON_STR_KEYS)


def _plain(value: Any) -> Any:
    """A RawJSON request (the harness's body, the body sent upstream) as parsed objects, for its
    digests: the proxy's own parse when it kept it (``RawJSON.parsed``), else parsed here."""
    if isinstance(value, jsonutil.RawJSON):
        return value.parsed if value.parsed is not None else value.value()
    return value


class CaptureWriter:
    """Appends records to ``<capture_dir>/sessions/<session_id>.jsonl``.

    Keeps a bounded LRU of open descriptors (sessions are many, descriptors are few).
    """

    def __init__(self, capture_dir: str | os.PathLike[str], *, fsync: bool = False, max_open: int = 128,
                 delta: bool = True):
        self.root = Path(capture_dir).resolve()
        #: None: every record in full (schema version 2's layout)
        self.deltas = SessionDeltas(dumps=_dumps, fragment=jsonutil.RawJSON, parsed=_plain) if delta else None
        self.dir = self.root / SESSIONS_SUBDIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.max_open = max_open
        self._fds: OrderedDict[str, int] = OrderedDict()
        self.records = 0
        self.bytes = 0
        #: records whose write failed (the proxy's status counts them as ``capture_errors``)
        self.failed = 0
        #: sessions whose last write failed: their next record starts on a fresh line, in full
        self._torn: set[str] = set()

    def path_for(self, session_id: str) -> Path:
        """The session's file; refuses anything that could leave the sessions directory."""
        if not valid_session_id(session_id):
            raise CaptureError(f"invalid session id {session_id!r}")
        path = self.dir / f"{session_id}.jsonl"
        if path.parent != self.dir:  # belt and braces: the regex already forbids separators
            raise CaptureError(f"session id {session_id!r} escapes the capture directory")
        return path

    def _fd(self, session_id: str) -> int:
        fd = self._fds.get(session_id)
        if fd is not None:
            self._fds.move_to_end(session_id)
            return fd
        fd = os.open(self.path_for(session_id), _FLAGS, 0o644)
        self._fds[session_id] = fd
        while len(self._fds) > self.max_open:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def write(self, record: CallRecord) -> int:
        """Append one record; returns the bytes written. Raises CaptureError on failure."""
        kept = None
        if self.deltas is None:
            line = encode_record(record)
        else:
            rec = {f: getattr(record, f) for f in CALL_FIELDS}
            out, kept = self.deltas.encode(rec)
            line = encode_record(record if out is rec else out)
        sid = record.session_id
        fd = self._fd(sid)
        if sid in self._torn:
            # the last write of this session failed and may have left a line without its end: start
            # on a fresh line (a blank line is skipped by every reader)
            line = b"\n" + line
        counted = False
        try:
            n = os.write(fd, line)
            if n != len(line):
                # A short write (disk full): terminate the torn line so the next record starts clean.
                self._failed(sid)
                counted = True
                try:
                    os.write(fd, b"\n")
                    self._torn.discard(sid)
                except OSError:
                    pass  # still torn: the next record starts with the newline
                raise CaptureError(f"short write ({n} of {len(line)} bytes) for session {sid}")
            if self.fsync:
                os.fsync(fd)
        except OSError as exc:
            if not counted:
                self._failed(sid)
            if exc.errno == errno.EBADF:
                self._fds.pop(sid, None)
            raise CaptureError(f"cannot write capture for {sid}: {exc}") from exc
        self._torn.discard(sid)
        self.records += 1
        self.bytes += n
        if self.deltas is not None:
            # only now may a later record refer to this one: a failed write is never a reference
            self.deltas.remember(sid, kept)
        return n

    def _failed(self, session_id: str) -> None:
        """A write of this session failed (disk full, I/O error): what reached the file is unknown,
        so the session's next record is written self-contained (no reference to any earlier one:
        a reader that lost a line around the failure still reads every later record) and starts on
        a fresh line."""
        self.failed += 1
        self._torn.add(session_id)
        if self.deltas is not None:
            self.deltas.forget(session_id)

    def existing_calls(self, session_id: str) -> int:
        """Complete lines already in the session's file: where call indexes resume after a restart."""
        try:
            path = self.path_for(session_id)
            with open(path, "rb") as f:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        except (FileNotFoundError, CaptureError):
            return 0

    def close(self) -> None:
        while self._fds:
            _, fd = self._fds.popitem()
            try:
                os.close(fd)
            except OSError:
                pass
