"""benchmarks/bench_harness_images.py's merge count and time split (issue 52), on synthetic calls
(milliseconds; the measurement itself is the benchmark). OpenCode's title call runs beside its first
turn: counting consecutive calls of a session as merges named that pair a broken history."""

from __future__ import annotations

import pytest

from polar_testing.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_harness_images")


def _call(prompt, sampled, history=None, text="do the task", t=(0.0, 1.0)):
    return {"prompt_token_ids": prompt, "sampled_token_ids": sampled, "history": history,
            "normalized_request": {"messages": [{"role": "user", "content": text}]},
            "t_upstream_sent": t[0], "t_upstream_end": t[1]}


def test_a_side_chain_beside_the_turns_is_no_broken_merge(bench):
    main1 = _call([1, 2, 3], [4, 5])
    other = _call([1, 9, 9], [7])  # another chain of the same session (its prompt continues no call)
    main2 = _call([1, 2, 3, 4, 5, 6], [8], history="exact")  # continues main1 exactly
    m = bench.merges([main1, other, main2])
    assert (m["merges"], m["exact"], m["chains"], m["causes"]) == (1, 1, 2, {})
    assert m["rate"] == 1.0


def test_a_re_rendered_answer_is_a_named_non_exact_merge(bench):
    first = _call([1, 2, 3], [4, 5])
    second = _call([1, 2, 3, 4, 6, 7], [8])  # the answer came back as other ids
    m = bench.merges([first, second])
    assert (m["merges"], m["exact"]) == (1, 0)
    assert m["causes"] == {"answer re-rendered (prompt kept, sampled ids differ)": 1}


def test_a_known_side_call_is_counted_apart(bench):
    from polar_core.compaction import HARNESS_SIDE_CALLS

    phrase = HARNESS_SIDE_CALLS[0][1]
    m = bench.merges([_call([1, 2], [3]), _call([1, 2, 3, 4], [5], text=f"x {phrase} y")])
    assert (m["auxiliary"], m["merges"], m["chains"]) == (1, 0, 1)


def test_concurrent_calls_count_once_in_the_model_time(bench):
    calls = [_call([1], [2], t=(10.0, 20.0)), _call([3], [4], t=(15.0, 25.0)), _call([5], [6], t=(30.0, 31.0))]
    row = {"wall_s": 40.0, "eval_s": 1.0}
    split = bench.time_split(row, calls, env_start_s=2.0, agent_t0=None)
    assert split["model"] == 16.0  # 10-25 and 30-31, not 10 + 10 + 1
    assert split["tools_and_harness"] >= 0
