"""Why a verdict failed, in words a log reader can act on: the failing tests' names and messages
from the verifier's CTRF report, else the end of what the verifier printed.

A failed verdict used to say only "1 failed, 5 passed" (or "scored 0"). Terminal-Bench's
``test.sh`` runs ``pytest --ctrf /logs/verifier/ctrf.json``, a report of every test with its
status and failure message (https://ctrf.io: ``results.tests[].name/status/message/trace``). So:

* :func:`failure_notes` (called by ``verifier.verify`` on a reward below 1) reads ``ctrf.json``
  through ``hostfs.read_bytes`` (no link followed, no FIFO opened, at most 4 MiB: the verifier dir
  is writable by the sample's programs, which the tests run) and names each failed test with the
  first lines of its message; with no report, it takes the last lines of the verifier's output;
* the notes go into the sample's record (``sandbox_notes`` of rollouts.parquet, as ``verifier:
  failed test ...``), and :func:`from_notes` reads them back for ``polar tasks check``'s row.
"""

from __future__ import annotations

import json
from pathlib import Path

CTRF_NAME = "ctrf.json"
CTRF_LIMIT = 4 * 2**20
FAILED = "failed test: "
TAIL = "verifier output ends: "
MAX_TESTS = 8
MESSAGE_CHARS = 300
TAIL_LINES = 6
TAIL_CHARS = 600


def _one_line(text: str, limit: int) -> str:
    """The first lines of ``text`` joined by `` | ``, whitespace squeezed, at most ``limit`` chars."""
    lines = [" ".join(ln.split()) for ln in text.splitlines() if ln.strip()]
    out = " | ".join(lines)
    return out if len(out) <= limit else out[:limit - 3] + "..."


def ctrf_failures(verifier_dir: Path) -> tuple[list[tuple[str, str]] | None, str]:
    """((name, message) of every failed test, or None when there is no readable report; a problem
    reading it, or "")."""
    from polar_trial.sandbox.hostfs import UnsafePath, read_bytes

    try:
        raw = read_bytes(verifier_dir, verifier_dir / CTRF_NAME, limit=CTRF_LIMIT + 1)
    except FileNotFoundError:
        return None, ""
    except UnsafePath as exc:
        return None, f"{CTRF_NAME} refused, not read: {exc}"
    except OSError as exc:
        return None, f"{CTRF_NAME} not read: {exc}"
    if len(raw) > CTRF_LIMIT:
        return None, f"{CTRF_NAME} is over {CTRF_LIMIT // 2**20} MiB: not read"
    try:
        tests = json.loads(raw)["results"]["tests"]
        if not isinstance(tests, list):
            raise TypeError("results.tests is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"{CTRF_NAME} is not a CTRF report: {type(exc).__name__}: {exc}"
    out = []
    for t in tests:
        if isinstance(t, dict) and str(t.get("status", "")).lower() in ("failed", "error"):
            msg = t.get("message") or t.get("trace") or ""
            out.append((str(t.get("name") or "?"), msg if isinstance(msg, str) else json.dumps(msg)))
    return out, ""


def failure_notes(verifier_dir: Path, output: str) -> list[str]:
    """Notes that say why a verdict failed: ``failed test: NAME: MESSAGE`` per failed test of the
    CTRF report (at most ``MAX_TESTS``, then a count), else ``verifier output ends: ...``."""
    failed, problem = ctrf_failures(verifier_dir)
    notes = [problem] if problem else []
    if failed:
        for name, msg in failed[:MAX_TESTS]:
            notes.append(f"{FAILED}{name}" + (f": {_one_line(msg, MESSAGE_CHARS)}" if msg.strip() else ""))
        if len(failed) > MAX_TESTS:
            notes.append(f"{FAILED}... and {len(failed) - MAX_TESTS} more (in {CTRF_NAME})")
        return notes
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith("[polar]")]
    if lines:
        tail = " | ".join(" ".join(ln.split()) for ln in lines[-TAIL_LINES:])
        notes.append(TAIL + (tail if len(tail) <= TAIL_CHARS else "..." + tail[-(TAIL_CHARS - 3):]))
    return notes


def from_notes(sandbox_notes: str | None) -> list[str]:
    """The failure notes of a rollout row's ``sandbox_notes`` (``verifier:`` prefix dropped)."""
    out = []
    for line in (sandbox_notes or "").splitlines():
        line = line.removeprefix("verifier: ")
        if line.startswith((FAILED, TAIL)) or line.startswith(CTRF_NAME):
            out.append(line)
    return out
