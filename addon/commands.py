"""``polar proxy``: run the capturing proxy in front of an inference server, with sensible defaults.

Defaults that matter: listen on 127.0.0.1 only, mitmproxy's CA in the project cache (never
``~/.mitmproxy``), captures under ``$POLAR_HOME/captures``. It prints the environment a harness
needs (base URLs in reverse mode; HTTPS_PROXY and the CA bundle in regular mode), then runs in
the foreground until Ctrl-C.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from polar_core import paths
from polar_core.console import make_console
from polar_core.control import token_file

from .process import ProxyProcess


def proxy_command(
    upstream: Annotated[str, typer.Option(help="Inference server base URL(s), comma-separated.")] = "http://127.0.0.1:8000",
    mode: Annotated[str, typer.Option(help="reverse (point base URLs at the proxy) or regular (HTTPS_PROXY).")] = "reverse",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    capture_dir: Annotated[Optional[Path], typer.Option(resolve_path=True, help="Capture directory (default $POLAR_HOME/captures).")] = None,
    served_model: Annotated[Optional[str], typer.Option(help="Served model name (default: ask /v1/models).")] = None,
    engine: Annotated[str, typer.Option(help="vllm or sglang.")] = "vllm",
    stream_mode: Annotated[str, typer.Option(help="passthrough (true streaming) or synthetic.")] = "passthrough",
    intercept_host: Annotated[Optional[list[str]], typer.Option(help="Host to intercept in regular mode (repeatable).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the upstream's next byte.")] = 600.0,
    confdir: Annotated[Optional[Path], typer.Option(resolve_path=True, help="mitmproxy confdir (CA) (default $POLAR_HOME/mitmproxy).")] = None,
    web: Annotated[bool, typer.Option(help="Run mitmweb instead of mitmdump (flows in the browser).")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Extra mitmproxy option name=value.")] = None,
) -> None:
    """Run the Polar capture proxy in front of an inference server."""
    console = make_console()
    options: dict[str, list[str]] = {}
    for item in set_ or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set expects name=value, got {item!r}")
        options.setdefault(key, []).append(value)
    proxy = ProxyProcess(
        upstream, capture_dir or paths.polar_home() / "captures", mode=mode, host=host, port=port,
        confdir=confdir, served_model=served_model, engine=engine, stream_mode=stream_mode,
        intercept_hosts=intercept_host, upstream_timeout=timeout, options=options, web=web,
        log_file=paths.polar_home() / "logs" / f"proxy-{port}.log",
    )
    (paths.polar_home() / "logs").mkdir(parents=True, exist_ok=True)
    stop = False

    def _stop(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        proxy.start()
    except RuntimeError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    console.print(f"[bold]Polar proxy[/bold] ({mode} mode) on {proxy.url}, upstream {upstream}")
    console.print("# environment for a harness:", style="dim")
    for k, v in proxy.harness_env(session="SESSION" if mode == "regular" else None).items():
        if not k.islower():
            print(f"export {k}={v}")  # plain lines: copy-paste safe, never wrapped
    print(f"# captures: {proxy.capture_dir}/sessions/<session>.jsonl   log: {proxy.log_file}")
    print(f"# control:  {proxy.url}/_polar/status   (pause, resume, policy_version, sessions)")
    print(f"#           needs 'Authorization: Bearer <secret>', the secret in {token_file(proxy.port or port, proxy.confdir)}")
    if mode == "reverse":
        print("# session:  header x-polar-session, or API key polar-<session>")
    else:
        print("# session:  proxy user name (HTTPS_PROXY=http://SESSION@host:port) or API key polar-<session>")
    sys.stdout.flush()
    try:
        while not stop and proxy.proc is not None and proxy.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        code = proxy.proc.poll() if proxy.proc is not None else 0
        proxy.stop()
    if code not in (None, 0):
        console.print(f"[red]proxy exited with {code}[/red]\n{proxy.log_tail()}")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("proxy")(proxy_command)
