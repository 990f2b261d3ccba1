"""The host side of a phase's stdout/stderr (``supervise`` and its ``_BoundedOutput`` pumps), and
the signal disposition the in-sandbox init hands the phase. Fast, no sandbox needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from polar_trial.sandbox import base
from polar_trial.sandbox.base import supervise

INIT = Path(base.__file__).with_name("_init.py")


def test_one_file_for_stdout_and_stderr_gets_both(tmp_path):
    """stdout=fh, stderr=fh (the verifier's call): one pipe. A second pump used to write stderr to
    the first pipe's closed write end (EBADF), close its read end, and the phase's next write to
    stderr died of SIGPIPE: the docker CLI's rc -13 in TB2's verifier."""
    out = tmp_path / "out.txt"
    script = "for i in $(seq 300); do printf 'E%0999d\\n' $i >&2; done; echo THE-END"
    with open(out, "wb") as fh:
        rc, timed_out, _, _ = supervise(["bash", "-c", script], env=None, cwd=None, stdout=fh, stderr=fh,
                                        timeout_s=30)
    data = out.read_bytes()
    assert (rc, timed_out) == (0, False), data[-300:]
    assert data.count(b"\nE") + data.startswith(b"E") == 300 and data.endswith(b"THE-END\n"), len(data)


def test_a_failing_sink_does_not_break_the_phases_pipe(tmp_path):
    """The sink refuses every write (/dev/full: ENOSPC): the pump keeps draining to EOF, so the
    phase is not killed by SIGPIPE (``head`` is, as the docker CLI was, when the read end goes)."""
    with open("/dev/full", "wb") as full:
        rc, timed_out, _, _ = supervise(["head", "-c", "4000000", "/dev/zero"], env=None, cwd=None,
                                        stdout=full, stderr=full, timeout_s=30)
    assert (rc, timed_out) == (0, False), rc


def test_the_init_gives_the_phase_sigpipe_back(tmp_path):
    """Python (the init) ignores SIGPIPE and exec keeps it ignored: ``yes | head -n1`` must end
    ``yes`` by SIGPIPE (141), as on any system, not by a write error (1)."""
    r = subprocess.run([sys.executable, str(INIT), json.dumps({}), "--", "bash", "-c",
                        "yes | head -n1 >/dev/null; echo \"${PIPESTATUS[0]}\""],
                       capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.stdout.strip() == "141", (r.stdout, r.stderr)
