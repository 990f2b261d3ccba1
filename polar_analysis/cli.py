"""The `polar` command line.

Each area of the product registers its own commands from its own module (a `register(app)`
function), so the CLI stays a thin index and every command lives next to the code it drives.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Polar: token-faithful rollouts and GRPO training for unmodified agent harnesses.",
)

#: Modules that contribute commands. Order is the order of `polar --help`.
COMMAND_MODULES = (
    "polar_runtime.commands",  # models, serve, harness, setup facts
    "polar_proxy.commands",  # proxy
    "polar_runtime.rollout_commands",  # rollout
    "polar_analysis.commands",  # calls, inspect, drift, trajectories, flows
    "polar_training.commands",  # train
    "polar_runtime.demo",  # demo
)

for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as exc:  # an area not installed yet; only skip its own absence
        if exc.name != _name:
            raise
        continue
    _module.register(app)


@app.command()
def version() -> None:
    """Print Polar's version."""
    print("polar 0.1.0")


if __name__ == "__main__":
    app()
