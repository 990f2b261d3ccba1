"""Proxy overhead: the same request mix sent directly, through bare mitmdump, Polar and LiteLLM.

Why these four: "directly" is the upstream's own cost; bare ``mitmdump`` in reverse mode (no
addon) is the floor of Polar's architecture; LiteLLM is the proxy other RL frameworks put in the
same place. Every target is measured in the same run, interleaved round by round (the order of
targets shuffled each round), against one scripted upstream that speaks vLLM's wire format, so
that load from other processes on the machine hits all of them alike. The ratios are the result;
absolute numbers depend on the machine.

Mix: the real harness requests in shared/fixtures (Pi in all four formats, Qwen Code's 80 kB
requests, Claude Code), first and second turns, each streamed and not. Polar gets the harness's
own request; directly and bare mitmproxy get its chat equivalent (Polar's own translation, so the
upstream does the same work); LiteLLM gets the native request for chat and Anthropic Messages and
the chat equivalent for Responses and Google.

Phases, all interleaved: latency (one session, every request of the mix in turn: added latency per
call against the median direct latency of the same request), streaming latency (first turns,
streamed, a plain "w0 w1 ..." answer with a delay before every token: first byte, first token and
total), throughput (1, 16 and 64 closed-loop sessions; req/s, and the proxy's CPU time per call,
which the machine's other load hardly changes).

CPUs: the proxy under test is pinned to CPU 0, the scripted upstream and the load generator (a
separate aiohttp process) to CPU 1 (``--no-pin`` to turn off).

Run: ``.venv/bin/python benchmarks/bench_proxy.py`` (``--help`` for rounds, durations, targets).
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGETS = ("direct", "mitmdump", "polar", "polar_relay", "litellm")
LABELS = {"direct": "directly (upstream)", "mitmdump": "bare mitmdump (reverse)", "polar": "Polar",
          "polar_relay": "Polar, relay only", "litellm": "LiteLLM proxy"}
#: Polar's variants: the default, and every stream through the relay (``polar_stream_at_once``
#: off), which shows what the at-once shortcut is worth when the proxy falls behind.
POLAR_VARIANTS = {"polar": {}, "polar_relay": {"polar_stream_at_once": False}}
console = Console() if sys.stdout.isatty() else Console(width=150)
app = typer.Typer(add_completion=False)


#: The streaming-latency phase: a plain-text answer "w0 w1 ... w19", a delay before every token.
#: Time to first token is when "w0" reaches the client: every wire format carries it in its first
#: content event (a first *byte* is not comparable: Google's format has no start event, so its
#: first byte is the first token, while chat's is an empty role chunk).
TTFT_WORDS = 20
FIRST_TOKEN = "w0"


def build_plans(urls: dict[str, str], fixtures: list[common.Fixture], *, delay_ms: int) -> dict[str, list[dict]]:
    """Per target: the mix (every fixture, streamed and whole) and the streaming-latency mix (first
    turns, streamed, a per-token delay so that a buffering proxy would show)."""
    plans: dict[str, list[dict]] = {}
    for target, base in urls.items():
        mix, ttfb = [], []
        for fx in fixtures:
            for stream in (True, False):
                spec = _spec(target, base, fx, stream, None)
                mix.append(spec)
                if stream and ".second" not in fx.name:
                    spec = _spec(target, base, fx, stream, f"#scenario:words:{TTFT_WORDS} #delay:{delay_ms}")
                    ttfb.append({**spec, "first_token": FIRST_TOKEN})
        plans[f"mix-{target}"] = mix
        plans[f"ttfb-{target}"] = ttfb
    return plans


def _spec(target: str, base: str, fx: common.Fixture, stream: bool, directive: str | None) -> dict:
    kind = f"{fx.name}/{'stream' if stream else 'whole'}"
    if target in POLAR_VARIANTS or (target == "litellm" and fx.provider in ("openai_chat", "anthropic")):
        path, headers, body = common.native_request(fx, stream)
        if target == "litellm" and fx.provider == "openai_chat":
            body = {**body, "logprobs": True, "return_token_ids": True}  # what an RL framework asks for
        if directive:
            body = common.with_directive(fx.provider, body, directive)
        if target == "litellm":
            headers = _litellm_auth(headers)
        return common.request_spec(kind, fx.provider, stream, base + path, headers, body)
    model = common.SERVED_MODEL
    if target == "litellm":  # LiteLLM routes by the requested name
        model = fx.path.split("/models/")[1].split(":")[0] if fx.provider == "google" else fx.body["model"]
    chat = common.chat_equivalent(fx, stream, model=model)
    if directive:
        chat = common.with_directive("openai_chat", chat, directive)
    auth = {k: v for k, v in fx.headers.items() if k.lower() in ("authorization", "user-agent")}
    if target == "litellm":
        auth = _litellm_auth(auth)
    return common.request_spec(kind, "openai_chat", stream, base + "/v1/chat/completions", auth, chat)


def _litellm_auth(headers: dict[str, str]) -> dict[str, str]:
    """The harness's headers with its API key replaced by LiteLLM's master key."""
    out = {k: v for k, v in headers.items() if k.lower() not in ("authorization", "x-api-key", "x-goog-api-key")}
    return {**out, "authorization": f"Bearer {common.LITELLM_KEY}", "x-api-key": common.LITELLM_KEY}


def summarize(lat: dict[str, list[dict]], ttfb: dict[str, list[dict]], thr: dict[str, dict[int, list[dict]]],
              n_mix: int) -> dict[str, dict[str, Any]]:
    """Per target: added latency percentiles (vs the median direct latency of the same request),
    streaming first byte / first token, throughput (median over rounds), CPU per call, errors."""
    direct_median = [statistics.median(r["t"] for r in lat["direct"] if r["i"] == i and r["ok"]) for i in range(n_mix)]
    for runs in ttfb.values():  # a complete stream whose first token was never seen is an error
        for r in runs:
            if r["ok"] and r.get("ttft") is None:
                r["ok"], r["error"] = False, "first token never seen in a complete stream"
    p50 = common.percentile
    direct_ttft = p50([r["ttft"] for r in ttfb.get("direct", []) if r["ok"]], 50)
    out: dict[str, dict[str, Any]] = {}
    for target in lat:
        ok = [r for r in lat[target] if r["ok"]]
        added = [r["t"] - direct_median[r["i"]] for r in ok]
        stream_ok = [r for r in ttfb.get(target, []) if r["ok"]]
        errors = sum(not r["ok"] for r in lat[target]) + sum(not r["ok"] for r in ttfb.get(target, []))
        errors += sum(m["errors"] for runs in thr.get(target, {}).values() for m in runs)
        samples = [r.get("error") for r in lat[target] + ttfb.get(target, []) if not r["ok"]][:3]
        samples += [e for runs in thr.get(target, {}).values() for m in runs for e in m["error_samples"]][:3]
        ttft = p50([r["ttft"] for r in stream_ok], 50)
        out[target] = {
            "calls": len(lat[target]),
            "latency_p50_ms": 1e3 * p50([r["t"] for r in ok], 50),
            "added_p50_ms": 1e3 * p50(added, 50),
            "added_p99_ms": 1e3 * p50(added, 99),
            "ttfb_p50_ms": 1e3 * p50([r["ttfb"] for r in stream_ok], 50),
            "ttft_p50_ms": 1e3 * ttft,
            "ttft_added_ms": 1e3 * (ttft - direct_ttft),
            "stream_total_p50_ms": 1e3 * p50([r["t"] for r in stream_ok], 50),
            "rps": {c: statistics.median(m["rps"] for m in runs) for c, runs in thr.get(target, {}).items()},
            "load_p50_ms": {c: 1e3 * statistics.median(m["p50"] for m in runs) for c, runs in thr.get(target, {}).items()},
            # CPU time of the target per call over every throughput run: the machine's other load
            # stretches wall time but hardly changes this
            "cpu_ms_per_call": statistics.median(m["cpu_ms_per_call"] for runs in thr.get(target, {}).values()
                                                 for m in runs) if thr.get(target) else float("nan"),
            "errors": errors,
            "error_samples": samples,
        }
    return out


def goals(s: dict[str, dict[str, Any]], top: int) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, pass) rows of the issue's goals, plus load-independent CPU-based views."""
    rows: list[tuple[str, str, bool | None]] = []
    p, m, ll = s.get("polar"), s.get("mitmdump"), s.get("litellm")
    if p and ll:
        r = p["added_p50_ms"] / ll["added_p50_ms"] if ll["added_p50_ms"] > 0 else float("inf")
        rows.append(("Polar added p50 <= 0.1x LiteLLM's (issue 42)",
                     f"{p['added_p50_ms']:.2f} / {ll['added_p50_ms']:.2f} ms = {r:.3f}x", r <= 0.1))
        r = p["rps"][top] / ll["rps"][top]
        rows.append((f"Polar throughput @{top} >= 5x LiteLLM's",
                     f"{p['rps'][top]:.0f} / {ll['rps'][top]:.0f} req/s = {r:.2f}x", r >= 5))
        r = ll["cpu_ms_per_call"] / p["cpu_ms_per_call"]
        rows.append(("  same, from CPU per call (load-independent)",
                     f"{ll['cpu_ms_per_call']:.2f} / {p['cpu_ms_per_call']:.2f} ms = {r:.2f}x", r >= 5))
    if p and m:
        r = p["rps"][top] / m["rps"][top]
        rows.append((f"Polar throughput @{top} >= 0.95x bare mitmdump's (issue 42)",
                     f"{p['rps'][top]:.0f} / {m['rps'][top]:.0f} req/s = {r:.2f}x", r >= 0.95))
        r = m["cpu_ms_per_call"] / p["cpu_ms_per_call"]
        rows.append(("  same, from CPU per call (load-independent)",
                     f"{m['cpu_ms_per_call']:.2f} / {p['cpu_ms_per_call']:.2f} ms = {r:.2f}x", r >= 0.95))
        r = p["ttft_p50_ms"] / m["ttft_p50_ms"]
        rows.append(("Polar streamed time to first token p50 <= 1.1x bare mitmdump's",
                     f"{p['ttft_p50_ms']:.2f} / {m['ttft_p50_ms']:.2f} ms = {r:.2f}x", r <= 1.1))
    rl = s.get("polar_relay")
    if rl and m:
        r = m["cpu_ms_per_call"] / rl["cpu_ms_per_call"]
        rows.append(("  (Polar with every stream relayed: CPU per call vs bare mitmdump)",
                     f"{m['cpu_ms_per_call']:.2f} / {rl['cpu_ms_per_call']:.2f} ms = {r:.2f}x", None))
    if p:
        rows.append(("Polar: zero errors", f"{p['errors']} errors", p["errors"] == 0))
    return rows


@app.command()
def main(
    rounds: int = typer.Option(5, help="Interleaved rounds of the latency and TTFB phases."),
    throughput_rounds: int = typer.Option(2, help="Interleaved rounds of the throughput phase."),
    duration: float = typer.Option(3.0, help="Seconds per throughput measurement (after a 0.5 s warm-up)."),
    sessions: str = typer.Option("1,16,64", help="Concurrent sessions of the throughput phase."),
    delay_ms: int = typer.Option(5, help="Upstream delay before every token in the streaming-latency phase."),
    targets: str = typer.Option(",".join(TARGETS), help="Comma-separated subset of " + ",".join(TARGETS)),
    pin: bool = typer.Option(True, help="Pin the proxy under test to CPU 0, upstream + load generator to CPU 1."),
    json_out: Path = typer.Option(None, "--json", help="Also write the summary here."),
    seed: int = typer.Option(0, help="Order of targets within rounds."),
) -> None:
    chosen = [t for t in TARGETS if t in targets.split(",")]
    if "direct" not in chosen:
        chosen.insert(0, "direct")  # the reference for added latency
    levels = [int(x) for x in sessions.split(",")]
    rng = random.Random(seed)
    multi = (os.cpu_count() or 1) >= 2 and pin
    proxy_cpus, client_cpus = ({0}, {1}) if multi else (None, None)
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    fixtures = [common.load_fixture(name, prov) for name, prov in common.MIX]
    console.print(f"[bold]Polar proxy benchmark[/] {platform.node()} cpus={os.cpu_count()} "
                  f"load={os.getloadavg()[0]:.2f} pin={'proxy->0, upstream+client->1' if multi else 'off'}")

    services: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="polar-bench-") as tmp_s:
        tmp = Path(tmp_s)
        confdir = tmp / "mitm"
        try:
            up = common.scripted_upstream().start()
            services.append(up)
            common.pin(up.pid, client_cpus)
            urls = {"direct": f"http://127.0.0.1:{up.ready_url.split(':')[2].split('/')[0]}"}
            pids = {"direct": up.pid}  # whose CPU time is measured per call (directly: the upstream's)
            if "mitmdump" in chosen:
                svc = common.bare_mitmdump(urls["direct"], confdir).start()
                services.append(svc)
                common.pin(svc.pid, proxy_cpus)
                urls["mitmdump"] = svc.ready_url.rsplit("/", 1)[0]
                pids["mitmdump"] = svc.pid
            polars: dict[str, Any] = {}
            for variant, options in POLAR_VARIANTS.items():
                if variant not in chosen:
                    continue
                from polar_proxy.process import ProxyProcess

                proxy = ProxyProcess(urls["direct"], tmp / f"captures-{variant}", confdir=confdir,
                                     served_model=common.SERVED_MODEL, options=options).start()
                services.append(proxy)
                common.pin(proxy.proc.pid, proxy_cpus)
                polars[variant] = proxy
                urls[variant] = proxy.url
                pids[variant] = proxy.proc.pid
            if "litellm" in chosen:
                with console.status("starting LiteLLM (installs it once into $POLAR_HOME/venvs/litellm)"):
                    svc = common.litellm_proxy(urls["direct"], common.requested_models(fixtures), tmp).start()
                services.append(svc)
                common.pin(svc.pid, proxy_cpus)
                urls["litellm"] = svc.ready_url.split("/health")[0]
                pids["litellm"] = svc.pid
            plans = build_plans(urls, fixtures, delay_ms=delay_ms)
            n_mix = len(plans["mix-direct"])
            lat: dict[str, list[dict]] = {t: [] for t in urls}
            ttfb: dict[str, list[dict]] = {t: [] for t in urls}
            thr: dict[str, dict[int, list[dict]]] = {t: {c: [] for c in levels} for t in urls}
            with common.LoadGen(client_cpus) as lg, Progress(
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(), console=console,
            ) as progress:
                for name, plan in plans.items():
                    lg.load(name, plan)
                # warm-up: connections, the upstream's caches, LiteLLM's first-call setup
                for t in urls:
                    lg.latency(f"mix-{t}")
                    lg.latency(f"ttfb-{t}")
                task = progress.add_task("latency + streaming rounds", total=rounds * len(urls))
                for _ in range(rounds):
                    for t in rng.sample(list(urls), len(urls)):
                        lat[t] += lg.latency(f"mix-{t}")["results"]
                        ttfb[t] += lg.latency(f"ttfb-{t}")["results"]
                        progress.advance(task)
                task = progress.add_task("throughput rounds", total=throughput_rounds * len(levels) * len(urls))
                for _ in range(throughput_rounds):
                    for c in levels:
                        for t in rng.sample(list(urls), len(urls)):
                            progress.update(task, description=f"throughput {t} @{c}")
                            cpu0 = common.cpu_seconds(pids[t])
                            m = lg.throughput(f"mix-{t}", c, duration)
                            m["cpu_ms_per_call"] = 1e3 * (common.cpu_seconds(pids[t]) - cpu0) / max(1, m["total"])
                            thr[t][c].append(m)
                            progress.advance(task)
            summary = summarize(lat, ttfb, thr, n_mix)
            for variant, proxy in polars.items():
                st = proxy.control.status()
                summary[variant].update(captured=st["captured"], proxy_errors=st["errors"],
                                        streamed=st["streamed"], streamed_at_once=st["streamed_at_once"])
                summary[variant]["capture_lines"] = sum(
                    f.read_bytes().count(b"\n") for f in (tmp / f"captures-{variant}" / "sessions").glob("*.jsonl"))
        finally:
            for svc in reversed(services):
                svc.stop()
    report(summary, levels, rounds, throughput_rounds, duration, multi)
    if json_out:
        json_out.write_text(json.dumps(summary, indent=2, default=str))


def report(s: dict[str, dict[str, Any]], levels: list[int], rounds: int, trounds: int, duration: float,
           pinned: bool) -> None:
    t = Table(title=f"Proxy overhead ({rounds} latency rounds x {s['direct']['calls'] // rounds} calls, "
                    f"{trounds} throughput rounds x {duration:g} s; medians over rounds)")
    t.add_column("target")
    t.add_column("added p50 ms", justify="right")
    t.add_column("added p99 ms", justify="right")
    t.add_column("stream 1st byte p50 ms", justify="right")
    t.add_column("stream 1st token p50 ms", justify="right")
    t.add_column("stream total p50 ms", justify="right")
    for c in levels:
        t.add_column(f"req/s @{c}", justify="right")
    t.add_column("CPU ms/call", justify="right")
    t.add_column("errors", justify="right")
    for target, v in s.items():
        t.add_row(LABELS[target], f"{v['added_p50_ms']:.2f}", f"{v['added_p99_ms']:.2f}", f"{v['ttfb_p50_ms']:.2f}",
                  f"{v['ttft_p50_ms']:.2f}", f"{v['stream_total_p50_ms']:.0f}",
                  *[f"{v['rps'].get(c, float('nan')):.0f}" for c in levels], f"{v['cpu_ms_per_call']:.2f}",
                  str(v["errors"]))
    console.print(t)
    for target, v in s.items():
        for e in v["error_samples"]:
            console.print(f"[red]{target} error:[/] {e}")
    for variant in POLAR_VARIANTS:
        if variant in s and "captured" in s[variant]:
            p = s[variant]
            console.print(f"{LABELS[variant]} captured {p['captured']} calls ({p['capture_lines']} lines on disk), "
                          f"proxy-side errors {p['proxy_errors']}; streamed calls answered at once (already "
                          f"complete when read) {p['streamed_at_once']} of {p['streamed']}")
    g = Table(title="Goals")
    g.add_column("goal")
    g.add_column("measured")
    g.add_column("result")
    for name, measured, ok in goals(s, max(levels)):
        g.add_row(name, measured, "n/a" if ok is None else ("[green]PASS[/]" if ok else "[red]FAIL[/]"))
    console.print(g)
    console.print("CPU ms/call: CPU time of the proxy process (tree) per call over the throughput runs; "
                  "for 'directly' it is the scripted upstream's own.")
    console.print(f"CPU pinning: {'proxy under test on CPU 0; upstream + load generator on CPU 1' if pinned else 'off'}; "
                  f"load average at the end {os.getloadavg()[0]:.2f} (other processes share these cores)")


if __name__ == "__main__":
    app()
