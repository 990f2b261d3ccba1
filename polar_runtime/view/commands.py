"""``polar view RUN``: the run viewer (a report directory that opens from ``file://``, or served)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from polar_core.console import make_console

console = make_console()


def view_hint(run_dir: str | Path) -> str:
    """The command the demo and `polar loop` print at the end."""
    return f"polar view {run_dir}"


def view_command(
    run: Annotated[Path, typer.Argument(help="A run directory (polar demo / polar loop `out`).")],
    out: Annotated[Optional[Path], typer.Option(help="Where to write the report (default: RUN/view).")] = None,
    serve: Annotated[bool, typer.Option("--serve", help="Serve it on 127.0.0.1 instead, following a running loop.")] = False,
    port: Annotated[int, typer.Option(help="Port of --serve (0: a free one).")] = 0,
    tokenizer: Annotated[Optional[Path], typer.Option(
        help="Model directory whose tokenizer shows the tokens as text (default: the run's model, if built).")] = None,
) -> None:
    """Browse a run: rewards, staleness, idle time, drift; a sample's conversation, verdict and calls;
    each trained sequence's tokens with mask, provenance, advantage and both logprobs."""
    from .chunks import write_report
    from .model import RunView

    run = run.resolve()
    try:
        view = RunView(run, str(tokenizer) if tokenizer else None)
    except FileNotFoundError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    if serve:
        from .server import make_server

        server = make_server(view, port)
        console.print(f"serving {escape(str(run))} at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)",
                      soft_wrap=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
        return
    target = write_report(view, out or run / "view")
    console.print(f"{len(view.sample_ids)} samples; open file://{escape(str(target))}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("view")(view_command)
