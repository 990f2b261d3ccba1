"""benchmarks/answer_credit.py: the credit each answer token got from a GRPO step and how it moved
(issue 41's "why yes"), on synthetic trajectories (under a second; the analysis of a real run is the
benchmark's)."""

from __future__ import annotations

import polars as pl
import pytest

from polar_testing.benchmarks import load_benchmark

YES, NO, CAP_YES = 9454, 2152, 9642
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def ac():
    return load_benchmark("answer_credit")


def _traj(samples: list[tuple[str, int, float, float]]) -> pl.DataFrame:
    """(task, answer token, reward, served logprob of that token) per sample; one group per task."""
    rows = []
    for i, (task, token, reward, lp) in enumerate(samples):
        ids = PROMPT + [token, 151645]
        rows.append({"task_id": task, "group_id": f"{task}.st0", "session_id": f"{task}.s{i}", "input_ids": ids,
                     "logprobs": [0.0] * 3 + [lp, -0.01], "loss_mask": [0, 0, 0, 1, 1],
                     "span_start": [0, 3], "span_end": [3, 5], "span_kind": ["prompt", "sampled"],
                     "reward": reward, "status": "ok"})
    return pl.DataFrame(rows)


def test_credit_sums_the_trainers_advantages_per_task_and_answer_token(ac):
    # yes-task: 3 'yes' right, 1 'no' wrong. mean 0.75, std (ddof 1) 0.5: +0.5 each, -1.5
    traj = _traj([("wet", YES, 1.0, -1.0)] * 3 + [("wet", NO, 0.0, -1.2)]
                 + [("hot", NO, 1.0, -0.9), ("hot", CAP_YES, 0.0, -1.7)] + [("flat", YES, 1.0, -0.5)] * 2)
    c = {(r["task_id"], r["token"]): r for r in ac.credit(traj).to_dicts()}
    assert c[("wet", YES)]["samples"] == 3 and c[("wet", YES)]["credit"] == pytest.approx(1.5, abs=1e-4)
    assert c[("wet", NO)]["credit"] == pytest.approx(-1.5, abs=1e-4)
    assert c[("hot", CAP_YES)]["credit"] == pytest.approx(-0.7071, abs=1e-3)
    assert c[("flat", YES)]["credit"] == 0.0  # a group without variance is not trained: no credit
    assert c[("wet", NO)]["logprob"] == pytest.approx(-1.2)


def test_moves_tell_own_credit_from_pooled_credit(ac):
    # step N: 'yes' is credited in the yes-task (+1.5) and blamed in the no-task (-0.71): pooled +0.79.
    before = _traj([("wet", YES, 1.0, -1.0)] * 3 + [("wet", NO, 0.0, -1.2)]
                   + [("hot", NO, 1.0, -0.9), ("hot", YES, 0.0, -1.7)])
    # step N+1: 'yes' rose in both tasks (against the no-task's own credit), 'no' rose in the no-task
    after = _traj([("wet", YES, 1.0, -0.2), ("wet", NO, 0.0, -2.0), ("hot", YES, 0.0, -0.6), ("hot", NO, 1.0, -0.8)])
    res = ac.moves(before, after)
    by = {(r["task_id"], r["token"]): r for r in res["table"]}
    assert by[("hot", YES)]["move"] == pytest.approx(1.1)
    assert by[("hot", YES)]["pooled_credit"] == pytest.approx(1.5 - 0.7071, abs=1e-3)
    # 4 (task, token) moves; own credit right on 3 (not 'yes' in hot); pooled right on all but 'no' in hot
    # (pooled 'no': -1.5 + 0.71 < 0, it rose)
    assert res["own_credit_predicts_move"] == {"agree": 3, "of": 4}
    assert res["pooled_credit_predicts_move"] == {"agree": 3, "of": 4}
    assert res["where_they_disagree"] == {"own": {"agree": 1, "of": 2}, "pooled": {"agree": 1, "of": 2}}
