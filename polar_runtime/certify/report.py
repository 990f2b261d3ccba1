"""A certify report as a readable table (rich), and the exit status it implies.

One table per cell: each check's state and its measured number, with the named failures under it.
A check that did not judge its minimum count of cases says NOT EXERCISED, never PASS.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from polar_core.console import make_console

from .checks import FAIL, MEASURED, NOT_EXERCISED, PASS

STYLE = {PASS: "green", FAIL: "bold red", NOT_EXERCISED: "yellow", MEASURED: "cyan"}


def console() -> Console:
    """Whole rows off a terminal (a log file, CI, a pipe): polar_core.console's width."""
    return make_console()


def cell_table(report: dict[str, Any]) -> Table:
    title = (f"polar certify: {report['harness']} x {report['model']}  [{STYLE.get(report.get('verdict'), '')}]"
             f"{report.get('verdict')}[/]")
    t = Table(title=title, title_justify="left", show_lines=False)
    t.add_column("check")
    t.add_column("state")
    t.add_column("measured")
    t.add_column("cases", justify="right")
    for c in report.get("checks") or []:
        style = STYLE.get(c["state"], "")
        t.add_row(c["name"], f"[{style}]{c['state']}[/]", escape(c["measured"]), f"{c['count']} (min {c['minimum']})")
        for d in c.get("details") or []:
            t.add_row("", "", f"[dim]{escape(d)}[/dim]", "")
    return t


def print_cell(report: dict[str, Any], out: Console | None = None) -> None:
    out = out or console()
    out.print(cell_table(report))
    meta = (f"harness {report.get('harness_version') or '-'}, vLLM {report.get('vllm_version') or '-'}, "
            f"{report.get('date')}, {report.get('machine')}, {report.get('wall_s')} s")
    out.print(f"[dim]{escape(meta)}[/dim]")
    if report.get("error"):
        out.print(f"[red]the run stopped:[/red] {escape(report['error'])}")


def exit_code(reports: list[dict[str, Any]]) -> int:
    """1 when any cell failed (a check FAILed or the run broke), else 0."""
    return 1 if any(r.get("verdict") == FAIL for r in reports) else 0
