"""Isolation: 100 sessions interleaved through one proxy; no record lands in another session's file.

Each session is registered with its own task id through the control API, which issues it a key;
sessions send it four different ways (x-polar-session + Bearer key, Bearer, x-api-key,
x-goog-api-key), and every call
carries a nonce of its session in the user text. Each session file must hold exactly that
session's calls, in its own order, with its own task id, nonce, request and answer tokens.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

N_SESSIONS = 100
CALLS = 4
VIA = ("header", "bearer", "x-api-key", "x-goog-api-key")


@pytest.mark.slow
def test_100_interleaved_sessions_stay_apart(rel, upstream_proc, proxies):
    import aiohttp

    proxy = proxies(upstream_proc.url)
    sids = [f"iso-{k:03d}" for k in range(N_SESSIONS)]
    keys = proxy.control.register_sessions([{"session_id": s, "task_id": f"task-{s}", "group_id": f"g-{k % 7}",
                                             "sample_index": k} for k, s in enumerate(sids)])["keys"]
    load = rel.Load(proxy.url)
    rng = random.Random(7)

    async def session(k: int, s: aiohttp.ClientSession) -> None:
        for i in range(CALLS):
            await asyncio.sleep(rng.random() * 0.05)  # interleave calls of different sessions
            provider = rel.PROVIDERS[(k + i) % 4]
            words = 3 + (k % 5) + i  # answers of different lengths per session and call
            await load.call(s, provider, f"#scenario:words:{words}", (k + i) % 2 == 0, sids[k],
                            f"nonce-{sids[k]}-{i}", session_via=VIA[k % 4], key=keys[sids[k]])

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await asyncio.gather(*(session(k, s) for k in range(N_SESSIONS)))

    asyncio.run(main())
    bad = [(r.session, r.status, r.body[:200]) for r in load.results if not r.complete]
    assert len(load.results) == N_SESSIONS * CALLS and not bad, bad[:3]

    files = sorted((proxy.capture_dir / "sessions").glob("*.jsonl"))
    assert [f.stem for f in files] == sids
    for k, (sid, path) in enumerate(zip(sids, files)):
        records = rel.read_jsonl(path)
        assert len(records) == CALLS, (sid, len(records))
        records.sort(key=lambda r: r["call_index"])
        assert [r["call_index"] for r in records] == list(range(CALLS))
        assert [r["t_request_in"] for r in records] == sorted(r["t_request_in"] for r in records)
        for i, rec in enumerate(records):
            assert rec["session_id"] == sid and rec["task_id"] == f"task-{sid}" and rec["sample_index"] == k
            assert rec["session_source"] == "key"  # every way: bound by the issued key
            native = json.dumps(rec["native_request"])
            normalized = json.dumps(rec["normalized_request"])
            assert f"nonce-{sid}-{i}" in native and f"nonce-{sid}-{i}" in normalized
            others = {f"nonce-{o}-" for o in sids if o != sid}
            assert not any(o in native or o in normalized for o in others)
            assert rec["provider"] == rel.PROVIDERS[(k + i) % 4] and rec["status"] == "ok"
            assert len(rec["sampled_token_ids"]) == 3 + (k % 5) + i + 1  # words + end of sequence
    status = proxy.control.status()
    assert status["captured"] == N_SESSIONS * CALLS and status["errors"] == 0 and status["in_flight"] == 0
