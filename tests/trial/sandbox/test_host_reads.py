"""What the host reads or keeps of a phase's files (issue: the host reads nothing a phase controls).

* The docker backend's ``report.json`` lives in a dir the phase writes as the same uid as the init:
  a sample replaced it with a link to a host 0600 file (its text reached ``sandbox_notes``), to
  ``/dev/ptmx`` (the blocking read hung the rollout worker for good) or ``/dev/zero`` (read until
  the host's memory ran out). ``docker.read_report`` must refuse each, and keep only typed fields.
  These run the real reader on a report dir laid out as the phase leaves it; the same reader on a
  live container is in test_docker_live.py.
* Links a sample plants in its work dir and HOME stay in the run dir after the sample, pointing at
  host files: a user's ``cp -L`` or upload would follow them. The rollout removes those that
  resolve outside the sample's dir once its last phase is over, and says so.

Each test fails with its defence removed (the plain ``read_text`` reader; no sweep). ~3 s.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from polar_trial.sandbox.docker import REPORT_LIMIT, read_report

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacks are a root host's (CI runs as root)")


def _read_guarded(report_dir: Path, timeout_s: float = 10.0):
    """read_report in a thread: a reader that blocks (``/dev/ptmx``) fails the test, not the run."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=read_report(report_dir)), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"reading the report blocked for {timeout_s:g} s"
    return out["r"]


@pytest.fixture
def report_dir(tmp_path):
    d = tmp_path / "report"
    d.mkdir()
    return d


def test_a_report_linked_to_a_host_0600_file_is_refused(report_dir, tmp_path):
    secret = tmp_path / "host-secret.json"
    secret.write_text(json.dumps({"leftovers": "HOST-SECRET-4a1f", "relay": "HOST-SECRET-4a1f"}))
    os.chmod(secret, 0o600)
    (report_dir / "report.json").symlink_to(secret)
    report, note = _read_guarded(report_dir)
    assert report == {} and "refused" in note and "HOST-SECRET" not in note


@pytest.mark.parametrize("device", ["/dev/ptmx", "/dev/zero", "/dev/urandom", "/dev/tty"])
def test_a_report_linked_to_a_device_is_refused_without_blocking_or_reading(report_dir, device):
    """``/dev/ptmx`` blocked forever; ``/dev/zero`` read until the host ran out of memory."""
    (report_dir / "report.json").symlink_to(device)
    report, note = _read_guarded(report_dir)
    assert report == {} and "refused" in note


def test_a_fifo_report_is_refused_without_blocking(report_dir):
    os.mkfifo(report_dir / "report.json")
    report, note = _read_guarded(report_dir)
    assert report == {} and "refused" in note


def test_an_oversize_report_is_refused(report_dir):
    (report_dir / "report.json").write_text('{"leftovers": 1, "pad": "' + "x" * (REPORT_LIMIT * 16) + '"}')
    report, note = _read_guarded(report_dir)
    assert report == {} and "over" in note


def test_only_the_reports_typed_fields_are_kept(report_dir):
    (report_dir / "report.json").write_text(json.dumps(
        {"leftovers": "3; rm -rf /", "returncode": True, "swept": "yes", "relay": "x" * 1000, "extra": 1}))
    report, note = _read_guarded(report_dir)
    assert note is None and report == {"relay": "x" * 300}
    (report_dir / "report.json").write_text(json.dumps({"leftovers": 2, "swept": True, "returncode": 0}))
    assert _read_guarded(report_dir) == ({"leftovers": 2, "swept": True, "returncode": 0}, None)
    (report_dir / "report.json").write_text("[1, 2]")
    assert _read_guarded(report_dir)[0] == {}


PLANT = """
echo data > data.txt
mkdir -p sub && ln -s ../data.txt sub/inside && ln -s data.txt inside
ln -s /etc/passwd host-file
ln -s ../../../../../../../../../../etc/shadow up
ln -s sub/../../.. dotdot
mkdir -p "$HOME/.cache" && ln -s /root "$HOME/.cache/root"
(for i in $(seq 300); do mkdir d && cd d || exit 1; done; ln -s /etc/passwd deep-below)
"""


def test_links_out_of_the_sample_dir_leave_the_run_dir_after_its_last_phase(tmp_path):
    """A sample plants links to host files in its work dir and HOME (one 300 levels down, past the
    host walk's depth); the verifier still sees them
    (it runs before the sweep: reward 1 only if ``host-file`` is there), the run dir keeps none
    that resolves outside the sample's dir, the task's own relative links stay, and the row says
    what was removed. ~2 s."""
    from polar_runtime import rollout as r
    from polar_runtime.harnesses import Endpoint, get_preset

    task = r.Task("plant", "plant links", evaluator="test -L host-file && test -L up")
    cfg = r.RolloutConfig(tasks=[task], preset=get_preset("generic", command=PLANT),
                          endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
                          capture_dir=tmp_path / "captures", model="m", samples=1, timeout=60.0, eval_timeout=60.0)
    row = r.run_rollout(cfg).row(0, named=True)
    assert row["status"] == "ok" and row["reward"] == 1.0, row
    sample = Path(row["workdir"]).parent
    links = {str(p.relative_to(sample)): os.readlink(p) for p in sample.rglob("*") if p.is_symlink()}
    assert links == {"work/inside": "data.txt", "work/sub/inside": "../data.txt"}, links
    assert "5 link(s) pointing outside the sample's dir removed" in row["sandbox_notes"], row["sandbox_notes"]
    assert "deeper than 256 levels: removed whole" in row["sandbox_notes"]  # where deep-below was
    assert "host-file -> /etc/passwd" in row["sandbox_notes"]


@pytest.mark.parametrize("kind", ["host-file", "ptmx", "fifo"])
def test_the_live_trials_reports_are_read_without_following_or_blocking(report_dir, tmp_path, kind):
    """The live trial's reports dir is written in the container: its reader refuses a link (to a
    host file, to /dev/ptmx) and a FIFO, without blocking."""
    from polar_trial.sandbox.trial import _read_json

    path = report_dir / "phase.json"
    if kind == "host-file":
        secret = tmp_path / "host-only.json"
        secret.write_text(json.dumps({"error": "HOST-SECRET-9d2e"}))
        os.chmod(secret, 0o600)
        path.symlink_to(secret)
    elif kind == "ptmx":
        path.symlink_to("/dev/ptmx")
    else:
        os.mkfifo(path)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=_read_json(path)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the report read blocked"
    assert out["r"] == {}
