"""A real vLLM OpenAI-compatible server, started from its own venv (`paths.vllm_python()`).

vLLM's openai SDK needs h11>=0.16 and mitmproxy 11 pins h11<=0.14, so the server always runs as a
subprocess of the vLLM venv; everything here talks to it over HTTP with the standard library.
`VLLMServer` is the one way tests, the demo, the rollout runner and the trainer start it.

Weight reloads: with `VLLM_SERVER_DEV_MODE=1` (on by default here, loopback only) vLLM exposes
`POST /collective_rpc`; calling the worker method `reload_weights` with `weights_path=<dir>`
reloads a same-architecture checkpoint in place (no restart), after which `/reset_prefix_cache`
drops KV blocks computed with the old weights. `restart()` is the fallback that always works.

Sampling fidelity: the server always runs with `--logprobs-mode processed_logprobs`, so the
logprobs it returns are those of the distribution it sampled from (after temperature, top-k and
top-p; vLLM's default `raw_logprobs` are before them), and with an explicit `--generation-config`:
`vllm` (default here: neutral sampling defaults, T=1 and no top-k/top-p, whatever the model's
`generation_config.json` says, which every checkpoint copies) or `auto` (the model's file) or a
directory. The proxy reads both back from `/server_info` and records each call's effective
sampling parameters.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import subprocess
import time
from pathlib import Path

from polar_core import paths
from polar_core.net import free_port, http_json, port_in_use
from polar_core.processes import kill_group
from polar_runtime import models

DEFAULT_MODEL = models.QWEN05
MAX_AUTO_KV_CACHE_GIB = 4.0
DEFAULT_MAX_MODEL_LEN = 32768
START_TIMEOUT_S = 900.0
#: Server-side sampling defaults: vLLM's neutral ones (a request without temperature/top-p/top-k
#: samples from the plain distribution); "auto" would apply the model's generation_config.json.
DEFAULT_GENERATION_CONFIG = "vllm"
#: Returned logprobs after temperature/top-k/top-p: the behaviour logprobs of what was sampled.
DEFAULT_LOGPROBS_MODE = "processed_logprobs"

_ERROR_LINE = re.compile(
    r"^(?:\(\S+ pid=\d+\) ERROR [^\]]*\] )?((?:[\w.]+(?:Error|Exception)): .+|.*died unexpectedly.*)$"
    # pydantic puts the message of a ValidationError on an indented line below it (vLLM's config
    # checks: "Value error, User-specified max_model_len (16384) is greater than the derived ...").
    r"|^  (Value error, .+?)(?: \[type=.*)?$", re.M
)

class ServeError(RuntimeError):
    """The server cannot be started or used; the message says why and what to do."""


class PortInUseError(ServeError):
    pass


class VLLMStartError(ServeError):
    pass


def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def cpu_bind_spec(cpus: set[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for the given (default: all usable) cores, e.g. '0-1' or '0-3,6'."""
    ordered = sorted(cpus) if cpus is not None else usable_cpus()
    ranges: list[str] = []
    start = prev = ordered[0]
    for c in ordered[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
        if c is not None:
            start = prev = c
    return ",".join(ranges)


def reasoning_parser_for(model_dir: Path) -> str | None:
    """The vLLM reasoning parser a model directory names (``polar_reasoning_parser``, written by the
    builds of reasoning models such as ``tiny-r1``): None for models that do not reason."""
    f = model_dir / "polar_reasoning_parser"
    name = f.read_text().strip() if f.is_file() else ""
    return name or None


def template_supports_tools(model_dir: Path) -> bool:
    """Templates that take part in tool calling: Qwen-style ones render `tools` and emit Hermes
    `<tool_call>` blocks; the DeepSeek-R1 distills render assistant `tool_calls` and `tool` turns (in
    DeepSeek's text markup, with no list of tools). Without a tool parser vLLM answers every request
    that offers tools (`tool_choice: auto`, what every harness sends) with HTTP 400: on `tiny-r1` every
    harness failed on its first call (benchmarks/bench_reasoning_live.py). vLLM's `deepseek_v3` parser
    needs `<｜tool▁calls▁begin｜>` as one token, which the distills' tokenizer lacks, so they get the
    default parser too."""
    texts = []
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        texts.append(jinja.read_text())
    cfg = model_dir / "tokenizer_config.json"
    if cfg.exists():
        tmpl = json.loads(cfg.read_text()).get("chat_template") or ""
        texts.append(tmpl if isinstance(tmpl, str) else json.dumps(tmpl))
    text = "\n".join(texts)
    return ("tools" in text and "<tool_call>" in text) or "tool_calls" in text


#: vLLM's tool-call parser for models whose template has tools. ``lenient`` is Polar's plugin
#: (polar_runtime/lenient_tool_parser.py): Hermes ``<tool_call>`` tags *and* the Markdown JSON
#: blocks Qwen2.5-Coder-0.5B writes instead (with plain ``hermes`` Pi got those as text); any other
#: name is one of vLLM's own parsers (``hermes``, ...); ``none`` turns tool parsing off.
DEFAULT_TOOL_PARSER = "lenient"
LENIENT_PARSER = Path(__file__).resolve().parent / "lenient_tool_parser.py"


def tool_parser_args(name: str) -> list[str]:
    if name == "lenient":
        return ["--tool-parser-plugin", str(LENIENT_PARSER), "--tool-call-parser", "polar_lenient"]
    return ["--tool-call-parser", name]


def resolve_model(model: str | os.PathLike[str]) -> tuple[Path, str]:
    """(model dir, default served name) for a Polar model name or a directory path."""
    if isinstance(model, str) and model in models.SPECS:
        return models.model_path(model), model
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        known = ", ".join(n for n, s in models.SPECS.items() if s.kind == "hf")
        raise models.ModelNotBuiltError(
            f"model {str(model)!r} is neither a Polar model ({known}) nor a directory with config.json"
        )
    return path.resolve(), path.name


def auto_kv_cache_gib(model_dir: Path, max_model_len: int, sequences: int = 2) -> float:
    """KV cache for `sequences` full-length float32 sequences, in 0.25 GiB steps (0.25 .. 4).

    RAM is the scarce thing on a shared CPU box: tiny-qwen needs 1 KiB per token, the 0.5B 24 KiB.
    """
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    per_token = 2 * int(cfg["num_hidden_layers"]) * int(cfg.get("num_key_value_heads") or heads) * head_dim * 4
    gib = per_token * max_model_len * sequences / 2**30
    return min(MAX_AUTO_KV_CACHE_GIB, max(0.25, -(-gib // 0.25) * 0.25))


class VLLMServer:
    """One vLLM server process (its own process group), usable as a context manager."""

    def __init__(
        self,
        model: str | os.PathLike[str] = DEFAULT_MODEL,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_model_len: int | None = None,
        served_model_name: str | None = None,
        kv_cache_gib: float | None = None,
        dev_mode: bool = True,
        extra_args: tuple[str, ...] = (),
        log_path: Path | None = None,
        gpu: bool | None = None,
        threads: int | None = None,
        tool_parser: str = DEFAULT_TOOL_PARSER,
        generation_config: str = DEFAULT_GENERATION_CONFIG,
        logprobs_mode: str = DEFAULT_LOGPROBS_MODE,
        scale_out: bool = True,
        reasoning_parser: str | None = "auto",
    ) -> None:
        self.model_dir, default_name = resolve_model(model)
        self.generation_config = generation_config
        self.logprobs_mode = logprobs_mode
        self.tool_parser = tool_parser
        #: vLLM's ``--reasoning-parser`` (``qwen3``, ``deepseek_r1``, ...): reasoning goes to the
        #: answer's reasoning field, not its content; "auto": what the model directory names
        self.reasoning_parser = reasoning_parser_for(self.model_dir) if reasoning_parser == "auto" else reasoning_parser
        #: vLLM's token-in/token-out endpoints (render, generate, derender; ``--enable-scale-out``),
        #: which the proxy's exact-history mode uses
        self.scale_out = scale_out
        self.served_model_name = served_model_name or default_name
        self.host = host
        self.port = port or free_port(host)
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib if kv_cache_gib is not None else auto_kv_cache_gib(self.model_dir, self._max_len())
        self.dev_mode = dev_mode
        self.extra_args = tuple(extra_args)
        self.gpu = paths.has_gpu() if gpu is None else gpu
        #: OpenMP threads on CPU (default: one per usable core); fewer helps on a shared machine,
        #: where spin-waiting threads of an oversubscribed server stall each other.
        self.threads = threads
        self.log_path = paths.absolute(log_path) if log_path else paths.vllm_cache_dir() / "logs" / f"{self.served_model_name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None
        self.attached = False

    @classmethod
    def attach(cls, base_url: str, model: str | os.PathLike[str], served_model_name: str | None = None) -> VLLMServer:
        """Wrap a server someone else started (e.g. the shared dev servers): stop() leaves it alone."""
        host, _, port = base_url.removeprefix("http://").rstrip("/").removesuffix("/v1").partition(":")
        server = cls(model, host=host, port=int(port or 80), served_model_name=served_model_name)
        server.attached = True
        if not server.is_ready():
            raise ServeError(f"no vLLM serving {server.served_model_name!r} at {server.base_url}")
        return server

    # -- addresses -------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        """What an OpenAI client takes as base_url."""
        return f"{self.base_url}/v1"

    # -- command ---------------------------------------------------------------------------------
    def _max_len(self) -> int:
        if self.max_model_len:
            return self.max_model_len
        cfg = json.loads((self.model_dir / "config.json").read_text())
        return min(int(cfg.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN), DEFAULT_MAX_MODEL_LEN)

    def command(self) -> list[str]:
        cmd = [
            str(paths.vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self._max_len()),
            "--logprobs-mode", self.logprobs_mode,
            "--generation-config", self.generation_config,
        ]  # fmt: skip
        if self.gpu:
            cmd += ["--dtype", "bfloat16"]
        else:
            # No native bf16 on these CPUs: float32 decodes several times faster. Eager mode
            # starts in ~1 min instead of ~4 (no torch.compile).
            cmd += ["--dtype", "float32", "--enforce-eager"]
            # Whole prompts in one prefill step. vLLM 0.32 on CPU kills its engine when a seeded
            # request (Polar seeds every call: polar_sampling) is prefilled in chunks: after each
            # partial step it rewinds the request's generator (`gen.set_offset`), which CPU
            # generators refuse ("CPU Generator does not use offset"). Measured: Gemini CLI's
            # 8,904-token first prompt on tiny-qwen took the server down with the default 2,048-token
            # chunks; Pi's prompts (under 2,048 new tokens, thanks to prefix caching) never did.
            if not any(a.startswith(("--max-num-batched-tokens", "--enable-chunked-prefill", "--no-enable-chunked-prefill"))
                       for a in self.extra_args):
                cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(self._max_len())]
            if not float(self.kv_cache_gib).is_integer():  # VLLM_CPU_KVCACHE_SPACE takes whole GiB only
                cmd += ["--kv-cache-memory-bytes", str(int(self.kv_cache_gib * 2**30))]
        if self.tool_parser != "none" and template_supports_tools(self.model_dir):
            cmd += ["--enable-auto-tool-choice", *tool_parser_args(self.tool_parser)]
        if self.reasoning_parser and self.reasoning_parser != "none" and not any(
                a.startswith("--reasoning-parser") for a in self.extra_args):
            cmd += ["--reasoning-parser", self.reasoning_parser]
        if self.scale_out and "--enable-scale-out" not in self.extra_args:
            cmd.append("--enable-scale-out")
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
            env.pop(key, None)
        env.update(
            VLLM_CACHE_ROOT=str(paths.vllm_cache_dir()),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        if not self.gpu:
            if float(self.kv_cache_gib).is_integer():
                env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.kv_cache_gib))
            cpus = usable_cpus()
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_spec(set(cpus[-self.threads :] if self.threads else cpus))
        return env

    # -- life cycle ------------------------------------------------------------------------------
    def start(self, wait: bool = True, timeout: float = START_TIMEOUT_S) -> VLLMServer:
        if self.attached:
            raise ServeError(f"{self.base_url} was attached, not started here")
        if self.proc is not None and self.proc.poll() is None:
            raise ServeError(f"server already running at {self.base_url}")
        python = paths.vllm_python()
        if not python.exists():
            raise ServeError(f"vLLM venv missing ({python}); run scripts/setup.sh")
        if not (self.model_dir / "config.json").exists():
            raise models.ModelNotBuiltError(f"model directory {self.model_dir} has no config.json")
        if port_in_use(self.port, self.host):
            raise PortInUseError(f"port {self.port} on {self.host} is already in use; pick another with --port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        paths.vllm_cache_dir().mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:  # append: a restart keeps the earlier history
            log.write(("$ " + " ".join(self.command()) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # own process group: stop() takes the engine core with it
            )
        atexit.register(self.stop)
        if wait:
            self.wait_ready(timeout)
        return self

    def _log_text(self) -> str:
        """This run's part of the log (a restart appends to the same file)."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(getattr(self, "_log_offset", 0))
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self._log_text().splitlines()[-lines:]) or "(no log)"

    def error_lines(self, limit: int = 6) -> list[str]:
        """Distinct `SomeError: message` lines of the log, first first: the root cause usually
        sits in a worker's traceback far above the API server's last lines."""
        text = self._log_text()
        seen: list[str] = []
        for m in _ERROR_LINE.finditer(text):
            line = (m.group(1) or m.group(2)).strip()
            if "exit code: -9" in line:
                line += " [SIGKILL: on a shared CPU box usually the kernel's OOM killer; lower --kv-cache-gib]"
            if line not in seen:
                seen.append(line)
        return seen[:limit]

    def failure_report(self, what: str) -> str:
        """`what`, the log's path, its distinct error lines and its last lines."""
        return self._failure(what)

    def _failure(self, what: str) -> str:
        causes = "\n".join(f"  {c}" for c in self.error_lines())
        return f"{what}; log {self.log_path}:\n" + (f"errors:\n{causes}\n" if causes else "") + f"last lines:\n{self.log_tail()}"

    def is_ready(self) -> bool:
        try:
            data = http_json(f"{self.base_url}/v1/models", timeout=5)
        except (OSError, ServeError, ValueError):
            return False
        return any(m.get("id") == self.served_model_name for m in (data or {}).get("data", []))

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise VLLMStartError(self._failure(f"vLLM exited with code {code} during start-up"))
            if self.is_ready():
                self.start_seconds = round(time.monotonic() - self._t0, 1)
                return
            time.sleep(0.5)
        message = self._failure(f"vLLM not ready after {timeout:.0f} s")
        self.stop()
        raise VLLMStartError(message)

    def stop(self, grace: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        kill_group(proc, grace)  # the engine core, a child, may outlive the API process

    def restart(self, model_dir: str | os.PathLike[str] | None = None, timeout: float = START_TIMEOUT_S) -> None:
        """Stop and start again on the same port (optionally serving a new checkpoint dir)."""
        self.stop()
        if model_dir is not None:
            self.model_dir, _ = resolve_model(model_dir)
        deadline = time.monotonic() + 30
        while port_in_use(self.port, self.host) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.start(wait=True, timeout=timeout)

    @property
    def running(self) -> bool:
        if self.attached:
            return self.is_ready()
        return self.proc is not None and self.proc.poll() is None

    # -- weights ---------------------------------------------------------------------------------
    def reload_weights(self, model_dir: str | os.PathLike[str], timeout: float = 600.0) -> float:
        """Load a same-architecture checkpoint into the running server; returns seconds taken.

        Needs dev mode (`/collective_rpc`). The prefix cache is reset afterwards so no request
        reuses KV computed with the old weights. Served name, tokenizer and port stay the same.
        """
        if not self.dev_mode:
            raise ServeError("reload_weights needs a server started with dev_mode=True")
        path = Path(model_dir).resolve()
        if not any(path.glob("*.safetensors")):
            raise ServeError(f"{path} holds no *.safetensors")
        t0 = time.monotonic()
        http_json(
            f"{self.base_url}/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(path)}, "timeout": timeout},
            timeout=timeout,
        )
        http_json(f"{self.base_url}/reset_prefix_cache", {}, timeout=60)
        self.model_dir = path
        return time.monotonic() - t0

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> VLLMServer:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VLLMServer({self.served_model_name!r}, {self.base_url}, dir={self.model_dir})"
