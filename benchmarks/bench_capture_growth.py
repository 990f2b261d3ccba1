"""Capture size against session length, full records (schema 2) vs deltas (schema 3).

Issue 27: with every record holding its full prompt ids and full requests, a session's file grows
with the square of its length (a live 146-call Pi session: 21.7 MB, 79 times the last prompt's
ids). This benchmark writes the same synthetic sessions both ways and prints bytes per session
against calls per session (10 to 200 calls, prompts growing to 30k ids), next to the floor of
what a session must hold: the final prompt's ids + all sampled ids + the last request (native and
normalized, as the proxy stores both). The delta format must stay within 3 times that floor.

Then it reads a 200-call session into trajectories (calls frame from a cold cache, prefix merge),
old vs new, each in a fresh process: wall time and peak RSS.

Sessions are synthetic and deterministic (no tokenizer needed): exact history, so each prompt is
the previous one plus its sampled ids and a tool result; each request re-sends the whole
conversation (text ~4 characters per id) with a fixed 8 kB tool list. Logprobs are stored in
full in both formats (not counted in the floor).

Run: ``.venv/bin/python benchmarks/bench_capture_growth.py`` (``--json``; default
``benchmarks/results/capture_growth.json``). Takes about a minute.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
console = Console() if sys.stdout.isatty() else Console(width=150)
app = typer.Typer(add_completion=False)

FINAL_PROMPT = 30_000
FIRST_PROMPT = 2_000
SAMPLED = 80


def session(sid: str, n: int, seed: int = 0) -> list[Any]:
    """``n`` records of one session whose prompt grows from 2k to 30k ids."""
    from polar_core.schema import CallRecord

    rng = np.random.default_rng(seed)

    def text(n: int) -> str:  # random letters and spaces: as incompressible as real text, or more
        return rng.integers(96, 123, n).astype(np.uint8).tobytes().decode().replace("`", " ")

    grow = (FINAL_PROMPT - FIRST_PROMPT) // max(1, n - 1) - SAMPLED
    prompt = rng.integers(0, 150_000, FIRST_PROMPT).tolist()
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Run a tool. " * 75,
                                               "parameters": {"type": "object", "properties": {}}}} for i in range(8)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": text(4 * (FIRST_PROMPT // 2))},
                                      {"role": "user", "content": "Fix the failing test."}]
    out = []
    for i in range(n):
        sampled = rng.integers(0, 150_000, SAMPLED).tolist()
        chat = {"model": "qwen", "messages": list(messages), "tools": tools, "stream": True, "temperature": 1.0}
        native = {"model": "gpt-x", "messages": list(messages), "tools": tools, "stream": True}
        out.append(CallRecord(
            call_id=f"{sid}-{i:04d}{'0' * 24}", session_id=sid, call_index=i, provider="openai_chat", harness="pi",
            status="ok", finish_reason="tool_calls", native_request=native, normalized_request=chat,
            prompt_token_ids=list(prompt), sampled_token_ids=sampled,
            sampled_logprobs=(-rng.random(SAMPLED) * 3).round(6).tolist(), output_text=text(4 * SAMPLED),
            prompt_tokens=len(prompt), completion_tokens=SAMPLED, t_request_in=1e9 + i, t_response_out=1e9 + i + 0.5,
            sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": None,
                      "logprobs_mode": "processed_logprobs", "defaults_from": "vllm"},
        ))
        messages = messages + [{"role": "assistant", "content": out[-1].output_text},
                               {"role": "tool", "tool_call_id": f"c{i}", "content": text(4 * grow)}]
        prompt = prompt + sampled + rng.integers(0, 150_000, max(0, grow)).tolist()
    return out


def floor_bytes(recs: list[Any]) -> int:
    last = recs[-1]
    return (len(orjson.dumps(last.prompt_token_ids)) + sum(len(orjson.dumps(r.sampled_token_ids)) for r in recs)
            + len(orjson.dumps(last.native_request)) + len(orjson.dumps(last.normalized_request)))


def write(capture: Path, recs: list[Any], delta: bool) -> tuple[int, float]:
    from polar_proxy.capture import CaptureWriter

    w = CaptureWriter(capture, delta=delta)
    t0 = time.perf_counter()
    for r in recs:
        w.write(r)
    dt = time.perf_counter() - t0
    w.close()
    return w.bytes, dt


def flows_bytes(recs: list[Any], body_limit: int = 4 << 20) -> dict[str, int]:
    """What ``flows.mitm`` holds for the same session: one saved flow per call as the proxy
    annotates it (the harness's request body, the answer's body up to ``polar_flow_body_limit``,
    ``flow.metadata["polar"]`` with the token ids and logprobs as JSON bytes), written with
    mitmproxy's own FlowWriter; and the same file compressed (zstd -3), what rotating and
    compressing saved flows would keep."""
    import io

    import zstandard
    from mitmproxy import io as mio
    from mitmproxy.test import tflow

    from polar_core.flowmeta import META_KEY, TOKENS_KEY, pack_tokens

    buf = io.BytesIO()
    w = mio.FlowWriter(buf)
    parts = {"request_bodies": 0, "prompt_ids_meta": 0}
    for r in recs:
        f = tflow.tflow(resp=True)
        f.request.content = orjson.dumps(r.native_request)
        f.response.content = orjson.dumps({"choices": [{"message": {"content": r.output_text}}]})[:body_limit]
        tokens = pack_tokens(r.prompt_token_ids, r.sampled_token_ids, r.sampled_logprobs)
        f.metadata[META_KEY] = {"session": r.session_id, "call_index": r.call_index, "call_id": r.call_id,
                                TOKENS_KEY: tokens, "output_text": r.output_text}
        parts["request_bodies"] += len(f.request.content)
        parts["prompt_ids_meta"] += len(tokens["prompt_token_ids"])
        w.add(f)
    data = buf.getvalue()
    return {"flows_bytes": len(data), "flows_zstd_bytes": len(zstandard.ZstdCompressor(level=3).compress(data)), **parts}


READER = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from polar_analysis import frames, trajectories
t_import = time.perf_counter() - t0
rss_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
lf = frames.calls(sys.argv[1], cache_dir=sys.argv[2], rewards=None)
lf.select("call_id").collect()
t_frame = time.perf_counter() - t0
t1 = time.perf_counter()
df, stats = trajectories.build(lf, "prefix-merge")
t_build = time.perf_counter() - t1
print(json.dumps({"frame_s": t_frame, "build_s": t_build, "total_s": t_frame + t_build, "import_s": t_import,
                  "sequences": df.height, "merges": stats.merges, "coverage": stats.coverage,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_after_imports_mib": rss_import}))
"""


def read_cost(capture: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        out = subprocess.run([sys.executable, "-c", READER, str(capture), cache], capture_output=True, text=True,
                             cwd=ROOT, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


@app.command()
def main(
    calls: str = typer.Option("10,25,50,100,200", help="Calls per session, comma separated."),
    json_out: Path = typer.Option(ROOT / "benchmarks" / "results" / "capture_growth.json", "--json"),
    read_calls: int = typer.Option(200, help="Session length for the read measurement (0: skip)."),
) -> None:
    console.print(f"[bold]Capture growth[/] cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in calls.split(",")]:
            recs = session(f"s{n}", n)
            old, t_old = write(Path(tmp) / f"old{n}", recs, False)
            new, t_new = write(Path(tmp) / f"new{n}", recs, True)
            fl = floor_bytes(recs)
            fb = flows_bytes(recs)
            rows.append({**fb, "calls": n, "final_prompt_ids": len(recs[-1].prompt_token_ids),
                         "prompt_ids_in_records": sum(len(r.prompt_token_ids) for r in recs),
                         "old_bytes": old, "new_bytes": new, "floor_bytes": fl, "old_over_floor": old / fl,
                         "new_over_floor": new / fl, "old_write_ms_per_call": t_old / n * 1e3,
                         "new_write_ms_per_call": t_new / n * 1e3})
        t = Table(title="Bytes per session: full records (schema 2) vs deltas (schema 3)")
        for col in ("calls", "final prompt ids", "old MB", "new MB", "floor MB", "old / floor", "new / floor",
                    "write ms/call old", "new", "flows.mitm MB", "of it requests", "prompt ids", "zstd MB"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(str(r["calls"]), f"{r['final_prompt_ids']:,}", f"{r['old_bytes'] / 1e6:.2f}",
                      f"{r['new_bytes'] / 1e6:.2f}", f"{r['floor_bytes'] / 1e6:.2f}", f"{r['old_over_floor']:.1f}",
                      f"{r['new_over_floor']:.2f}", f"{r['old_write_ms_per_call']:.2f}",
                      f"{r['new_write_ms_per_call']:.2f}", f"{r['flows_bytes'] / 1e6:.2f}",
                      f"{r['request_bodies'] / 1e6:.2f}", f"{r['prompt_ids_meta'] / 1e6:.2f}",
                      f"{r['flows_zstd_bytes'] / 1e6:.2f}")
        console.print(t)
        ok = all(r["new_over_floor"] <= 3 for r in rows)
        console.print("new format within 3x of the floor at every length: " + ("[green]PASS[/]" if ok else "[red]FAIL[/]"))
        result: dict[str, Any] = {"sizes": rows, "within_3x": ok}
        if read_calls:
            recs = session("read", read_calls)
            reads = {}
            for fmt, delta in (("old", False), ("new", True)):
                cap = Path(tmp) / f"read-{fmt}"
                write(cap, recs, delta)
                reads[fmt] = read_cost(cap)
            t = Table(title=f"Reading a {read_calls}-call session into trajectories (cold cache, own process)")
            for col in ("format", "calls frame s", "prefix merge s", "total s", "peak RSS MiB", "of it after imports",
                        "sequences", "coverage"):
                t.add_column(col, justify="right")
            for fmt, r in reads.items():
                t.add_row(fmt, f"{r['frame_s']:.2f}", f"{r['build_s']:.2f}", f"{r['total_s']:.2f}",
                          f"{r['peak_rss_mib']:.0f}", f"{r['peak_rss_mib'] - r['rss_after_imports_mib']:.0f}",
                          str(r["sequences"]), f"{r['coverage']:.3f}")
            console.print(t)
            result["read"] = {"calls": read_calls, **reads}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {json_out}")


if __name__ == "__main__":
    app()
