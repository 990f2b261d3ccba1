"""Crash safety: kill -9 the proxy while 64 sessions are mid-call; nothing a client received is lost.

Every call whose answer reached its client in full must be in the captures, readable with the
analysis loader (polar_analysis.frames), with its sampled tokens. A torn line and a garbage line
left in the files never block loading. A restarted proxy continues into the same capture
directory: call indexes of a session go on where they stopped, and the loader recovers the record
that the restart appended behind the torn bytes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import polars as pl
import pytest

from polar_analysis import frames

SESSIONS = 64
#: 12 words + end of sequence per answer, 4 ms per token: every call is in flight for ~50 ms.
TEXT = "#scenario:words:12 #delay:4"


async def _run_sessions(rel, base_url: str, phase: str, n: int, *, stop_after: float | None = None,
                        calls_per_session: int | None = None, on_running=None):
    """``n`` sessions calling in a loop (all providers, streamed and whole) until a call fails,
    ``calls_per_session`` is reached, or ``stop_after`` seconds passed."""
    import aiohttp

    load = rel.Load(base_url)
    t_end = time.monotonic() + stop_after if stop_after else None

    async def session_loop(k: int, s: aiohttp.ClientSession) -> None:
        i = 0
        while True:
            if calls_per_session is not None and i >= calls_per_session:
                return
            if t_end is not None and time.monotonic() > t_end:
                return
            provider = rel.PROVIDERS[(k + i) % 4]
            r = await load.call(s, provider, TEXT, (k + i // 4) % 2 == 0, f"crash-{k}", f"nonce-{k}-{i}-{phase}",
                                timeout=20)
            i += 1
            if not r.complete:
                return  # the proxy is gone: this session stops

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = [asyncio.create_task(session_loop(k, s)) for k in range(n)]
        if on_running is not None:
            await on_running(load)
        await asyncio.gather(*tasks)
    return load


def _captured(capture_dir, report=None) -> pl.DataFrame:
    lf = frames.calls(capture_dir, rewards=None, report=report)
    return (lf.with_columns(nonce=pl.col("native_request").str.extract(r"(nonce-\d+-\d+-p\d)", 1))
            .select("session_id", "call_index", "nonce", "status", "provider", "stream", "sampled_token_ids",
                    "sampled_logprobs", "prompt_token_ids")
            .collect())


@pytest.mark.slow
def test_kill_9_mid_run_then_restart(rel, upstream_proc, proxies, tmp_path):
    capture = tmp_path / "captures"
    proxy = proxies(upstream_proc.url, capture)
    pgid = proxy.proc.pid

    async def kill_when_busy(load) -> None:
        # Let every session complete a few calls, then kill while calls are in flight.
        deadline = time.monotonic() + 30
        while sum(r.complete for r in load.results) < 3 * SESSIONS and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        os.killpg(pgid, signal.SIGKILL)

    load = asyncio.run(_run_sessions(rel, proxy.url, "p1", SESSIONS, stop_after=60, on_running=kill_when_busy))
    assert proxy.proc.wait(5) == -signal.SIGKILL
    received = {r.nonce: r for r in load.results if r.complete}
    cut_short = [r for r in load.results if not r.complete]
    assert len(received) >= 3 * SESSIONS and cut_short, "the kill must land while calls are in flight"

    # 1. Everything the clients fully received is in the captures, readable, with its tokens.
    report = frames.ScanReport()
    df = _captured(capture, report)
    ok = df.filter(pl.col("status") == "ok")
    got = dict(zip(ok["nonce"].to_list(), ok.iter_rows(named=True)))
    missing = sorted(set(received) - set(got))
    assert not missing, f"{len(missing)} received calls missing from the captures, e.g. {missing[:5]}"
    for nonce, r in received.items():
        row = got[nonce]
        assert row["session_id"] == r.session and row["provider"] == r.provider and row["stream"] == r.stream
        assert len(row["sampled_token_ids"]) == 13 and len(row["sampled_logprobs"]) == 13  # 12 words + EOS
        assert row["prompt_token_ids"]
    assert report.totals()["invalid"] == 0

    # 2. Damage the files the way a crash elsewhere could: a torn record and a garbage line.
    files = sorted((capture / "sessions").glob("crash-*.jsonl"))
    torn_file, garbage_file = files[0], files[1]
    whole_line = torn_file.read_bytes().split(b"\n")[0]
    with open(torn_file, "ab") as f:
        f.write(whole_line[: len(whole_line) // 2])  # no newline: a write cut by the crash
    with open(garbage_file, "ab") as f:
        f.write(b"\x00\xff{not json at all\n")
    indexes_before = df.group_by("session_id").agg(pl.col("call_index").max().alias("last"))
    last = dict(zip(indexes_before["session_id"].to_list(), indexes_before["last"].to_list()))

    # 3. Restart into the same directory and continue the same sessions.
    proxy2 = proxies(upstream_proc.url, capture)
    load2 = asyncio.run(_run_sessions(rel, proxy2.url, "p2", SESSIONS, calls_per_session=2))
    assert all(r.complete for r in load2.results), [r.error or r.body[:200] for r in load2.results if not r.complete][:3]
    proxy2.stop()

    report = frames.ScanReport()
    df = _captured(capture, report)
    totals = report.totals()
    assert totals["invalid"] >= 2 and totals["recovered"] >= 1  # garbage skipped, glued record recovered
    nonces = set(df.filter(pl.col("status") == "ok")["nonce"].to_list())
    assert set(received) <= nonces and {r.nonce for r in load2.results} <= nonces
    # call indexes continue after the restart, never reused within a session
    dup = df.group_by("session_id").agg(n=pl.len(), u=pl.col("call_index").n_unique())
    assert dup.filter(pl.col("n") != pl.col("u")).is_empty()
    p2 = df.filter(pl.col("nonce").str.ends_with("-p2"))
    assert p2.height == 2 * SESSIONS
    for sid, idx in zip(p2["session_id"].to_list(), p2["call_index"].to_list()):
        assert idx > last.get(sid, -1), (sid, idx, last.get(sid))
