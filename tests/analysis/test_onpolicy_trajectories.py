"""Trajectory builders and on-policy facts (issue 15): prefix merging with retries and parallel calls,
calls without logprobs, the sampling distribution of each sequence, and coverage counted
independently from the raw capture lines."""

from __future__ import annotations

import json
import uuid

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_analysis import frames
from polar_core.schema import CallRecord
from polar_analysis.synthetic import PLAIN_SAMPLING, write_capture
from polar_analysis.trajectories import common, per_request, prefix_merge

EOT = 9


def rec(session: str, index: int, prompt: list[int], sampled: list[int], *, logprobs="auto", sampling="plain",
        status: str = "ok") -> CallRecord:
    lps = [-0.5 - 0.01 * (i % 7) for i in range(len(sampled))] if logprobs == "auto" else logprobs
    return CallRecord(call_id=uuid.uuid4().hex, session_id=session, call_index=index, status=status, finish_reason="stop",
                      prompt_token_ids=list(prompt), sampled_token_ids=list(sampled), sampled_logprobs=lps,
                      t_request_in=1000.0 + index, sampling=dict(PLAIN_SAMPLING) if sampling == "plain" else sampling)


def load(tmp_path, records):
    write_capture(tmp_path, records)
    return frames.calls(tmp_path, rewards=None)


# ---- prefix merge: ties between a call and its retry / parallel twin -----------------------------


def test_continuation_of_the_first_of_two_same_prompt_calls_merges_exactly_onto_it(tmp_path):
    p = [1, 2, 3, 4]
    c1 = rec("s", 0, p, [20, 21, EOT])
    c2 = rec("s", 1, p, [30, 31, 32, EOT])  # a retry (or parallel call) with the same prompt, newer
    c3 = rec("s", 2, p + [20, 21, EOT] + [5, 6], [40, EOT])  # continues c1's answer
    df, stats = prefix_merge.build(load(tmp_path, [c1, c2, c3]))
    row = df.filter(pl.col("n_calls") == 2).row(0, named=True)
    assert row["call_ids"] == [c1.call_id, c3.call_id]
    assert row["merge_kind"] == ["exact"] and stats.merge_kinds == {"exact": 1}
    assert stats.coverage == 1.0 and df.height == 2


@st.composite
def interleaved_session(draw):
    """Threads (sub-agents with distinct openings) whose calls interleave; any call may be retried
    (same prompt, another answer), and a continuation re-sends one of the answers at that prompt."""
    n_threads = draw(st.integers(1, 3))
    steps = draw(st.lists(st.tuples(st.integers(0, n_threads - 1), st.sampled_from(["retry", "continue"]),
                                     st.integers(0, 5)), min_size=1, max_size=14))
    prompts = {t: [100 + t, 1, 2] for t in range(n_threads)}
    answers: dict[int, list[tuple[int, list[int]]]] = {t: [] for t in range(n_threads)}
    calls, parent = [], {}
    for n, (t, action, choice) in enumerate(steps):
        if action == "continue" and answers[t]:
            k, sampled = answers[t][choice % len(answers[t])]
            prompts[t] = prompts[t] + sampled + [500 + n, 501 + n]  # the answer re-sent, a tool result
            parent[n] = k
            answers[t] = []
        sampled = [200 + n, 300 + (n * 7) % 50, EOT]
        calls.append((prompts[t], sampled))
        answers[t].append((n, sampled))
    return calls, parent


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(session=interleaved_session())
def test_every_continuation_merges_exactly_onto_the_call_it_continues(tmp_path_factory, session):
    calls, parent = session
    records = [rec("s", i, p, s) for i, (p, s) in enumerate(calls)]
    df, stats = prefix_merge.build(load(tmp_path_factory.mktemp("cap"), records))
    assert stats.coverage == 1.0 and stats.sampled_tokens == sum(len(s) for _, s in calls)
    before = {}
    for row in df.iter_rows(named=True):
        assert set(row["merge_kind"]) <= {"exact"}
        for a, b in zip(row["call_ids"], row["call_ids"][1:]):
            before[b] = a
    index = {r.call_id: i for i, r in enumerate(records)}
    for child, par in parent.items():
        assert index.get(before.get(records[child].call_id)) == par, f"call {child} should follow call {par}"


# ---- calls without logprobs ----------------------------------------------------------------------


def test_missing_logprobs_exclude_the_call_with_a_counted_reason_never_zeros(tmp_path):
    ok = rec("s", 0, [1, 2, 3], [20, 21, EOT])
    short = rec("s", 1, [7, 8], [30, 31, EOT], logprobs=[-0.1])  # fewer logprobs than ids
    none = rec("t", 0, [7, 9], [40, 41, EOT], logprobs=[-0.1, None, -0.3])  # one logprob missing
    for build in (per_request.build, prefix_merge.build):
        df, stats = build(load(tmp_path / build.__module__, [ok, short, none]))
        assert stats.skipped_no_logprobs == 2 and stats.skipped_no_logprobs_sampled_tokens == 6
        assert stats.usable_calls == 1 and stats.coverage == 1.0
        assert df["call_ids"].to_list() == [[ok.call_id]]
        assert 0.0 not in [v for row, m in zip(df["logprobs"].to_list(), df["loss_mask"].to_list())
                           for v, k in zip(row, m) if k]


def test_vllm_adapter_keeps_a_missing_logprob_missing():
    from polar_proxy.engines.base import TokenData
    from polar_proxy.engines.vllm import VLLMEngine

    into = TokenData()
    VLLMEngine().read_response({"choices": [{"index": 0, "token_ids": [5, 6],
                                             "logprobs": {"content": [{"token": "a", "logprob": -1.0}, {"token": "b"}]}}]},
                               into)
    assert into.sampled_logprobs == [-1.0, None]


# ---- the sampling distribution of each sequence --------------------------------------------------


def test_sequences_carry_their_calls_sampling_and_name_the_call_when_the_trainer_cannot(tmp_path):
    warm = dict(PLAIN_SAMPLING, temperature=0.7, top_p=0.9, top_k=20)
    raw = dict(warm, logprobs_mode="raw_logprobs")
    unknown = dict(PLAIN_SAMPLING, top_k=None)
    penalised = dict(PLAIN_SAMPLING, repetition_penalty=1.1)
    records = [rec("a", 0, [1, 2], [20, EOT], sampling=warm), rec("b", 0, [1, 3], [21, EOT], sampling=raw),
               rec("c", 0, [1, 4], [22, EOT], sampling=None), rec("d", 0, [1, 5], [23, EOT], sampling=unknown),
               rec("e", 0, [1, 6], [24, EOT], sampling=penalised)]
    df, _ = per_request.build(load(tmp_path, records))
    rows = {r["session_id"]: r for r in df.iter_rows(named=True)}
    assert (rows["a"]["temperature"], rows["a"]["top_k"], rows["a"]["top_p"], rows["a"]["sampling_issue"]) == (0.7, 20, 0.9, None)
    for sid, says in (("b", "raw"), ("c", "schema version 2"), ("d", "top_k unknown"), ("e", "repetition_penalty=1.1")):
        issue = rows[sid]["sampling_issue"]
        assert rows[sid]["temperature"] is None and says in issue and records[ord(sid) - ord("a")].call_id in issue


@pytest.mark.parametrize("param,value", [("min_p", 0.05), ("repetition_penalty", 1.1), ("repetition_penalty", 0.9),
                                         ("presence_penalty", 0.5), ("presence_penalty", -0.5),
                                         ("frequency_penalty", 0.3), ("frequency_penalty", -0.3)])
def test_each_sampling_parameter_the_trainer_cannot_reproduce_is_refused_by_name(param, value):
    """min-p and each penalty (either side of neutral) reshape the distribution in ways the trainer's
    temperature/top-k/top-p do not: a call sampled with one is refused, naming the call and the
    parameter; the same call with the neutral value passes."""
    from polar_analysis.trajectories.common import trainer_sampling

    t, top_k, top_p, issue = trainer_sampling(dict(PLAIN_SAMPLING, **{param: value}), "call c9 (session s)")
    assert t is None and issue is not None
    assert f"{param}={value}" in issue and "call c9" in issue and "does not reproduce" in issue
    assert trainer_sampling(dict(PLAIN_SAMPLING), "call c9") == (1.0, 0, 1.0, None)


def test_prefix_merge_never_joins_calls_of_different_distributions(tmp_path):
    c1 = rec("s", 0, [1, 2], [20, EOT])
    c2 = rec("s", 1, [1, 2, 20, EOT, 5], [21, EOT], sampling=dict(PLAIN_SAMPLING, temperature=0.6))
    df, stats = prefix_merge.build(load(tmp_path, [c1, c2]))
    assert df.height == 2 and stats.break_reasons == {"sampling_changed": 1}
    assert df["temperature"].to_list() == [1.0, 0.6] and df["chain_index"].to_list() == [0, 0]


# ---- coverage, counted independently -------------------------------------------------------------


def test_coverage_from_raw_capture_lines_drops_when_a_token_is_lost(tmp_path, monkeypatch):
    records = [rec("s", 0, [1, 2], [20, 21, 22, EOT]), rec("s", 1, [1, 2, 20, 21, 22, EOT, 5], [23, EOT]),
               rec("t", 0, [3], [30, EOT]), rec("t", 1, [3], [31, EOT], logprobs=None, status="error")]
    lf = load(tmp_path, records)
    df, stats = prefix_merge.build(lf)
    cov = common.capture_coverage(tmp_path, df)
    assert cov["coverage"].to_list() == [1.0, 1.0] and cov["sampled"].to_list() == [6, 2]
    assert stats.coverage == 1.0

    real = common.collect_calls

    def lossy(calls_lf):  # a loader that loses the last sampled id of one call
        out = real(calls_lf)
        out[0].sampled, out[0].logprobs = out[0].sampled[:-1], out[0].logprobs[:-1]
        return out

    monkeypatch.setattr(prefix_merge, "collect_calls", lossy)
    df2, stats2 = prefix_merge.build(lf)
    cov2 = common.capture_coverage(tmp_path, df2).filter(session_id="s")
    assert cov2["covered"].item() == 5 and cov2["coverage"].item() == pytest.approx(5 / 6)


def test_builder_coverage_counts_the_output_rows_not_the_pieces(tmp_path, monkeypatch):
    """A builder that writes a sampled span into the wrong session's row loses it for its own."""
    records = [rec("s", 0, [1, 2], [20, 21, EOT]), rec("t", 0, [3], [30, EOT])]
    real = common.sequences_frame

    def misfiled(seqs, stats):
        seqs[1].session_id = seqs[0].session_id  # t's sequence filed under s
        return real(seqs, stats)

    monkeypatch.setattr(per_request, "sequences_frame", misfiled)
    _, stats = per_request.build(load(tmp_path, records))
    assert stats.sampled_tokens == 5 and stats.covered_tokens == 3 and stats.coverage == pytest.approx(0.6)


# ---- effective sampling as the proxy records it --------------------------------------------------


def test_effective_sampling_follows_vllm_priority(tmp_path):
    from polar_proxy import sampling
    from polar_proxy.engines.vllm import server_sampling

    model = tmp_path / "qwen3"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    info = {"vllm_config": {"model_config": {"model": str(model), "generation_config": "auto",
                                             "logprobs_mode": "processed_logprobs", "override_generation_config": {}}}}
    server = server_sampling(info)
    assert server == {"defaults": {"temperature": 0.6, "top_k": 20, "top_p": 0.95},
                      "defaults_from": str(model / "generation_config.json"), "logprobs_mode": "processed_logprobs"}
    got = sampling.effective({"temperature": 0.8, "top_k": -1, "seed": 3}, server)
    assert got == {"temperature": 0.8, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 3, "enforced": [],
                   "defaults_from": str(model / "generation_config.json"), "logprobs_mode": "processed_logprobs"}
    neutral = server_sampling({"vllm_config": {"model_config": {"model": str(model), "generation_config": "vllm"}}})
    assert sampling.effective({}, neutral)["top_p"] == 1.0 and neutral["logprobs_mode"] is None
    blind = sampling.effective({"temperature": 1.0}, server_sampling(None))
    assert blind["temperature"] == 1.0 and blind["top_p"] is None and blind["defaults_from"] == "unknown"
    enforced = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    assert sampling.effective(dict(enforced), server, enforced)["enforced"] == ["temperature", "top_k", "top_p"]
    assert np.isfinite(got["temperature"])


# ---- which model and tokenizer the sequences belong to --------------------------------------------


@pytest.mark.parametrize("mode", ["per-request", "prefix-merge"])
def test_sequences_record_the_served_model_and_the_tokenizer_fingerprint(tmp_path, renderer, tiny_qwen_dir, mode):
    """What `polar train` checks before it trains: the served model's name (from the captures) and
    the fingerprint of the tokenizer found for it (the renderer's)."""
    import dataclasses

    from polar_analysis import alignment, trajectories
    from polar_core.tokenizer_identity import fingerprint_of_dir

    records = [dataclasses.replace(rec("s", 0, [1, 2], [20, EOT]), served_model="qwen2.5-coder-0.5b-instruct"),
               dataclasses.replace(rec("s", 1, [1, 2, 20, EOT, 5], [21, EOT]), served_model="qwen2.5-coder-0.5b-instruct")]
    fp = alignment.tokenizer_fingerprint(renderer)
    assert fp == fingerprint_of_dir(tiny_qwen_dir)
    df, _ = trajectories.build(load(tmp_path, records), mode, tokenizer_fingerprint=fp)
    assert set(df["served_model"].to_list()) == {"qwen2.5-coder-0.5b-instruct"}
    assert set(df["tokenizer_fingerprint"].to_list()) == {fp}
    df, _ = trajectories.build(load(tmp_path / "again", records), mode)  # no tokenizer found: null, not a guess
    assert df["tokenizer_fingerprint"].null_count() == df.height
