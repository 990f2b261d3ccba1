"""Capture cost: the crash-safe writer per call, and the proxy's memory over 10,000 calls.

1. Writer microbenchmark (``polar_proxy.capture.CaptureWriter``): realistic records (a Pi-sized
   call, ~1.4k prompt ids and a 5 kB request; a Qwen-Code-sized call, ~17k prompt ids and an
   80 kB request; both with 200 sampled ids and logprobs) encoded and appended with one
   ``os.write`` each: one session, 64 sessions, 1,000 sessions (more than the descriptor cache
   holds, so files are reopened), and with ``fsync``. Encoding alone is timed too.
2. Memory held by the real proxy (mitmdump + addon) over 10,000 calls of the harness-fixture mix
   (all four providers, streamed and whole) from 16 concurrent sessions: RSS sampled at 1k, 5k and
   10k calls. A proxy that keeps anything per call grows linearly; the goal is flat.

Run: ``.venv/bin/python benchmarks/bench_capture.py`` (``--calls``, ``--skip-memory``, ``--json``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

console = Console() if sys.stdout.isatty() else Console(width=150)
app = typer.Typer(add_completion=False)


def make_record(fixture: str, provider: str, n_prompt: int, session: str, i: int):
    from polar_core.schema import CallRecord

    fx = common.load_fixture(fixture, provider)
    chat = common.chat_equivalent(fx, True)
    return CallRecord(
        call_id=f"{session}-{i:08d}", session_id=session, call_index=i, provider=provider, harness="pi",
        requested_model="fake", served_model=common.SERVED_MODEL, upstream="http://127.0.0.1:8000", stream=True,
        native_request=fx.body, normalized_request=chat, native_path=fx.path,
        prompt_token_ids=[(7919 * k) % 151_000 for k in range(n_prompt)],
        sampled_token_ids=[(104_729 * k) % 151_000 for k in range(200)],
        sampled_logprobs=[-((k * 37) % 1000) / 997.0 for k in range(200)],
        output_text="word " * 150, output_tool_calls=[{"id": "call_1", "name": "bash", "arguments": '{"command": "ls"}'}],
        prompt_tokens=n_prompt, completion_tokens=200, finish_reason="tool_calls",
        t_request_in=time.time(), t_upstream_sent=time.time(), t_response_out=time.time())


def time_writes(record, n: int, sessions: int, fsync: bool) -> dict[str, float]:
    from polar_proxy.capture import CaptureWriter

    with tempfile.TemporaryDirectory(prefix="polar-bench-capture-") as d:
        w = CaptureWriter(d, fsync=fsync)
        names = [f"s{k:04d}" for k in range(sessions)]
        w.write(record)  # warm: directory, first descriptor
        t0 = time.perf_counter()
        for i in range(n):
            record.session_id = names[i % sessions]
            w.write(record)
        dt = time.perf_counter() - t0
        size = w.bytes / w.records
        w.close()
    record.session_id = "s0000"
    return {"us_per_call": 1e6 * dt / n, "bytes": size, "mb_s": size * n / dt / 1e6}


def time_encode(record, n: int) -> float:
    from polar_proxy.capture import encode_record

    t0 = time.perf_counter()
    for _ in range(n):
        encode_record(record)
    return 1e6 * (time.perf_counter() - t0) / n


def writer_bench(quick: bool) -> list[dict[str, Any]]:
    rows = []
    shapes = [("Pi-sized (pi.chat.second, 1.4k prompt ids)", "pi.chat.second", "openai_chat", 1_400, 3000),
              ("Qwen-Code-sized (qwen-code.second, 17k prompt ids)", "qwen-code.second", "openai_chat", 17_300, 400)]
    for label, fixture, provider, n_prompt, n in shapes:
        n = n // 5 if quick else n
        rec = make_record(fixture, provider, n_prompt, "s0000", 0)
        enc = min(time_encode(rec, max(50, n // 4)) for _ in range(3))
        for sessions, fsync in ((1, False), (64, False), (1000, False), (1, True)):
            m = n if not fsync else max(20, n // 20)
            r = min((time_writes(rec, m, sessions, fsync) for _ in range(3)), key=lambda x: x["us_per_call"])
            rows.append({"record": label, "sessions": sessions, "fsync": fsync, "encode_us": enc, **r})
    return rows


def memory_bench(calls: int, sessions: int, checkpoints: list[int]) -> dict[str, Any]:
    from polar_proxy.process import ProxyProcess

    import bench_proxy

    fixtures = [common.load_fixture(n, p) for n, p in common.MIX]
    samples = []
    with tempfile.TemporaryDirectory(prefix="polar-bench-mem-") as tmp_s:
        tmp = Path(tmp_s)
        up = common.scripted_upstream().start()
        proxy = None
        try:
            url = up.ready_url.rsplit("/", 1)[0]
            proxy = ProxyProcess(url, tmp / "captures", confdir=tmp / "mitm", served_model=common.SERVED_MODEL).start()
            plan = bench_proxy.build_plans({"polar": proxy.url}, fixtures, delay_ms=0)["mix-polar"]
            pid = proxy.proc.pid
            with common.LoadGen() as lg:
                lg.load("mix", plan)
                warm = lg.calls("mix", sessions, 200, session_prefix="mem")
                samples.append({"calls": 0, "rss": common.rss_bytes(pid), "errors": warm["errors"]})
                done, errors, t0 = 0, 0, time.perf_counter()
                for cp in checkpoints:
                    r = lg.calls("mix", sessions, cp - done, session_prefix="mem")
                    done, errors = cp, errors + r["errors"]
                    samples.append({"calls": cp, "rss": common.rss_bytes(pid), "errors": errors,
                                    "seconds": time.perf_counter() - t0})
                    console.print(f"  {cp:>6} calls  RSS {samples[-1]['rss'] / 2**20:7.1f} MiB  errors {errors}")
            status = proxy.control.status()
            lines = sum(f.read_bytes().count(b"\n") for f in (tmp / "captures" / "sessions").glob("*.jsonl"))
        finally:
            if proxy is not None:
                proxy.stop()
            up.stop()
    return {"samples": samples, "captured": status["captured"], "lines": lines, "sessions": sessions}


@app.command()
def main(
    calls: int = typer.Option(10_000, help="Calls through the proxy for the memory measurement."),
    sessions: int = typer.Option(16, help="Concurrent sessions of the memory measurement."),
    skip_memory: bool = typer.Option(False, help="Only the writer microbenchmark."),
    quick: bool = typer.Option(False, help="Fewer writer iterations."),
    json_out: Path = typer.Option(None, "--json", help="Also write the results here."),
) -> None:
    console.print(f"[bold]Polar capture benchmark[/] cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f} "
                  f"tmp={tempfile.gettempdir()}")
    rows = writer_bench(quick)
    t = Table(title="Crash-safe capture writer (one os.write per record; best of 3 runs)")
    for col in ("record", "sessions", "fsync", "bytes/record", "encode µs", "encode+write µs", "MB/s"):
        t.add_column(col, justify="left" if col == "record" else "right")
    for r in rows:
        t.add_row(r["record"], str(r["sessions"]), "yes" if r["fsync"] else "no", f"{r['bytes']:,.0f}",
                  f"{r['encode_us']:.0f}", f"{r['us_per_call']:.0f}", f"{r['mb_s']:.0f}")
    console.print(t)
    result: dict[str, Any] = {"writer": rows}
    if not skip_memory:
        checkpoints = sorted({max(1, calls // 10), max(1, calls // 2), calls})
        console.print(f"memory: {calls} calls through the proxy, {sessions} sessions")
        mem = memory_bench(calls, sessions, checkpoints)
        result["memory"] = mem
        s = mem["samples"]
        base = s[1]
        t = Table(title=f"Proxy RSS over {calls:,} calls (fixture mix, {sessions} sessions)")
        for col in ("calls", "RSS MiB", "since first checkpoint MiB", "bytes per call since", "errors"):
            t.add_column(col, justify="right")
        for x in s:
            grow = x["rss"] - base["rss"]
            per = grow / (x["calls"] - base["calls"]) if x["calls"] > base["calls"] else float("nan")
            t.add_row(f"{x['calls']:,}" if x["calls"] else "after warm-up", f"{x['rss'] / 2**20:.1f}",
                      f"{grow / 2**20:+.1f}" if x["calls"] >= base["calls"] else "", f"{per:+.0f}", str(x["errors"]))
        console.print(t)
        last, mid = s[-1], s[-2]
        per_call = (last["rss"] - mid["rss"]) / max(1, last["calls"] - mid["calls"])
        ok = per_call < 256 and last["rss"] - base["rss"] < 16 * 2**20 and last["errors"] == 0
        console.print(f"captured {mem['captured']:,} records ({mem['lines']:,} lines); growth between the last two "
                      f"checkpoints {per_call:+.0f} bytes/call -> "
                      + ("[green]PASS[/] (flat)" if ok else "[red]FAIL[/] (grows with calls)"))
        result["memory_pass"] = ok
    if json_out:
        json_out.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    app()
