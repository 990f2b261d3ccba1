"""``polar loop CONFIG.toml``: the RL loop driven by one TOML file; the same command resumes it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from polar_core.console import make_console

console = make_console()  # whole rows off a terminal (polar_core/console.py)


def print_summary(report: dict[str, Any]) -> None:
    t = Table(title=f"polar loop: {report['out']}", title_justify="left")
    for c in ("step", "policy", "samples", "mean reward", "groups w/ variance", "trained -> pushed", "note"):
        t.add_column(c, justify="left" if c == "note" else "right")
    for s in report["steps"]:
        rw = s["rewards"]
        mean = "-" if rw["mean_reward"] is None else f"{rw['mean_reward']:.3f}"
        tr = s.get("train") or {}
        pushed = f"v{tr['policy_version']} ({(s.get('push') or {}).get('method', '-')})" if tr.get("updated") else "-"
        t.add_row(str(s["step"]), f"v{s['policy_version']}", str(rw["samples"]), mean,
                  str(len(s.get("groups_with_variance") or [])), pushed, s.get("note") or "")
    console.print(t)
    console.print(f"staleness of trained tokens (versions behind: tokens): {report['staleness_tokens'] or '-'}")
    t = report.get("timing") or {}
    if t:
        console.print(f"idle: trainer {t['trainer_idle_frac']:.1%}, vLLM {t['vllm_idle_frac']:.1%} of {t['wall_s']:.0f} s"
                      f" (both busy {t.get('overlap_s', 0.0):.0f} s)"
                      f"   dropped groups (stragglers over the bound): {len(report.get('dropped_groups') or [])}")
    console.print(f"resumes: {report['resumes']}   finished: {report['finished']}   policy v{report['policy_version']}"
                  f"   checkpoint: {report['checkpoint'] or '-'}")


def loop_command(
    config: Annotated[Optional[Path], typer.Argument(help="The loop's TOML file (`polar loop --example` prints one).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Run directory (overrides the file's `out`).")] = None,
    fresh: Annotated[bool, typer.Option(help="Start over: remove the run directory instead of resuming it.")] = False,
    example: Annotated[bool, typer.Option(help="Print a complete configuration with every default, and exit.")] = False,
) -> None:
    """The RL loop (rollouts -> GRPO step -> push) from one TOML file. Run the same command again after
    an interruption (even kill -9): it resumes from the last finished step."""
    from polar_core import paths

    from .config import ConfigError, example_toml, load_config

    if example:
        print(example_toml(), end="")
        return
    if config is None:
        raise typer.BadParameter("a CONFIG.toml is needed (or --example)")
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    if out is not None:
        cfg.out = str(out)
    run_dir = paths.absolute(Path(cfg.out))
    if fresh and run_dir.exists():
        console.print(f"[yellow]--fresh: removing {run_dir}[/yellow]")
        shutil.rmtree(run_dir)
    from polar_core.processes import interruptible, stop_all_children

    from .loop import LoopError, run_loop
    from .placement import make_placement

    try:
        with interruptible():
            report = run_loop(cfg, make_placement(cfg, run_dir), run_dir, log=console.print)
    except KeyboardInterrupt:
        stop_all_children()
        console.print("[yellow]interrupted: run the same command again to resume[/yellow]")
        raise typer.Exit(130) from None
    except (LoopError, RuntimeError, FileNotFoundError, ValueError) as exc:
        console.print(f"[red]polar loop failed:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    print_summary(report)
    from polar_runtime.view.commands import view_hint

    console.print(f"[bold]browse the run[/bold]  {escape(view_hint(run_dir))}", soft_wrap=True)


def slurm_command(
    config: Annotated[Path, typer.Argument(help="The loop's TOML file (its placement: kind = \"ray\", address = \"auto\").")],
    nodes: Annotated[int, typer.Option(help="Nodes in the allocation (the first one runs the Ray head and the loop).")],
    cpus_per_node: Annotated[int, typer.Option(help="CPUs per node, given to Slurm and to Ray.")],
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node (0: none requested).")] = 0,
    time: Annotated[str, typer.Option(help="Slurm time limit (HH:MM:SS, D-HH:MM:SS or minutes).")] = "04:00:00",
    job_name: Annotated[str, typer.Option(help="Slurm job name.")] = "polar-loop",
    partition: Annotated[Optional[str], typer.Option(help="Slurm partition.")] = None,
    account: Annotated[Optional[str], typer.Option(help="Slurm account.")] = None,
    venv: Annotated[Optional[Path], typer.Option(help="Virtualenv with polar and ray on every node (default: this one).")] = None,
    log_dir: Annotated[Optional[Path], typer.Option(help="Where Slurm writes the job's output (default: the config's directory).")] = None,
    ray_port: Annotated[int, typer.Option(help="The Ray head's port.")] = 6379,
    template: Annotated[Optional[Path], typer.Option(help="A template of your own (default: the shipped slurm.sbatch.tmpl).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the script here (default: stdout).")] = None,
) -> None:
    """Print an sbatch script that starts Ray on a Slurm allocation and runs `polar loop CONFIG` on it
    (docs/slurm.md). Submit it with `sbatch`."""
    from .slurm import SlurmJob, TemplateError, render

    job = SlurmJob(config=config, nodes=nodes, cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node, time=time,
                   job_name=job_name, venv=venv, log_dir=log_dir, partition=partition, account=account, ray_port=ray_port)
    try:
        script = render(job, template.read_text() if template else None)
    except (TemplateError, OSError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    if output is None:
        print(script, end="")
    else:
        output.write_text(script)
        output.chmod(0o755)
        console.print(f"wrote {output}: submit it with `sbatch {output}`")


def register(app: typer.Typer) -> None:
    app.command("loop")(loop_command)
    app.command("slurm")(slurm_command)
