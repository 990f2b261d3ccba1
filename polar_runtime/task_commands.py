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
from rich.markup import escape
from rich.table import Table

from polar_core.console import make_console
#: CONTAINER_BACKENDS: the backends that build a task's image for real (polar_trial/tasks/imagebuild.py): their
#: Dockerfiles are planned for that, not for the local mode's subset
from polar_trial import CONTAINER_BACKENDS, FAILED, from_notes

tasks_app = typer.Typer(no_args_is_help=True, help="Harbor task directories: check (oracle and nop), list, convert.")
console = make_console()


def check_tasks(tasks: list[Any], *, work: Path, sandbox: str = "auto", concurrency: int = 2,
                timeout: float | None = None) -> list[dict[str, Any]]:
    """Run the oracle and nop once on every task; one row per task with both rewards, a ``status``
    (``passed``, ``failed`` or ``refused``), a ``verdict`` (``ok``, or why not) and the task's notes.

    ``refused``: the backend cannot run the task (found before running it, or its build failed;
    the reason names the backend), or the oracle ran out of memory at a limit clamped to this
    host (the task asks for more than it has);
    ``failed``: no reference solution, an oracle that scored below 1 (a broken solution or
    verifier: the failing tests are named, else the verifier output's end), or, only when the
    oracle scored 1, a nop that scored as high (tests that test nothing)."""
    from polar_runtime import rollout as r
    from polar_runtime.harnesses import Endpoint, get_preset
    from polar_trial import static_check

    refusals: dict[str, str] = {}
    check_notes: dict[str, list[str]] = {}
    for t in tasks:
        try:
            why, check_notes[t.id] = static_check(t, sandbox)
        except Exception as exc:  # noqa: BLE001 - reading a task never refuses it: it runs, said
            why, check_notes[t.id] = None, [f"its scripts were not read before running ({type(exc).__name__}: "
                                            f"{exc}); it runs unchecked"]
        if why:
            refusals[t.id] = why
    runnable = [t for t in tasks if t.id not in refusals]
    rows: dict[str, dict[str, Any]] = {t.id: {"task": t.id} for t in tasks}
    for name in ("oracle", "nop") if runnable else ():
        cfg = r.RolloutConfig(tasks=runnable, preset=get_preset(name), endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
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
        err = str(oracle.get("error") or "")
        failures = from_notes(oracle.get("sandbox_notes"))
        status, problems = "failed", []
        if t.id in refusals:
            status, problems = "refused", [refusals[t.id]]
        elif err.startswith("environment:"):
            status, problems = "refused", [(f"the task's image could not be built by the {sandbox} backend: "
                                            if sandbox in CONTAINER_BACKENDS else
                                            "the local mode could not build the environment: ")
                                           + err.removeprefix("environment:").strip()[:600]]
        elif not t.has_solution:
            problems.append("no solution/solve.sh: the oracle cannot be checked")
        elif (o is None or o < 1) and "memory limit hit" in (oracle.get("sandbox_notes") or ""):
            status, problems = out_of_memory(t)
        elif o is None or o < 1:
            why = (err or oracle.get("evaluator_output") or "").strip().splitlines()
            what = "the verifier wrote no reward" if o is None else f"scored {o:g}"
            tests = [f.removeprefix(FAILED) for f in failures if f.startswith(FAILED)]
            problems.append(f"oracle failed: {what}" + (f"; failed tests: {'; '.join(tests)}" if tests else
                                                        f" ({why[-1][:200]})" if why else ""))
        elif n is None and nop.get("evaluator_status") in ("error", "timeout"):
            problems.append(f"nop: verifier {nop.get('evaluator_status')}")
        elif n is not None and n >= o:
            problems.append(f"tests test nothing: nop scored {n:g}, as high as the oracle's {o:g}")
        if not problems:
            status = "passed"
        out.append({"task": t.id, "status": status, "oracle": o, "nop": n, "oracle_s": oracle.get("wall_s"),
                    "verdict": "ok" if not problems else "; ".join(problems),
                    "oracle_verifier": oracle.get("verifier_dir"), "notes": list(t.notes) + build_notes(t, sandbox)
                    + check_notes.get(t.id, []) + stand_ins(oracle) + [f"oracle: {f}" for f in failures]})
    return out


def out_of_memory(task: Any) -> tuple[str, list[str]]:
    """(status, problems) of an oracle the OOM killer ended: at a limit clamped to this host it is
    the host's shortfall (refused: the task asks for more than this host has), never "oracle
    failed"; at the task's own limit it is the oracle's failure, said as such."""
    asked = task.clamped.get("memory_mb")
    limit = task.limits()["memory_mb"]
    if asked:
        return "refused", [f"out of memory at the clamped limit: the oracle was OOM-killed at {limit} MiB, this "
                           f"host's memory; the task asks for {asked:g} MiB"]
    return "failed", [f"oracle failed: out of memory at the task's limit of {limit} MiB (the OOM killer ran)"]


def build_notes(task: Any, sandbox: str) -> list[str]:
    """The environment's notes; under a container backend the phases run in the image (or its
    stand-in), so the local mode's "the host's toolchain stands in" does not apply."""
    notes = list(task.environment.notes) if task.environment is not None else []
    if sandbox in ("docker", "podman"):
        notes = [n for n in notes if not n.endswith("the host's toolchain stands in for it")]
    return notes


def stand_ins(row: dict[str, Any]) -> list[str]:
    """The stand-ins a phase ran on (images, astral's uv installer: a container backend says so in
    its notes) and whether task.toml's docker_image was pulled or the Dockerfile built instead,
    once each."""
    notes = (row.get("sandbox_notes") or "").splitlines()
    return list(dict.fromkeys(n.removeprefix("verifier: ") for n in notes
                              if "STAND-IN" in n or n.startswith("[environment] docker_image ")))


def refused_row(task: str, reason: str) -> dict[str, Any]:
    return {"task": task, "status": "refused", "oracle": None, "nop": None, "oracle_s": None, "verdict": reason,
            "oracle_verifier": None, "notes": []}


def load_for_check(path: str, container: bool | str = False) -> tuple[list[Any], list[dict[str, Any]]]:
    """The tasks of ``path`` that load, and a refused row for each that does not (a dataset
    directory never stops at its first bad task). Raises FileNotFoundError / ValueError only when
    ``path`` itself is not a task set."""
    import polar_trial as T
    from polar_trial import load_dataset_report

    p = T.resolve_tasks_path(path)
    if not p.is_dir():
        return T.load_tasks(p), []
    tasks, refused = load_dataset_report(p, container)
    if not tasks and not refused:
        raise ValueError(f"{p}: neither a Harbor task directory (task.toml + instruction.md) nor a dataset of them")
    base = str(p.resolve()) + "/"
    rows = [refused_row(r.task, r.reason.replace(base, "")) for r in refused]
    return tasks, rows


@tasks_app.command("check")
def check_command(
    path: Annotated[str, typer.Argument(help="A task dir, a dataset dir, a JSONL file or a built-in set (coding).")],
    sandbox: Annotated[str, typer.Option(help="Sandbox backend: auto, bubblewrap, docker, podman, apptainer, host (no isolation).")] = "auto",
    concurrency: Annotated[int, typer.Option(help="Tasks at once.")] = 2,
    work: Annotated[Optional[Path], typer.Option(help="Where the samples' dirs go (default: a temporary dir).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the rows as JSON to this file.")] = None,
) -> None:
    """Run the oracle and nop on every task; one row per task: passed, failed (an oracle below 1,
    tests that test nothing, no solution) or refused (what the backend cannot run, named, or a
    task that does not load), with the reason and the notes. Off a terminal every row is whole. Exit 1 when any task failed or was refused."""
    import json

    from polar_trial import resolve_tasks_path

    try:
        tasks, refused = load_for_check(path, container=sandbox if sandbox in CONTAINER_BACKENDS else False)
    except (ValueError, FileNotFoundError, OSError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    ids = [t.id for t in tasks] + [r["task"] for r in refused]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        console.print(f"[red]{path}: duplicate task ids {dup}[/red]")
        raise typer.Exit(2)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="polar-tasks-check-") as tmp:
        rows = check_tasks(tasks, work=work or Path(tmp), sandbox=sandbox, concurrency=concurrency) if tasks else []
    root = str(resolve_tasks_path(path).resolve()) + "/"  # reasons name files relative to the dataset
    rows = sorted(rows + refused, key=lambda r: ids.index(r["task"]))
    for row in rows:
        row["verdict"] = row["verdict"].replace(root, "")
    terminal = console.is_terminal  # off a terminal (a log, CI, a pipe) every row is whole
    table = Table(title=f"polar tasks check {escape(path)} ({len(rows)} tasks, sandbox {sandbox}, {time.monotonic() - t0:.1f} s)")
    for col in ("task", "status", "oracle", "nop", "oracle s", "reason"):
        table.add_column(col, justify="right" if col in ("oracle", "nop", "oracle s") else "left",
                         no_wrap=col != "reason", max_width=70 if col == "reason" and terminal else None,
                         overflow="fold")
    counts = {"passed": 0, "failed": 0, "refused": 0}
    colours = {"passed": "green", "failed": "red", "refused": "yellow"}
    for row in rows:
        counts[row["status"]] += 1
        fmt = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
        c = colours[row["status"]]
        reason = "" if row["status"] == "passed" else row["verdict"]
        table.add_row(escape(row["task"]), f"[{c}]{row['status']}[/{c}]", fmt(row["oracle"]), fmt(row["nop"]),
                      fmt(row["oracle_s"]), escape(reason if len(reason) <= 140 or not terminal else reason[:137] + "..."))
    console.print(table)
    # every reason in full and every note, one line each (the table keeps to the terminal's width)
    for row in rows:
        if row["status"] != "passed":
            console.print(f"{escape(row['task'])}: [{colours[row['status']]}]{row['status']}[/]: {escape(row['verdict'])}",
                          markup=True, highlight=False, soft_wrap=True)
        for note in row["notes"]:
            console.print(f"{row['task']}: note: {note}", markup=False, highlight=False, soft_wrap=True)
    if json_out is not None:
        json_out.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    bad = counts["failed"] + counts["refused"]
    summary = f"{counts['passed']} passed, {counts['failed']} failed, {counts['refused']} refused of {len(rows)} tasks"
    if bad:
        console.print(f"[red]{summary}[/red]")
        raise typer.Exit(1)
    console.print(f"all {len(rows)} tasks pass: oracle 1, nop below it")


@tasks_app.command("list")
def list_command(path: Annotated[str, typer.Argument(help="A task dir, dataset dir, JSONL file or built-in set.")] = "coding") -> None:
    """The tasks of a dataset: id, limits, whether it has a solution, and the first line of its instruction."""
    import polar_trial as T

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
                      first if len(first := t.instruction.splitlines()[0]) <= 60 or not console.is_terminal
                      else first[:57] + "...")
    console.print(table)


@tasks_app.command("convert")
def convert_command(
    jsonl: Annotated[Path, typer.Argument(help="A JSONL file of the shorthand.")],
    out: Annotated[Path, typer.Argument(help="Dataset directory to write the Harbor task directories into.")],
) -> None:
    """Write each shorthand task as a Harbor task directory (task.toml, instruction.md, environment/,
    tests/test.sh, solution/solve.sh)."""
    from polar_trial import load_tasks, write_harbor_dir

    try:
        tasks = load_tasks(jsonl)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    for t in tasks:
        console.print(f"wrote {write_harbor_dir(t, out)}")


def register(app: typer.Typer) -> None:
    app.add_typer(tasks_app, name="tasks")
