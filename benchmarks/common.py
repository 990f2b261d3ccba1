"""Shared parts of the proxy benchmarks: services, the request mix, and a load generator process.

Why a separate load-generator process: the 2 CPUs are shared by the client, the upstream and the
proxy under test; a client in the benchmark's own interpreter would steal the proxy's time in
unpredictable ways. Services and the load generator can be pinned to CPUs (``pin``), so that the
proxy under test always has one core to itself and the client side (load generator + scripted
upstream) the other.

Run as a script it *is* the load generator: ``python benchmarks/common.py loadgen`` reads one JSON
command per stdin line and answers one JSON line per command (``load``, ``latency``, ``throughput``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from polar_core.net import OPENER, free_port  # noqa: F401 - free_port: common.free_port() in the benchmarks
from polar_core.paths import harness_request_fixtures

REPO = Path(__file__).resolve().parent.parent
FIXTURES = harness_request_fixtures()
SERVED_MODEL = "scripted-model"
#: Harness fixtures of the mix: (fixture name, provider); first and second turns of each format.
MIX = [
    ("pi.chat", "openai_chat"), ("pi.chat.second", "openai_chat"),
    ("qwen-code", "openai_chat"), ("qwen-code.second", "openai_chat"),
    ("pi.anthropic", "anthropic"), ("pi.anthropic.second", "anthropic"),
    ("claude-code.bare", "anthropic"),
    ("pi.responses", "openai_responses"), ("pi.responses.second", "openai_responses"),
    ("pi.gemini", "google"), ("pi.gemini.second", "google"),
]
#: A marker every complete answer of that shape contains (a cut or error answer lacks it).
COMPLETE = {
    ("openai_chat", True): "[DONE]", ("openai_chat", False): '"finish_reason"',
    ("anthropic", True): "message_stop", ("anthropic", False): '"stop_reason"',
    ("openai_responses", True): "response.completed", ("openai_responses", False): '"status":"completed"',
    ("google", True): "finishReason", ("google", False): "finishReason",
}
_SKIP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


def polar_home() -> Path:
    return Path(os.environ.get("POLAR_HOME") or Path.home() / ".cache" / "polar")


def python() -> str:
    """The project interpreter (the venv this script runs in)."""
    return sys.executable


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------

def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def pin(pid: int, cpus: set[int] | None) -> None:
    """Pin every thread of ``pid`` and of its descendants to ``cpus`` (no-op when None)."""
    if not cpus:
        return
    for p in process_tree(pid):
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except OSError:
                pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU time consumed so far by ``pid`` and its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with OPENER.open(url, timeout=timeout) as resp:
            return 200 <= resp.status < 500
    except urllib.error.HTTPError as exc:
        return exc.code < 500
    except (OSError, ValueError):
        return False


class Service:
    """A child process in its own process group: started, waited for, pinned, stopped (whole group)."""

    def __init__(self, name: str, cmd: list[str], ready_url: str, *, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None, startup_timeout: float = 60.0):
        self.name, self.cmd, self.ready_url = name, cmd, ready_url
        self.env = {**os.environ, **(env or {})}
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
            self.env.pop(k, None)
        self.cwd = cwd
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"polar-bench-{name}-", suffix=".log", delete=False)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "Service":
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, cwd=self.cwd, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if http_ok(self.ready_url):
                return self
            time.sleep(0.1)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"{self.name} did not start ({' '.join(self.cmd)}):\n{tail}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log.name).read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
            except ProcessLookupError:
                pass
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> "Service":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def scripted_upstream(port: int | None = None, max_model_len: int = 262_144) -> Service:
    """The fast scripted upstream (vLLM's wire format) as its own process."""
    port = port or free_port()
    return Service("upstream", [python(), "-m", "polar_testing.scripted_upstream", "--port", str(port),
                                "--served-model-name", SERVED_MODEL, "--max-model-len", str(max_model_len)],
                   f"http://127.0.0.1:{port}/health")


def mitmdump_bin() -> str:
    from polar_proxy.process import mitmdump_path

    return mitmdump_path()


def bare_mitmdump(upstream_url: str, confdir: Path, port: int | None = None) -> Service:
    """mitmdump in reverse mode, no addon: the floor of our architecture.

    ``stream_large_bodies=1`` makes it stream every response as it arrives (like Polar does for
    streamed calls); without it mitmproxy buffers whole answers and its time to first byte would
    be the whole generation.
    """
    port = port or free_port()
    cmd = [mitmdump_bin(), "--mode", f"reverse:{upstream_url}", "--listen-host", "127.0.0.1",
           "--listen-port", str(port), "--set", f"confdir={confdir}", "--set", "flow_detail=0",
           "--set", "termlog_verbosity=warn", "--set", "stream_large_bodies=1"]
    return Service("mitmdump", cmd, f"http://127.0.0.1:{port}/health")


# ---------------------------------------------------------------------------------------------
# LiteLLM (the proxy other RL frameworks use), in its own venv
# ---------------------------------------------------------------------------------------------

def litellm_venv() -> Path:
    return polar_home() / "venvs" / "litellm"


def ensure_litellm(log=print) -> Path:
    """``$POLAR_HOME/venvs/litellm`` with ``litellm[proxy]`` (idempotent); returns its ``litellm`` script."""
    venv = litellm_venv()
    exe = venv / "bin" / "litellm"
    py = venv / "bin" / "python"
    if exe.exists() and subprocess.run([str(py), "-c", "import litellm.proxy.proxy_server"],
                                       capture_output=True, timeout=300,
                                       env={**os.environ, **litellm_env()}).returncode == 0:
        return exe
    log(f"installing litellm[proxy] into {venv} (once)")
    if not py.exists():
        base = shutil.which("python3.11") or sys.executable
        subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "litellm[proxy]"], check=True, timeout=1800)
    return exe


#: LiteLLM refuses to start without a master key; clients send it as their API key.
LITELLM_KEY = "sk-polar-bench-" + os.urandom(8).hex()


def litellm_env() -> dict[str, str]:
    """Offline: no model-cost-map download, no telemetry, quiet logs."""
    return {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR",
            "LITELLM_MODE": "PRODUCTION", "DISABLE_SCHEMA_UPDATE": "True", "NO_DOCS": "True"}


def litellm_proxy(upstream_url: str, model_names: list[str], workdir: Path, port: int | None = None) -> Service:
    """LiteLLM proxy, one worker, every requested model name routed to the scripted upstream."""
    port = port or free_port()
    exe = ensure_litellm()
    lines = ["model_list:"]
    for name in sorted(set(model_names)):
        lines += [f"  - model_name: {json.dumps(name)}", "    litellm_params:",
                  f"      model: hosted_vllm/{SERVED_MODEL}", f"      api_base: {upstream_url}/v1",
                  "      api_key: sk-bench"]
    lines += ["litellm_settings:", "  drop_params: true", "  telemetry: false", "  request_timeout: 600",
              "general_settings:", f"  master_key: {LITELLM_KEY}", "  disable_spend_logs: true"]
    cfg = workdir / "litellm.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    cmd = [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    return Service("litellm", cmd, f"http://127.0.0.1:{port}/health/liveliness", env=litellm_env(), cwd=workdir,
                   startup_timeout=180)


# ---------------------------------------------------------------------------------------------
# The request mix
# ---------------------------------------------------------------------------------------------

@dataclass
class Fixture:
    name: str
    provider: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def load_fixture(name: str, provider: str) -> Fixture:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    headers = {k: v for k, v in data["headers"].items() if k.lower() not in _SKIP_HEADERS}
    return Fixture(name, provider, data["path"], headers, data["body"])


def native_request(fx: Fixture, stream: bool) -> tuple[str, dict[str, str], dict[str, Any]]:
    """(path, headers, body) of the harness's own request, asking to stream or not."""
    body = copy.deepcopy(fx.body)
    path = fx.path
    if fx.provider == "google":
        path = path.split(":", 1)[0] + (":streamGenerateContent?alt=sse" if stream else ":generateContent")
    else:
        body["stream"] = stream
        if not stream:
            body.pop("stream_options", None)
    return path, dict(fx.headers), body


def chat_equivalent(fx: Fixture, stream: bool, model: str = SERVED_MODEL) -> dict[str, Any]:
    """The chat request Polar sends upstream for this harness request (its own translator and
    engine adapter): what "directly" and bare mitmproxy get, so the upstream does the same work."""
    from polar_proxy.engines import get_engine
    from polar_proxy.providers import PROVIDERS

    path, _, body = native_request(fx, stream)
    route, _, qs = path.partition("?")
    query = dict(p.split("=", 1) for p in qs.split("&") if "=" in p)
    normalized = PROVIDERS[fx.provider].to_chat(body, route, query)
    chat = dict(normalized.chat_request)
    chat["model"] = model
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}
    else:
        chat.pop("stream_options", None)
    return get_engine("vllm").prepare(chat)


def with_directive(provider: str, body: dict[str, Any], text: str) -> dict[str, Any]:
    """A copy of a native or chat body whose last user message ends with ``text`` (scripted-upstream
    directives such as ``#delay:20`` travel in the user's text through every proxy)."""
    body = copy.deepcopy(body)
    if provider == "google":
        for c in reversed(body.get("contents") or []):
            if c.get("role", "user") == "user" and any("text" in p for p in c.get("parts") or []):
                c["parts"].append({"text": " " + text})
                return body
        raise ValueError("no user text")
    items = body.get("messages") if "messages" in body else body.get("input")
    if isinstance(items, str):
        body["input"] = items + " " + text
        return body
    for m in reversed(items or []):
        if m.get("role") != "user":
            continue
        c = m.get("content")
        if isinstance(c, str):
            m["content"] = c + " " + text
            return body
        if isinstance(c, list) and any(p.get("type") in ("text", "input_text") for p in c):
            kind = "input_text" if provider == "openai_responses" else "text"
            c.append({"type": kind, "text": " " + text})
            return body
    raise ValueError("no user text")


def requested_models(fixtures: list[Fixture]) -> list[str]:
    names = {SERVED_MODEL}
    for fx in fixtures:
        if fx.provider == "google":
            names.add(fx.path.split("/models/")[1].split(":")[0])
        elif fx.body.get("model"):
            names.add(fx.body["model"])
    return sorted(names)


def request_spec(kind: str, provider: str, stream: bool, url: str, headers: dict[str, str], body: Any) -> dict[str, Any]:
    """One request of a plan, as the load generator takes it."""
    data = body if isinstance(body, str) else json.dumps(body)
    return {"kind": kind, "url": url, "headers": {"content-type": "application/json", **headers}, "body": data,
            "stream": stream, "marker": COMPLETE[(provider, stream)]}


# ---------------------------------------------------------------------------------------------
# Load generator (runs in its own process)
# ---------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


class LoadGen:
    """Client side of the benchmark: drives a child ``common.py loadgen`` over stdin/stdout."""

    def __init__(self, cpus: set[int] | None = None):
        self.proc = subprocess.Popen([python(), str(Path(__file__).resolve()), "loadgen"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=str(REPO), start_new_session=True)
        self.pid = self.proc.pid
        pin(self.pid, cpus)

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("load generator died")
        out = json.loads(line)
        if "exception" in out:
            raise RuntimeError(f"load generator: {out['exception']}")
        return out

    def load(self, name: str, requests: list[dict[str, Any]]) -> None:
        self._ask({"cmd": "load", "name": name, "requests": requests})

    def latency(self, name: str, repeats: int = 1) -> dict[str, Any]:
        """Each request of plan ``name`` in order, one at a time: per-request latency and TTFB."""
        return self._ask({"cmd": "latency", "name": name, "repeats": repeats})

    def throughput(self, name: str, sessions: int, duration: float, warmup: float = 0.5,
                   session_prefix: str = "bench") -> dict[str, Any]:
        """``sessions`` closed-loop sessions cycling through plan ``name`` for ``duration`` seconds."""
        return self._ask({"cmd": "throughput", "name": name, "sessions": sessions, "duration": duration,
                          "warmup": warmup, "session_prefix": session_prefix})

    def calls(self, name: str, sessions: int, calls: int, session_prefix: str = "bench") -> dict[str, Any]:
        """``calls`` calls of plan ``name`` spread over ``sessions`` closed-loop sessions."""
        return self._ask({"cmd": "calls", "name": name, "sessions": sessions, "calls": calls,
                          "session_prefix": session_prefix})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(5)

    def __enter__(self) -> "LoadGen":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _one(session: Any, spec: dict[str, Any], session_id: str | None) -> dict[str, Any]:
    """One exchange; ``ok`` only for HTTP 200 with a complete answer (its shape's end marker)."""
    import aiohttp

    headers = spec["headers"] if session_id is None else {**spec["headers"], "x-polar-session": session_id}
    t0 = time.perf_counter()
    first = token = None
    token_marker = spec.get("_first_token")
    tail = b""
    try:
        async with session.post(spec["url"], data=spec["_bytes"], headers=headers) as resp:
            chunks = []
            async for chunk in resp.content.iter_any():
                if first is None:
                    first = time.perf_counter() - t0
                if token is None and token_marker and token_marker in tail + chunk:
                    token = time.perf_counter() - t0
                tail = chunk[-16:]
                chunks.append(chunk)
            body = b"".join(chunks)
            status = resp.status
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        return {"ok": False, "error": repr(exc)[:200], "t": time.perf_counter() - t0, "ttfb": first}
    t = time.perf_counter() - t0
    ok = status == 200 and spec["_marker"] in body
    out: dict[str, Any] = {"ok": ok, "t": t, "ttfb": first if first is not None else t, "status": status,
                           "ttft": token}
    if not ok:
        out["error"] = f"HTTP {status}: {body[:300]!r}"
    return out


async def _loadgen_main() -> None:
    import aiohttp

    plans: dict[str, list[dict[str, Any]]] = {}
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 30)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    timeout = aiohttp.ClientTimeout(total=120)
    out = sys.stdout.buffer

    def reply(data: dict[str, Any]) -> None:
        out.write(json.dumps(data).encode() + b"\n")
        out.flush()

    while True:
        line = await reader.readline()
        if not line:
            return
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "load":
                for spec in cmd["requests"]:
                    spec["_bytes"] = spec["body"].encode()
                    spec["_marker"] = spec["marker"].encode()
                    spec["_first_token"] = spec["first_token"].encode() if spec.get("first_token") else None
                plans[cmd["name"]] = cmd["requests"]
                reply({"loaded": len(cmd["requests"])})
            elif cmd["cmd"] == "latency":
                plan = plans[cmd["name"]]
                results = []
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=timeout,
                                                 auto_decompress=False) as s:
                    for _ in range(cmd.get("repeats", 1)):
                        for i, spec in enumerate(plan):
                            r = await _one(s, spec, "bench-latency")
                            r["i"] = i
                            results.append(r)
                reply({"results": results})
            elif cmd["cmd"] == "throughput":
                reply(await _throughput(plans[cmd["name"]], cmd, timeout))
            elif cmd["cmd"] == "calls":
                reply(await _calls(plans[cmd["name"]], cmd, timeout))
            else:
                reply({"exception": f"unknown command {cmd['cmd']}"})
        except Exception as exc:  # noqa: BLE001 - report to the driver, keep serving
            reply({"exception": repr(exc)})


async def _throughput(plan: list[dict[str, Any]], cmd: dict[str, Any], timeout: Any) -> dict[str, Any]:
    import aiohttp

    n, duration, warmup = cmd["sessions"], cmd["duration"], cmd["warmup"]
    done: list[dict[str, Any]] = []
    errors: list[str] = []
    total = [0]  # every call made, warm-up and tail included (for CPU per call)
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + duration

    async def session_loop(k: int, s: Any) -> None:
        i = k
        sid = f"{cmd['session_prefix']}-{k}"
        while time.perf_counter() < t_end:
            spec = plan[i % len(plan)]
            i += 1
            t0 = time.perf_counter()
            r = await _one(s, spec, sid)
            total[0] += 1
            if t0 >= t_measure and t0 < t_end:
                r["i"] = (i - 1) % len(plan)
                done.append(r)
            if not r["ok"] and len(errors) < 5:
                errors.append(r.get("error", ""))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0), timeout=timeout,
                                     auto_decompress=False) as s:
        await asyncio.gather(*(session_loop(k, s) for k in range(n)))
    wall = time.perf_counter() - t_measure
    ok = [r for r in done if r["ok"]]
    return {"requests": len(done), "total": total[0], "ok": len(ok), "errors": len(done) - len(ok),
            "error_samples": errors,
            "seconds": duration, "wall": wall, "rps": len(ok) / duration,
            "p50": percentile([r["t"] for r in ok], 50), "p99": percentile([r["t"] for r in ok], 99),
            "ttfb_p50": percentile([r["ttfb"] for r in ok if plan[r["i"]]["stream"]], 50)}


async def _calls(plan: list[dict[str, Any]], cmd: dict[str, Any], timeout: Any) -> dict[str, Any]:
    import aiohttp

    left = [cmd["calls"]]
    ok, errors = [0], []

    async def session_loop(k: int, s: Any) -> None:
        i = k
        while left[0] > 0:
            left[0] -= 1
            r = await _one(s, plan[i % len(plan)], f"{cmd['session_prefix']}-{k}")
            i += 1
            ok[0] += r["ok"]
            if not r["ok"] and len(errors) < 5:
                errors.append(r.get("error", ""))

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                     auto_decompress=False) as s:
        await asyncio.gather(*(session_loop(k, s) for k in range(cmd["sessions"])))
    return {"calls": cmd["calls"], "ok": ok[0], "errors": cmd["calls"] - ok[0], "error_samples": errors,
            "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    if sys.argv[1:] == ["loadgen"]:
        asyncio.run(_loadgen_main())
    else:
        sys.exit("usage: common.py loadgen   (the benchmarks start it themselves)")
