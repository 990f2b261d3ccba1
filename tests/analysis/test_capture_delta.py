"""Captures stored as deltas (schema 3): every reader sees the records the proxy had in memory.

Old captures (every record in full) and new ones (prompt ids and requests as what is new since an
earlier record) must give the same calls frame and the same trajectories; a torn tail loses only
the last record; the file grows with the session, not its square.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import orjson
import polars as pl
import pytest
from polar_proxy.capture import CaptureWriter, encode_record

from polar_analysis import frames, trajectories
from polar_core import capture_delta as cd
from polar_core.schema import SESSIONS_SUBDIR, CallRecord, read_capture_lines

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
COMPARED = [c for c in frames.CALL_SCHEMA if c not in ("source_file", "extra_json")]


def growing_session(sid: str, n: int, *, step: int = 300, rng_seed: int = 0) -> list[CallRecord]:
    """A session as exact history writes it: each prompt is the previous prompt, its sampled ids
    and a tool result; each request re-sends the whole conversation."""
    rng = np.random.default_rng(rng_seed)
    prompt = rng.integers(0, 150_000, 500).tolist()
    messages = [{"role": "system", "content": "sys " * 200}, {"role": "user", "content": "task"}]
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}} for i in range(5)]
    out = []
    for i in range(n):
        sampled = rng.integers(0, 150_000, 40).tolist()
        req = {"model": "m", "messages": list(messages), "tools": tools, "stream": True}
        out.append(CallRecord(
            call_id=f"{sid}-{i:04d}", session_id=sid, call_index=i, provider="openai_chat", status="ok",
            finish_reason="tool_calls", native_request=req, normalized_request={**req, "logprobs": True},
            prompt_token_ids=list(prompt), sampled_token_ids=sampled,
            sampled_logprobs=(-rng.random(40)).tolist(), output_text=f"answer {i}", t_request_in=1000.0 + i,
        ))
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "tool", "content": "r" * step}]
        prompt = prompt + sampled + rng.integers(0, 150_000, step).tolist()
    return out


def write_old(capture: Path, records: list[CallRecord]) -> None:
    d = capture / SESSIONS_SUBDIR
    d.mkdir(parents=True, exist_ok=True)
    for r in records:
        with open(d / f"{r.session_id}.jsonl", "ab") as fh:
            fh.write(encode_record(r))


def write_new(capture: Path, records: list[CallRecord]) -> CaptureWriter:
    w = CaptureWriter(capture)
    for r in records:
        w.write(r)
    return w


def _frame(capture: Path) -> pl.DataFrame:
    return frames.calls(capture, rewards=None).select(COMPARED).collect()


def test_delta_capture_reads_back_every_record_and_grows_linearly(tmp_path):
    recs = growing_session("s", 30)
    write_old(tmp_path / "old", recs)
    write_new(tmp_path / "new", recs).close()
    old_file, new_file = (tmp_path / "old" / "sessions" / "s.jsonl"), (tmp_path / "new" / "sessions" / "s.jsonl")
    raw = [orjson.loads(line) for line in new_file.read_bytes().splitlines()]
    assert raw[0]["prompt_token_ids"] and "ref" not in raw[0]["delta"]  # the first record is whole
    assert all(r["prompt_token_ids"] is None and r["delta"]["ref"] == recs[i].call_id
               for i, r in enumerate(raw[1:]))  # the latest record is the best reference
    got = list(read_capture_lines(new_file))
    assert len(got) == 30
    for rec, g in zip(recs, got):
        assert g["prompt_token_ids"] == rec.prompt_token_ids
        assert g["native_request"] == rec.native_request and g["normalized_request"] == rec.normalized_request
        assert g["sampled_token_ids"] == rec.sampled_token_ids and g["sampled_logprobs"] == rec.sampled_logprobs
    # linear: the file holds about the final prompt, the sampled ids and the last request once
    last = recs[-1]
    floor = len(orjson.dumps(last.prompt_token_ids)) + sum(len(orjson.dumps(r.sampled_token_ids)) for r in recs) \
        + len(orjson.dumps(last.normalized_request))
    assert new_file.stat().st_size < 3 * floor < old_file.stat().st_size
    assert _frame(tmp_path / "new").equals(_frame(tmp_path / "old"))


def test_torn_tail_loses_only_the_last_record(tmp_path):
    recs = growing_session("s", 6)
    write_new(tmp_path, recs).close()
    path = tmp_path / "sessions" / "s.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])  # the last record torn mid-line
    assert [r["call_id"] for r in read_capture_lines(path)] == [r.call_id for r in recs[:5]]
    df = frames.calls(tmp_path, rewards=None).collect()
    assert df["call_id"].to_list() == [r.call_id for r in recs[:5]]
    assert df["prompt_token_ids"].to_list()[-1] == recs[4].prompt_token_ids


def test_a_delta_whose_reference_is_unreadable_is_counted_not_guessed(tmp_path):
    recs = growing_session("s", 4)
    write_new(tmp_path, recs).close()
    path = tmp_path / "sessions" / "s.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = b'{"broken": \n'  # record 1 lost: record 2 refers to it, record 3 to record 2
    path.write_bytes(b"".join(lines))
    report = frames.ScanReport()
    df = frames.calls(tmp_path, rewards=None, report=report).collect()
    assert df["call_id"].to_list() == [recs[0].call_id]
    assert report.totals()["invalid"] == 3 and "refers to call" in report.files[0].errors[1]


def test_incremental_conversion_resolves_deltas_across_parts(tmp_path):
    recs = growing_session("s", 12)
    w = write_new(tmp_path, recs[:5])
    cache = tmp_path / "cache"
    assert frames.calls(tmp_path, cache_dir=cache, rewards=None).collect().height == 5
    for r in recs[5:]:
        w.write(r)
    w.close()
    report = frames.ScanReport()
    df = frames.calls(tmp_path, cache_dir=cache, rewards=None, report=report).select(COMPARED).collect()
    assert report.appended == 1 and report.totals()["invalid"] == 0
    write_old(tmp_path / "old", recs)
    assert df.equals(_frame(tmp_path / "old"))


def test_two_writers_on_one_session_file_resolve_their_own_references(tmp_path):
    a, b = CaptureWriter(tmp_path), CaptureWriter(tmp_path)
    ra, rb = growing_session("s", 20, rng_seed=1), growing_session("s", 20, rng_seed=2)
    for r in rb:
        r.call_id = "b" + r.call_id
    order = [ra[i] for i in range(10)] + [x for pair in zip(ra[10:], rb) for x in pair] + rb[10:]
    for r in order:
        (a if r in ra else b).write(r)
    got = list(read_capture_lines(tmp_path / "sessions" / "s.jsonl"))
    assert [g["call_id"] for g in got] == [r.call_id for r in order]
    assert all(g["prompt_token_ids"] == r.prompt_token_ids for g, r in zip(got, order))


@pytest.mark.parametrize("fixture", ["demo-run", "demo-run-exact"])
def test_old_capture_converted_rebuilds_identical_trajectories(tmp_path, fixture):
    """The committed captures (every record in full) and their conversion to deltas give the same
    calls and the same trajectories, in both modes."""
    src = FIXTURES / fixture / "captures"
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(src, old, ignore=shutil.ignore_patterns(".polar-cache"))
    (new / SESSIONS_SUBDIR).mkdir(parents=True)
    bytes_in = bytes_out = 0
    for f in sorted((old / SESSIONS_SUBDIR).glob("*.jsonl")):
        n, i, o = cd.convert_file(f, new / SESSIONS_SUBDIR / f.name)
        assert n == sum(1 for _ in read_capture_lines(f)) and n > 0
        bytes_in, bytes_out = bytes_in + i, bytes_out + o
    assert bytes_out < bytes_in / 2
    assert any(r.get("delta", {}).get("ref") for f in (new / SESSIONS_SUBDIR).glob("*.jsonl")
               for r in read_capture_lines(f, expand=False))
    old_lf, new_lf = frames.calls(old, rewards=None), frames.calls(new, rewards=None)
    assert new_lf.select(COMPARED).collect().equals(old_lf.select(COMPARED).collect())
    for mode in trajectories.MODES:
        t_old, s_old = trajectories.build(old_lf, mode)
        t_new, s_new = trajectories.build(new_lf, mode)
        assert t_old.height > 0 and t_new.equals(t_old)
        assert s_new.as_dict() == s_old.as_dict()
    # and back: the delta capture written out in full again is the original, record for record
    back = tmp_path / "back.jsonl"
    f = sorted((new / SESSIONS_SUBDIR).glob("*.jsonl"))[0]
    cd.convert_file(f, back, delta=False)
    strip = lambda r: {k: v for k, v in r.items() if k != cd.WRITER_KEY}  # noqa: E731
    assert [strip(r) for r in read_capture_lines(back)] == list(read_capture_lines(old / SESSIONS_SUBDIR / f.name))


def test_prompts_share_one_arena_and_expand_only_when_asked(tmp_path, monkeypatch):
    """The cache keeps a session's prompts as one arena about its final prompt's size; counting
    prompt ids expands nothing; the builders get views into the arena, not a copy per call."""
    expanded = []
    real = frames._expand_prompts
    monkeypatch.setattr(frames, "_expand_prompts", lambda s: expanded.append(len(s)) or real(s))
    recs = growing_session("s", 30)
    write_old(tmp_path, recs)  # full records: the arena does not depend on the capture format
    lf = frames.calls(tmp_path, rewards=None)
    assert lf.select(pl.col("n_prompt_ids").sum()).collect().item() == sum(len(r.prompt_token_ids) for r in recs)
    assert expanded == []
    arena = tmp_path / ".polar-cache" / "s.ids"
    assert arena.stat().st_size == 4 * len(recs[-1].prompt_token_ids)
    assert lf.filter(pl.col("call_index") == 7).select("prompt_token_ids").collect().item().to_list() == recs[7].prompt_token_ids
    assert sum(expanded) < 30
    # the requests too: one byte file per column, about the last request's size, read back exactly
    ropes = tmp_path / ".polar-cache" / "s.normalized_request.bytes"
    assert ropes.stat().st_size < 1.5 * len(orjson.dumps(recs[-1].normalized_request))
    got = lf.select("native_request", "normalized_request").collect()
    assert [frames.decode_json(x) for x in got["native_request"]] == [r.native_request for r in recs]
    assert [frames.decode_json(x) for x in got["normalized_request"]] == [r.normalized_request for r in recs]
    from polar_analysis.trajectories.common import collect_calls

    calls = collect_calls(lf)
    assert [c.prompt.tolist() for c in calls] == [r.prompt_token_ids for r in recs]
    assert np.shares_memory(calls[0].prompt, calls[-1].prompt)
    assert [c.request for c in calls] == [r.normalized_request for r in recs]  # read per session, when asked


def test_raw_json_fields_as_the_proxy_holds_them_are_written_as_deltas(tmp_path):
    """Inside the proxy the bodies and the engine's prompt ids are raw JSON bytes (RawJSON/RawIds):
    the writer parses them to find what is new, and the reader gets the same values back."""
    from polar_proxy import jsonutil

    recs = growing_session("s", 5)
    w = CaptureWriter(tmp_path)
    for r in recs:
        raw = dataclasses.replace(
            r, native_request=jsonutil.raw_json(orjson.dumps(r.native_request)),
            normalized_request=jsonutil.raw_json(orjson.dumps(r.normalized_request)),
            prompt_token_ids=jsonutil.RawIds(orjson.dumps(r.prompt_token_ids), len(r.prompt_token_ids)))
        w.write(raw)
    w.close()
    path = tmp_path / "sessions" / "s.jsonl"
    raw = list(read_capture_lines(path, expand=False))
    assert [bool(r["delta"].get("prompt_shared")) for r in raw] == [False, True, True, True, True]
    assert all("native_request" in r["delta"] and "normalized_request" in r["delta"] for r in raw[1:])
    got = list(read_capture_lines(path))
    assert [g["prompt_token_ids"] for g in got] == [r.prompt_token_ids for r in recs]
    assert [g["native_request"] for g in got] == [r.native_request for r in recs]
    assert [g["normalized_request"] for g in got] == [r.normalized_request for r in recs]


def test_raw_json_with_the_proxys_own_parse_is_digested_without_parsing_again(tmp_path, monkeypatch):
    """Issue 42: the proxy hands the writer the objects it parsed (the harness's body) or built
    (the chat request) with their bytes (``RawJSON.parsed``): the writer digests those and never
    parses the bytes again; the prompt ids (RawIds) are compared as bytes, never parsed either.
    The records read back are the same."""
    from polar_proxy import jsonutil

    parses = []
    monkeypatch.setattr(jsonutil.RawJSON, "value", lambda self: parses.append(self) or jsonutil.loads(self.json))
    recs = growing_session("s", 6)
    w = CaptureWriter(tmp_path)
    for r in recs:
        w.write(dataclasses.replace(
            r, native_request=jsonutil.raw_json(orjson.dumps(r.native_request), r.native_request),
            normalized_request=jsonutil.raw_json(orjson.dumps(r.normalized_request), r.normalized_request),
            prompt_token_ids=jsonutil.RawIds(orjson.dumps(r.prompt_token_ids), len(r.prompt_token_ids))))
    w.close()
    assert parses == []
    path = tmp_path / "sessions" / "s.jsonl"
    raw = list(read_capture_lines(path, expand=False))
    assert [bool(r["delta"].get("prompt_shared")) for r in raw] == [False] + [True] * 5
    got = list(read_capture_lines(path))
    assert [g["prompt_token_ids"] for g in got] == [r.prompt_token_ids for r in recs]
    assert [g["native_request"] for g in got] == [r.native_request for r in recs]
    assert [g["normalized_request"] for g in got] == [r.normalized_request for r in recs]


def test_prompt_bytes_share_only_whole_ids_and_refuse_what_would_not_read_back():
    """The writer compares prompts as JSON bytes: a shared id must be whole in both (``[1,2,34]``
    vs ``[1,2,3]`` share 2 ids, not 3), the tail is exactly the new ids, and ids that would not
    read back as the same int32 ids are not written as a delta."""
    rng = np.random.default_rng(3)
    for _ in range(2000):
        a = rng.integers(0, int(rng.choice([3, 20, 1000, 150_000])), int(rng.integers(0, 40))).tolist()
        b = a[: int(rng.integers(0, len(a) + 1))] + rng.integers(0, 30, int(rng.integers(0, 6))).tolist()
        pa, pb = cd.prompt_json(a), cd.prompt_json(b)
        n, at = pb.shared_with(pa.body)
        true = 0
        while true < min(len(a), len(b)) and a[true] == b[true]:
            true += 1
        assert true - 1 <= n <= true and a[:n] == b[:n] and pb.size == len(b)
        assert orjson.loads(b"[" + pb.body[at:] + b"]") == b[n:]
    assert cd.prompt_json([1, 2, 34]).shared_with(cd.prompt_json([1, 2, 3]).body)[0] == 2
    for bad in ([1.0], [-1], [True], [2**31], [10**9], [2**70]):
        assert cd.prompt_json(bad) is None, bad
    assert cd.prompt_json([999_999_999]).size == 1 and cd.prompt_json([]).size == 0


def test_a_session_of_prompts_with_every_kind_of_boundary_reads_back(tmp_path):
    """End to end through the writer and the reader: prompts that extend, shrink, and differ
    inside an id (``...,12`` then ``...,123``), as lists and as the engine's bytes."""
    from polar_proxy import jsonutil

    base = list(range(100, 140))
    prompts = [base, base + [12], base + [123, 5], base[:30], base[:30] + [7] * 20, base[:29] + [1001] * 25]
    w = CaptureWriter(tmp_path)
    for i, p in enumerate(prompts):
        ids = jsonutil.RawIds(orjson.dumps(p), len(p)) if i % 2 else p
        w.write(CallRecord(call_id=f"c{i}", session_id="b", call_index=i, prompt_token_ids=ids))
    w.close()
    path = tmp_path / "sessions" / "b.jsonl"
    assert sum(bool(r["delta"].get("prompt_shared")) for r in read_capture_lines(path, expand=False)) == 5
    assert [g["prompt_token_ids"] for g in read_capture_lines(path)] == prompts
