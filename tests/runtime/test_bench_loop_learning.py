"""benchmarks/bench_loop_learning.py's result table: reward ± se per side and update count, the
change from the base and asynchronous minus synchronous (seconds; the experiment is the benchmark)."""

from __future__ import annotations

import math

import pytest

from polar_testing.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bll():
    return load_benchmark("bench_loop_learning")


def _rows(task: str, passed: int, n: int, infra: int = 0) -> list[dict]:
    rows = [{"task_id": task, "status": "ok", "reward": 1.0 if i < passed else 0.0} for i in range(n)]
    return rows + [{"task_id": task, "status": "timeout", "reward": None} for _ in range(infra)]


def test_side_table_rates_changes_and_difference(bll):
    evals = {"base": _rows("a", 8, 32) + _rows("b", 16, 32),
             "k0-v1": _rows("a", 16, 32) + _rows("b", 24, 32),
             "k1-v1": _rows("a", 12, 32) + _rows("b", 20, 32, infra=2)}
    t = bll.side_table(evals, {"k0": ["base", "k0-v1"], "k1": ["base", "k1-v1"]})
    base, s1, a1 = t["k0"][0], t["k0"][1], t["k1"][1]
    assert (base["passed"], base["graded"], base["rate"]) == (24, 64, 0.375)
    assert base["se"] == pytest.approx(math.sqrt(0.375 * 0.625 / 63))
    assert base["tasks"]["a"]["rate"] == 0.25 and base["tasks"]["b"]["graded"] == 32
    assert base["vs_base"]["diff"] == 0.0
    assert s1["rate"] == 40 / 64 and s1["vs_base"]["diff"] == pytest.approx(40 / 64 - 24 / 64)
    # infrastructure failures are left out of n, and counted
    assert (a1["passed"], a1["graded"], a1["infra"]) == (32, 64, 2)
    d = t["difference"][1]
    assert d["updates"] == 1 and d["k1_minus_k0"] == pytest.approx(32 / 64 - 40 / 64)
    assert d["se"] == pytest.approx(math.hypot(s1["se"], a1["se"]))
    assert t["difference"][0]["k1_minus_k0"] == 0.0


def test_side_table_missing_evaluation_is_none_not_an_error(bll):
    t = bll.side_table({"base": _rows("a", 1, 4)}, {"k0": ["base", "k0-v1"]})
    assert t["k0"][1]["rate"] is None and t["k0"][1]["graded"] == 0
    assert "difference" not in t


def test_load_summary(bll):
    assert bll.load_summary([]) == {"samples": 0, "min": None, "median": None, "max": None}
    assert bll.load_summary([3.0, 1.0, 2.0]) == {"samples": 3, "min": 1.0, "median": 2.0, "max": 3.0}


def test_paired_counts_discordant_samples_by_task_and_index(bll):
    def rows(task, passed_idx, n):
        return [{"task_id": task, "sample_index": i, "status": "ok", "reward": 1.0 if i in passed_idx else 0.0}
                for i in range(n)]

    ref = rows("a", {0, 1, 2}, 4) + rows("b", {0}, 3)
    other = rows("a", {0, 1, 3}, 4) + rows("b", {0, 1, 2}, 3) + [{"task_id": "c", "sample_index": 0, "status": "ok",
                                                                "reward": 1.0}]
    other[3] = {**other[3], "status": "timeout", "reward": None}  # a: index 3 not graded on one side: no pair
    p = bll.paired(ref, other)
    # pairs: a0 a1 a2 (a3 dropped), b0 b1 b2 (c has no partner); a2: only ref passed; b1, b2: only other
    assert (p["pairs"], p["agree"], p["only_other_passed"], p["only_ref_passed"]) == (6, 3, 2, 1)
    assert p["diff"] == pytest.approx(1 / 6) and p["se"] == pytest.approx(math.sqrt(3 - 1 / 6) / 6)
    same = bll.paired(ref, ref)
    assert same["agree"] == same["pairs"] == 7 and same["se"] == 0.0
