"""The harness's HOME on a container backend: copied into the image user's own HOME, read back
through ``safetar``; never the host's directory bound in (docker and podman, per-phase containers
and the live trial alike; bubblewrap binds the host HOME as before, apptainer too).

Before, the sample's host HOME (where ``harnesses.py`` wrote the preset's config) was bound
read-write into the task's image at its host path, with ``CODEX_HOME``, ``OPENCODE_CONFIG`` and the
XDG dirs pointing there: a harness never saw the image user's HOME, a task whose Dockerfile runs as
a user with a HOME of its own had the harness's files owned by the host's uid, and whatever the
sample left in that host directory (a link to a host file, a FIFO) was one host ``open`` away.

Now (``SandboxSpec.home_copy``):

* in: the host HOME is bound *read-only* at a staging path only the container's init sees
  (:data:`STAGE` in a per-phase container; the trial's ``/run/polar-trial/x/N``, covered in the
  agent's mount namespace); the init reads it as root and writes it into the passwd HOME of the
  phase's user *as that user* (``_homeinit.py``: owned by the user, no link followed), and moves
  every environment value and argument under the host HOME there;
* out: after the phase, the entries the preset had put at the top of HOME (``.codex``, ``.pi``,
  ``.config``, ...) are copied back into the host HOME by ``docker cp ... -`` streamed into
  :func:`safetar.extract`: links only where they stay inside (one to a host file is dropped), no
  FIFO or device, at most :data:`READ_BACK_LIMIT` bytes. That is how a follow-up turn in a fresh
  per-phase container finds its harness's sessions (Codex's ``exec resume --last``, Pi's and
  Claude Code's ``--continue``), and how the run dir keeps them; in a live trial the environment
  keeps them itself between turns, and the copy is the run dir's.

Cost, measured on the 2-core machine at load ~9 (a private dockerd with ``--userns-remap``): a
read-back of two names holding 201 files, 2 MB (a Codex HOME after a run is about that) takes
0.22 s per phase (0.65 s the first time); the copy in is a few KiB read and written by the init.
A ``docker cp`` per name, not one of the whole HOME: an image user's HOME may hold anything of
the task's (a conda install in ``/root``), and only the harness's entries are ours to keep.
"""

from __future__ import annotations

import os
import posixpath
import subprocess
import tarfile
import tempfile
import threading
from pathlib import Path

from polar_trial.sandbox.hostfs import _open_dir
from polar_trial.sandbox.safetar import UnsafeArchive, extract

#: where a per-phase container's init finds the host HOME (read-only; never the phase's HOME)
STAGE = "/run/polar-copy/home"
#: what a read-back may bring to the host in all (Codex's HOME after a run: ~2 MB of skills and sessions)
READ_BACK_LIMIT = 256 << 20
#: the longest one name's copy out of the container may take before it is killed (seconds)
READ_BACK_TIMEOUT_S = 60.0


#: read back although no preset writes there: OpenCode keeps its sessions (``run --continue``) in a
#: SQLite database under ``XDG_DATA_HOME/opencode`` (600 KB after a short run), not in its config dir
HARNESS_DATA = (".local/share/opencode",)


def top_names(host_home: Path) -> list[str]:
    """The directories and files at the top of the host HOME (what the preset wrote there), and
    :data:`HARNESS_DATA`: the only names read back."""
    with os.scandir(host_home) as it:
        top = [e.name for e in it if not e.is_symlink() and (e.is_dir(follow_symlinks=False)
                                                            or e.is_file(follow_symlinks=False))]
    return sorted(top) + [n for n in HARNESS_DATA if n.split("/")[0] not in top]


def init_config(host_home: Path, src: str) -> dict:
    """What the container's init is told (``_homeinit.py``): where to read, which prefix moves."""
    return {"src": src, "prefix": str(host_home)}


def inside_home(value: object) -> str | None:
    """The HOME an init reported, if it is one (absolute, normalized, not ``/``); else None."""
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value or len(value) > 4096:
        return None
    norm = posixpath.normpath(value)
    return norm if norm not in ("/", "//") and norm == value.rstrip("/") else None


def read_back(runtime: str, container: str, home: str, host_home: Path, names: list[str],
              limit: int = READ_BACK_LIMIT) -> list[str]:
    """``home/<name>`` of each name copied out of ``container`` (running or exited) into
    ``host_home``; notes for the sample (what was left out, what stopped a copy)."""
    notes: list[str] = []
    budget = limit
    for name in names:
        parent = posixpath.dirname(name)
        if parent:  # made on the host without following a link (a read-back keeps links inside the tree)
            try:
                os.close(_open_dir(host_home, parent.split("/"), create=True))
            except OSError as exc:
                notes.append(f"HOME read-back of {name} skipped: {exc}")
                continue
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([runtime, "cp", f"{container}:{home}/{name}", "-"], stdout=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, stderr=err)
            got = None
            # a daemon that stops answering must not hold the sample: the copy is killed after
            # READ_BACK_TIMEOUT_S (a 2 MB HOME takes 0.2-0.7 s)
            fired = threading.Event()
            watchdog = threading.Timer(READ_BACK_TIMEOUT_S, lambda: (fired.set(), proc.kill()))
            watchdog.start()
            try:
                with tarfile.open(fileobj=proc.stdout, mode="r|") as tf:
                    got = extract(tf, host_home / parent, symlinks="inside", max_bytes=budget)
                while proc.stdout.read(1 << 16):  # type: ignore[union-attr] - the end padding
                    pass
            except (tarfile.TarError, UnsafeArchive, OSError) as exc:
                proc.kill()
                problem = str(exc)
            else:
                problem = ""
            finally:
                proc.stdout.close()  # type: ignore[union-attr]
                rc = proc.wait()
                watchdog.cancel()
            err.seek(0)
            why = err.read()[-300:].decode(errors="replace").strip()
            if fired.is_set():
                problem = f"timed out: `{runtime} cp` killed after {READ_BACK_TIMEOUT_S:g} s" + (f" ({problem})" if problem else "")
                got = None  # what came before the kill may be partial: said, not counted as read back
        if got is not None:
            budget -= got.bytes
            notes += [f"HOME read-back of {name}: {n}" for n in got.notes()]
        elif rc != 0 and ("Could not find" in why or "No such" in why):
            continue  # the harness removed it: nothing to keep
        else:
            notes.append(f"HOME read-back of {name} stopped: {problem or why or f'exit {rc}'}")
    return notes


def home_notes(runtime: str, container: str, reported: object, host_home: Path, names: list[str],
               user: str | None = None) -> list[str]:
    """After a phase: the harness's HOME read back from where the init said it copied it, and
    the sample's notes saying so."""
    home = inside_home(reported)
    if home is None:
        return ["the harness's HOME not read back: the phase's init reported none"]
    who = f"user {user}'s" if user else "the phase user's"
    return [f"HOME: the harness's config copied into {home} ({who} passwd HOME), not bound from the host",
            *read_back(runtime, container, home, host_home, names)]
