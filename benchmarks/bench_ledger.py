"""The exact-history ledger's memory and the stall its rebuild causes (issue 24, item 3).

1. **Memory of live sessions**: ``--sessions`` sessions of ``--calls`` calls each whose prompts grow
   from ``--start`` to ``--end`` ids (each call = the previous prompt + its sampled ids + new ids,
   as exact history builds them) are loaded into one ledger; the Python heap it holds is measured
   with tracemalloc. Also one long session (100 calls, 5k-25k-id prompts, as in the issue).
2. **Stall of other streams during a rebuild**: an asyncio loop runs a 1 ms ticker (a stand-in for
   the relay of other sessions' streams) while the ledger is rebuilt from a 100-call capture file
   through the proxy's own path (``ExactHistory``); the longest gap between ticks is the stall.

    python benchmarks/bench_ledger.py                 # prints the figures, writes benchmarks/results/ledger.json
    python benchmarks/bench_ledger.py --label before  # the key the JSON is stored under

Runs on the ledger module of the checkout it sits in, so running it before and after a change of
``addon/ledger.py`` gives the before / after figures (kept side by side in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson  # noqa: E402

from polar_proxy import ledger as L  # noqa: E402
from polar_proxy.exact_history import ExactHistory  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "ledger.json"


def session_records(sid: str, calls: int, start: int, end: int, seed: int) -> list[dict[str, Any]]:
    """Capture records of one exact-history session: every prompt = the previous prompt + its sampled
    ids + an end of turn + new ids (tool results, a user turn); the rendered ids re-render every
    earlier answer (other ids), as the template does."""
    rnd = random.Random(seed)
    step = max(1, (end - start) // max(1, calls - 1))
    prompt = [rnd.randrange(10, 50_000) for _ in range(start)]
    rendered = list(prompt)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": f"task {sid}"}]
    out = []
    for i in range(calls):
        sampled = [rnd.randrange(10, 50_000) for _ in range(rnd.randrange(20, 200))] + [2]
        text = f"answer {i}"
        rec = {"record_type": "call", "status": "ok", "session_id": sid, "call_index": i,
               "served_model": "m", "finish_reason": "stop", "stop_reason": None,
               "normalized_request": {"model": "m", "messages": list(messages)},
               "prompt_token_ids": list(prompt), "sampled_token_ids": sampled,
               "output_text": text, "output_reasoning": "", "output_tool_calls": [],
               "history": "exact" if i == 0 else "exact",
               "rendered_prompt_diff": L.rendered_diff(prompt, rendered)}
        out.append(rec)
        new = [rnd.randrange(10, 50_000) for _ in range(max(1, step - len(sampled)))]
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": f"next {i}"}]
        prompt = prompt + sampled + new
        rendered = rendered + [rnd.randrange(10, 50_000) for _ in range(len(sampled))] + new
    return out


def held_bytes(sids: list[str], make: Any) -> tuple[int, int, int]:
    """Bytes the ledger holds for these sessions (tracemalloc), the number of entries, and the ids of
    the sessions' last prompts plus every sampled id (what a linear store cannot go below)."""
    ids = 0

    def loader(sid: str) -> list[dict[str, Any]]:
        nonlocal ids
        recs = make(sid)
        ids += len(recs[-1]["prompt_token_ids"]) + sum(len(r["sampled_token_ids"]) for r in recs)
        return recs

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    ledger = L.Ledger(max_sessions=len(sids) + 1, loader=loader)
    for sid in sids:
        ledger.session(sid)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    n = sum(len(s.entries) for s in ledger.sessions.values())
    del ledger
    return used, n, ids


async def stall(path: Path, sid: str, ticks_ms: float = 1.0) -> dict[str, float]:
    """The longest gap between 1 ms ticks while the proxy's ExactHistory rebuilds ``sid``."""
    exact = ExactHistory(None, capture_path=lambda s: path)  # type: ignore[arg-type]
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(ticks_ms / 1000)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = asyncio.get_running_loop().create_task(ticker())
    await asyncio.sleep(0.05)
    idle0 = len(gaps)
    await asyncio.sleep(0.5)  # the same ticker with nothing else running: the machine's own noise
    n_idle = len(gaps)
    idle = max(gaps[idle0:n_idle])
    t0 = time.perf_counter()
    if hasattr(exact, "ensure_session"):  # the rebuild off the event loop
        await exact.ensure_session(sid)
    else:  # the path of the old code: the ledger is read inside the request coroutine
        exact.ledger.session(sid)
    took = time.perf_counter() - t0
    await asyncio.sleep(0.05)
    done.set()
    await t
    assert exact.ledger.sessions[sid].entries, "nothing rebuilt"
    return {"rebuild_s": round(took, 3), "max_tick_gap_ms": round(max(gaps[n_idle:]) * 1000, 1),
            "max_tick_gap_idle_ms": round(idle * 1000, 1), "ticks": len(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--start", type=int, default=1000)
    ap.add_argument("--end", type=int, default=5000)
    ap.add_argument("--label", default="after")
    args = ap.parse_args()
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"),
                           "config": {"sessions": args.sessions, "calls": args.calls, "prompt_ids": [args.start, args.end]}}

    used, n, ids = held_bytes([f"s{i}" for i in range(args.sessions)],
                              lambda sid: session_records(sid, args.calls, args.start, args.end, int(sid[1:])))
    out["live_sessions"] = {"sessions": args.sessions, "entries": n, "held_mb": round(used / 2**20, 1),
                            "final_prompt_plus_sampled_ids_mb_as_int32": round(ids * 4 / 2**20, 1)}
    print(f"{args.sessions} live sessions x {args.calls} calls ({args.start}-{args.end}-id prompts): "
          f"{used / 2**20:.1f} MB held ({n} entries; the last prompts + sampled ids as int32: {ids * 4 / 2**20:.1f} MB)")

    long = session_records("long", 100, 5000, 25000, 7)
    used, n, _ = held_bytes(["long"], lambda sid: long)
    out["one_long_session"] = {"calls": 100, "prompt_ids": [5000, 25000], "held_mb": round(used / 2**20, 2)}
    print(f"one 100-call session (5k-25k-id prompts): {used / 2**20:.2f} MB held")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "long.jsonl"
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in long))
        size = path.stat().st_size
        del long
        st = asyncio.run(stall(path, "long"))
    out["rebuild_stall"] = {"capture_mb": round(size / 2**20, 1), **st}
    print(f"rebuild of that session from its capture ({size / 2**20:.1f} MB): {st['rebuild_s']:.2f} s; "
          f"longest stall of the event loop (1 ms ticker): {st['max_tick_gap_ms']:.1f} ms "
          f"(with nothing running: {st['max_tick_gap_idle_ms']:.1f} ms)")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    allres = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    allres[args.label] = out
    RESULTS.write_text(json.dumps(allres, indent=2) + "\n")
    print(f"wrote {RESULTS} [{args.label}]")


if __name__ == "__main__":
    main()
