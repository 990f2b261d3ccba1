"""benchmarks/guard_proxy_cpu.py's verdict (the comparison with the committed figure), on numbers:
the measurement itself is the benchmark's, run by hand, never a timed test (issue 42)."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from polar_testing.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def guard():
    return load_benchmark("guard_proxy_cpu")


def test_a_drop_of_more_than_five_percent_fails(guard):
    ok, msg = guard.compare(0.90, 1.00)
    assert not ok and "10.0% below" in msg
    assert not guard.compare(0.949, 1.00)[0]
    assert guard.compare(0.951, 1.00)[0]
    assert guard.compare(0.95 * 0.92, 0.92)[0]  # exactly at the floor passes
    assert guard.compare(1.20, 1.00)[0]  # better passes
    assert not guard.compare(0.93, 1.00, tolerance=0.02)[0]


def test_no_baseline_passes_and_a_missing_measurement_fails(guard):
    assert guard.compare(0.9, None)[0]
    assert not guard.compare(math.nan, 1.0)[0]
    assert not guard.compare(0.0, 1.0)[0]


def test_the_baseline_is_the_committed_file_not_the_working_copy(guard, tmp_path):
    repo = tmp_path / "r"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    f = repo / "benchmarks" / "results" / "proxy_cpu_guard.json"
    f.write_text(json.dumps({"ratio": 0.93}))
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "figure"], check=True)
    f.write_text(json.dumps({"ratio": 0.50}))  # a local --write, not committed
    assert guard.committed_figure(f)["ratio"] == 0.93
    assert guard.committed_figure(tmp_path / "x" / "benchmarks" / "results" / "none.json") is None
