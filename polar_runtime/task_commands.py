"""CLI: ``polar tasks check|list|convert`` -- Harbor task directories, checked the way Harbor checks
them: the ``oracle`` (the reference solution) must score 1 and ``nop`` (doing nothing) must score
below it, each in exactly the sandbox an agent gets. No model server is involved, so checking a
dataset takes seconds (the built-in sets and examples/swe-mini: ~1 s per task on 2 cores).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

tasks_app = typer.Typer(no_args_is_help=True, help="Harbor task directories: check (oracle and nop), list, convert.")
console = Console()


def check_tasks(tasks: list[Any], *, work: Path, sandbox: str = "auto", concurrency: int = 2,
                timeout: float | None = None) -> list[dict[str, Any]]:
    """Run the oracle and nop once on every task; one row per task with both rewards and a verdict
    (``ok``, or why not)."""
    from polar_runtime import rollout as r
    from polar_runtime.harnesses import Endpoint, get_preset

    rows: dict[str, dict[str, Any]] = {t.id: {"task": t.id} for t in tasks}
    for name in ("oracle", "nop"):
        cfg = r.RolloutConfig(tasks=tasks, preset=get_preset(name), endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
                              capture_dir=work / name, model="-", samples=1, concurrency=concurrency,
                              timeout=timeout or 600.0, settle_s=0.0, sandbox=sandbox, work_root=work / "work" / name)
        df = r.run_rollout(cfg)
        for row in df.iter_rows(named=True):
            rows[row["task_id"]][name] = row
    out = []
    for t in tasks:
        rec = rows[t.id]
        oracle, nop = rec.get("oracle") or {}, rec.get("nop") or {}
        o, n = oracle.get("reward"), nop.get("reward")
        problems = []
        if not t.has_solution:
            problems.append("no solution/solve.sh")
        elif o is None or o < 1:
            why = (oracle.get("error") or oracle.get("evaluator_output") or "").strip().splitlines()
            problems.append(f"oracle scored {o if o is not None else 'nothing'}" + (f" ({why[-1][:160]})" if why else ""))
        if n is None and nop.get("evaluator_status") in ("error", "timeout"):
            problems.append(f"nop: verifier {nop.get('evaluator_status')}")
        elif o is not None and n is not None and n >= o:
            problems.append(f"nop scored {n} >= oracle {o}: the tests do not test anything")
        out.append({"task": t.id, "oracle": o, "nop": n, "oracle_s": oracle.get("wall_s"),
                    "verdict": "ok" if not problems else "; ".join(problems),
                    "oracle_verifier": oracle.get("verifier_dir"), "notes": t.notes})
    return out


@tasks_app.command("check")
def check_command(
    path: Annotated[str, typer.Argument(help="A task dir, a dataset dir, a JSONL file or a built-in set (coding).")],
    sandbox: Annotated[str, typer.Option(help="Sandbox backend: auto, bubblewrap, docker, podman, apptainer, host (no isolation).")] = "auto",
    concurrency: Annotated[int, typer.Option(help="Tasks at once.")] = 2,
    work: Annotated[Optional[Path], typer.Option(help="Where the samples' dirs go (default: a temporary dir).")] = None,
) -> None:
    """Run the oracle and nop on every task; exit 1 when an oracle scores below 1 or a nop scores as
    high as its oracle."""
    from polar_runtime import tasks as T

    try:
        tasks = T.load_tasks(path)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="polar-tasks-check-") as tmp:
        rows = check_tasks(tasks, work=work or Path(tmp), sandbox=sandbox, concurrency=concurrency)
    table = Table(title=f"polar tasks check {path} ({len(rows)} tasks, sandbox {sandbox}, {time.monotonic() - t0:.1f} s)")
    for col in ("task", "oracle", "nop", "oracle s", "verdict"):
        table.add_column(col, justify="right" if col in ("oracle", "nop", "oracle s") else "left")
    bad = 0
    for row in rows:
        ok = row["verdict"] == "ok"
        bad += not ok
        fmt = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
        table.add_row(row["task"], fmt(row["oracle"]), fmt(row["nop"]), fmt(row["oracle_s"]),
                      row["verdict"] if ok else f"[red]{row['verdict']}[/red]")
    console.print(table)
    if bad:
        console.print(f"[red]{bad} of {len(rows)} tasks failed the check[/red]")
        raise typer.Exit(1)
    console.print(f"all {len(rows)} tasks pass: oracle 1, nop below it")


@tasks_app.command("list")
def list_command(path: Annotated[str, typer.Argument(help="A task dir, dataset dir, JSONL file or built-in set.")] = "coding") -> None:
    """The tasks of a dataset: id, limits, whether it has a solution, and the first line of its instruction."""
    from polar_runtime import tasks as T

    try:
        tasks = T.load_tasks(path)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    table = Table(title=f"{path}: {len(tasks)} tasks")
    for col in ("task", "workdir", "agent s", "verifier s", "cpus", "memory MB", "internet", "solution", "instruction"):
        table.add_column(col)
    for t in tasks:
        table.add_row(t.id, t.workdir, str(t.timeout or "-"), str(t.verifier_timeout or "-"), str(t.cpus or "-"),
                      str(t.memory_mb or "-"), "yes" if t.allow_internet else "no", "yes" if t.has_solution else "no",
                      t.instruction.splitlines()[0][:60])
    console.print(table)


@tasks_app.command("convert")
def convert_command(
    jsonl: Annotated[Path, typer.Argument(help="A JSONL file of the shorthand.")],
    out: Annotated[Path, typer.Argument(help="Dataset directory to write the Harbor task directories into.")],
) -> None:
    """Write each shorthand task as a Harbor task directory (task.toml, instruction.md, environment/,
    tests/test.sh, solution/solve.sh)."""
    from polar_runtime.tasks import load_tasks, write_harbor_dir

    try:
        tasks = load_tasks(jsonl)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    for t in tasks:
        console.print(f"wrote {write_harbor_dir(t, out)}")


def register(app: typer.Typer) -> None:
    app.add_typer(tasks_app, name="tasks")
