"""Every read ``polar view`` makes of a run directory, through the sandbox's safe reader.

A run directory holds what samples wrote (``captures/work/<session>/``: the harness's logs, the
work dir the verifier graded) next to what Polar wrote; a sample can plant a symbolic link to
``/root/.ssh/id_rsa`` or a FIFO there, or a file of many gigabytes. So the viewer never calls
``open(path)``: every file is opened by :func:`polar_trial.sandbox.hostfs.open_under` (walked
from the run directory one component at a time with ``O_NOFOLLOW``, regular files only) and read
up to a cap per kind of file; listings skip links and special files. ``--serve`` answers from
the same reader, so the server reads nothing outside the run directory whatever a URL says.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import Any, Iterator

import orjson

from polar_trial import hostfs

#: caps per kind of file (bytes): JSON reports and Parquet tables Polar wrote; a capture file (a
#: session's JSONL, ~0.5 MB for a 34-call Pi session); a sample's own logs (only their end is shown)
JSON_CAP = 64 << 20
PARQUET_CAP = 1 << 30
CAPTURE_CAP = 1 << 30
LOG_CAP = 64 << 10


class RunFiles:
    """Read-only, link-refusing access to the files under one run directory."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(os.path.abspath(root))
        if not self.root.is_dir():
            raise FileNotFoundError(f"{root}: not a directory")

    def path(self, rel: str) -> Path:
        return self.root / rel

    def is_file(self, rel: str) -> bool:
        try:
            os.close(hostfs.open_under(self.root, self.root / rel))
            return True
        except OSError:
            return False

    def read(self, rel: str, limit: int = JSON_CAP) -> bytes:
        """At most ``limit`` bytes of ``rel`` (raises OSError: missing, a link, not a regular file)."""
        return hostfs.read_bytes(self.root, self.root / rel, limit)

    def read_tail(self, rel: str, limit: int = LOG_CAP) -> tuple[bytes, int]:
        """The last ``limit`` bytes of ``rel`` and the file's size."""
        fd = hostfs.open_under(self.root, self.root / rel)
        with os.fdopen(fd, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - limit))
            return fh.read(limit), size

    def open(self, rel: str) -> io.BufferedReader:
        """A binary file object of ``rel`` (for streaming readers: flows, captures)."""
        return os.fdopen(hostfs.open_under(self.root, self.root / rel), "rb")

    def json(self, rel: str, default: Any = None) -> Any:
        try:
            return orjson.loads(self.read(rel))
        except (OSError, orjson.JSONDecodeError):
            return default

    def jsonl(self, rel: str) -> list[dict[str, Any]]:
        try:
            data = self.read(rel)
        except OSError:
            return []
        out = []
        for line in data.splitlines():
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a torn last line of a file being written
            if isinstance(obj, dict):
                out.append(obj)
        return out

    def parquet(self, rel: str, columns: list[str] | None = None) -> Any:
        """A Polars frame of ``rel`` (None when it cannot be read)."""
        import polars as pl

        try:
            data = self.read(rel, PARQUET_CAP)
        except OSError:
            return None
        try:
            return pl.read_parquet(io.BytesIO(data), columns=columns)
        except Exception:  # noqa: BLE001 - a file being written, or not Parquet: shown as absent
            return None

    def capture_records(self, rel: str) -> Iterator[dict[str, Any]]:
        """The capture records of one session file, deltas expanded (``read_capture_lines``)."""
        from polar_core.schema import read_capture_lines

        try:
            fd = hostfs.open_under(self.root, self.root / rel)
        except OSError:
            return iter(())
        return read_capture_lines(fd)  # open() of an fd: the no-follow one, closed when read

    def listdir(self, rel: str, suffix: str = "") -> list[str]:
        """Names of the regular files directly under ``rel`` (links and special files left out)."""
        try:
            fd = hostfs._open_dir(self.root, [p for p in Path(rel).parts if p not in ("", ".")])
        except OSError:
            return []
        try:
            names = []
            for name in os.listdir(fd):
                if not name.endswith(suffix):
                    continue
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    names.append(name)
            return sorted(names)
        finally:
            os.close(fd)

    def signature(self, rels: list[str]) -> tuple[Any, ...]:
        """Sizes and modification times of ``rels`` (files or directories, not followed): what
        ``--serve`` compares to know that a running loop wrote something new."""
        sig = []
        for rel in rels:
            try:
                st = os.stat(self.root / rel, follow_symlinks=False)
                sig.append((rel, st.st_size, st.st_mtime_ns))
            except OSError:
                sig.append((rel, None, None))
        return tuple(sig)
