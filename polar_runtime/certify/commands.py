"""``polar certify``: is this harness, on this model, fit to train on? One cell or a matrix of them.

    polar certify --harness pi-chat --model qwen2.5-coder-0.5b-instruct
    polar certify loop.toml                                   # its [model], [harness], [sandbox] keys
    polar certify --harness pi-chat --model tiny-qwen --upstream http://127.0.0.1:8000
    polar certify --harness pi-chat --harness codex --model tiny-r1 --shard 0/2   # half the cells
    polar certify --matrix                                    # docs/certify.md and the README summary from the committed cells

Cells (each harness x each model) run one at a time under ``--out``, each in its own directory with
its ``certify.json``; a cell that has one is done and skipped on the next run (``--fresh`` runs it
again), one without it is started over. ``--shard I/N`` takes every N-th cell from the I-th, so N
machines share a matrix. Exit status 1 when any cell FAILs, 2 on a usage error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/", 1))
    except ValueError:
        raise typer.BadParameter(f"--shard takes I/N (e.g. 0/2), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise typer.BadParameter(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return i, n


def cells_of(harnesses: list[str], models: list[str], shard: tuple[int, int]) -> list[tuple[str, str]]:
    """Every harness x model, in a fixed order, then this shard's share of them."""
    cells = [(h, m) for h in harnesses for m in models]
    i, n = shard
    return [c for k, c in enumerate(cells) if k % n == i]


def certify_command(
    config: Annotated[Optional[Path], typer.Argument(help="A `polar loop` TOML file: its \\[model], \\[harness], \\[sandbox] "
                                                     "and \\[sampling] keys are used (tasks and training are certify's own).")] = None,
    harness: Annotated[Optional[list[str]], typer.Option("--harness", help="Harness preset (repeat for several; "
                                                         "default: the config's, else pi-chat).")] = None,
    model: Annotated[Optional[list[str]], typer.Option("--model", help="Polar model name or model directory (repeat "
                                                       "for several; default: the config's, else the 0.5B).")] = None,
    upstream: Annotated[Optional[str], typer.Option(help="A running vLLM (started by `polar serve`: dev mode, "
                                                    "--enable-scale-out) to use instead of starting one; its base "
                                                    "weights are reloaded at the end.")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="Seconds per harness run (default: the config's "
                                                     "harness.timeout_s, else the loop's: 150 on CPU, 300 on a GPU).")] = None,
    out: Annotated[Path, typer.Option(help="Where the cells' runs and results go.")] = Path("runs/certify"),
    shard: Annotated[Optional[str], typer.Option(help="I/N: run only every N-th cell, from the I-th.")] = None,
    fresh: Annotated[bool, typer.Option(help="Run cells again even when they have a result.")] = False,
    regrade: Annotated[bool, typer.Option(help="Grade finished cells again from their directories (after a change "
                                          "to a check) instead of skipping them; nothing runs.")] = False,
    publish: Annotated[bool, typer.Option(help="Copy each cell's result to benchmarks/results/certify/ and "
                                          "regenerate the matrix in docs/certify.md.")] = False,
    matrix: Annotated[bool, typer.Option(help="Only regenerate docs/certify.md's matrix and the README's summary from the committed "
                                         "results, and exit.")] = False,
) -> None:
    """Certify a harness on a model: a short live rollout through the proxy (tools, follow-up turns,
    reasoning), one training step and a push, then each property checked with its number: PASS,
    FAIL or NOT EXERCISED. Writes a JSON report per cell; exits 1 on any FAIL."""
    from polar_core import paths
    from polar_runtime.loop.config import ConfigError, LoopConfig, load_config

    from . import matrix as mx
    from .report import console, exit_code, print_cell
    from .runner import CELL_FILE, cell_name, certify_config, run_cell
    from .runner import regrade as regrade_cell

    con = console()
    if matrix:
        changed = mx.write_region()
        con.print(f"{mx.DOC}, {mx.README.name}: {'matrix regenerated' if changed else 'matrix already up to date'}")
        return
    try:
        base = load_config(config) if config else LoopConfig()
    except ConfigError as exc:
        con.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    if timeout is not None:
        base.harness.timeout_s = timeout
    cells = cells_of(harness or [base.harness.name], model or [base.model.name], parse_shard(shard))
    from polar_runtime import harnesses as h

    for name in {c[0] for c in cells}:
        try:
            h.get_preset(name)
        except KeyError as exc:
            raise typer.BadParameter(str(exc).strip("'\"")) from None
    if upstream and len({m for _, m in cells}) > 1:
        raise typer.BadParameter("--upstream serves one model: give one --model")
    root = paths.absolute(out)
    reports: list[dict[str, Any]] = []
    for h, m in cells:
        cell_dir = root / cell_name(h, m)
        done = cell_dir / CELL_FILE
        if done.is_file() and regrade:
            rep = regrade_cell(cell_dir)
            con.print(f"[dim]{h} x {m}: graded again from {cell_dir}[/dim]")
        elif regrade:
            con.print(f"[yellow]{h} x {m}: no finished cell in {cell_dir} to grade[/yellow]")
            continue
        elif done.is_file() and not fresh:
            rep = json.loads(done.read_text())
            con.print(f"[dim]{h} x {m}: done before ({done}), skipped[/dim]")
        else:
            if cell_dir.exists():  # an interrupted (or --fresh) cell starts over
                shutil.rmtree(cell_dir)
            con.rule(f"[bold]certify {h} x {m}[/bold]")
            from polar_core.processes import interruptible, stop_all_children

            try:
                with interruptible():
                    rep = run_cell(certify_config(base, h, m, cell_dir), cell_dir, upstream=upstream, log=con.print)
            except KeyboardInterrupt:
                stop_all_children()
                con.print("[yellow]interrupted: run the same command again to resume (finished cells are kept)[/yellow]")
                raise typer.Exit(130) from None
        reports.append(rep)
        print_cell(rep, con)
        if publish:
            mx.RESULTS.mkdir(parents=True, exist_ok=True)
            (mx.RESULTS / f"{cell_name(h, m)}.json").write_text(json.dumps(
                {k: v for k, v in rep.items() if k != "traceback"}, indent=2, default=str) + "\n")
    summary = root / "certify-report.json"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps({"cells": reports}, indent=2, default=str))
    con.print(f"report: {summary}")
    if publish:
        mx.write_region()
        con.print(f"matrix: {mx.DOC}")
    raise typer.Exit(exit_code(reports))


def register(app: typer.Typer) -> None:
    app.command("certify")(certify_command)
