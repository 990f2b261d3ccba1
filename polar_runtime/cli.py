"""The `polar` command line: the top of the layers, where the areas are wired together.

Each area registers its own commands from its own module (a ``register(app)`` function), so the
CLI stays a thin index and every command lives next to the code it drives. This is the one place
that hands one area's code to another: the proxy's request translators to the analysis (to read
saved flows back into records).

``polar --help`` groups the commands by what a user does (``PANELS``): a flat list of 23 commands
hid the four a newcomer needs among the ones only a developer does. The grouping is a table
consulted by name whenever the help is built, so a command registered anywhere, later, lands in
its panel once its name is in the table (``tests/runtime/test_cli_help.py`` fails for one that
is not).
"""

from __future__ import annotations

import typer

from polar_analysis import commands as analysis_commands
from polar_proxy import commands as proxy_commands
from polar_runtime import commands as runtime_commands
from polar_runtime import demo, evaluation, rollout_commands
from polar_runtime.certify import commands as certify_commands
from polar_runtime.cluster import commands as cluster_commands
from polar_runtime.loop import commands as loop_commands
from polar_runtime.view import commands as view_commands
from polar_training import commands as training_commands
from polar_trial import commands as trial_commands

#: The panels of `polar --help`, in the order shown, each with its commands in the order shown.
#: A new command: add its name here (`certify` and `view` are named ahead of their code).
PANELS: dict[str, tuple[str, ...]] = {
    "Run": ("demo", "loop", "rollout", "eval"),
    "Check": ("certify", "tasks"),
    "Inspect": ("view", "calls", "inspect", "align", "drift", "trajectories", "flows", "captures"),
    "Train": ("train",),
    "Set up": ("models", "harness", "docker", "podman", "serve", "proxy", "version"),
    "Scale": ("slurm", "cluster"),
}
#: command name -> (panel, its place in the help).
PLACE: dict[str, tuple[str, int]] = {
    name: (panel, i) for i, (panel, name) in enumerate((p, n) for p, names in PANELS.items() for n in names)
}


class GroupedHelp(typer.core.TyperGroup):
    """The `polar` group: commands listed and panelled by ``PANELS`` when the help is built.

    Set on the click command, not on each ``@app.command``: the areas register their own commands
    (``register(app)``) and need not know the grouping of the top-level help."""

    def list_commands(self, ctx):  # noqa: D102 - click's
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: PLACE.get(n, ("", len(PLACE)))[1])

    def get_command(self, ctx, cmd_name):  # noqa: D102 - click's
        command = super().get_command(ctx, cmd_name)
        if command is not None and cmd_name in PLACE:
            command.rich_help_panel = PLACE[cmd_name][0]
        return command


app = typer.Typer(
    cls=GroupedHelp,
    no_args_is_help=True,
    add_completion=False,
    help="Polar: token-faithful rollouts and GRPO training for unmodified agent harnesses.",
)


def _translate(provider: str, body, path: str, query: dict[str, str]):
    """The proxy's translators, imported on first use (``polar --help`` stays fast)."""
    from polar_proxy.providers import chat_request_of

    return chat_request_of(provider, body, path, query)


# `polar --help` orders and groups them by PANELS above.
runtime_commands.register(app)  # models, serve
proxy_commands.register(app)  # proxy
rollout_commands.register(app)  # harness, rollout
evaluation.register(app)  # eval
analysis_commands.register(app, translate=_translate)  # calls, inspect, align, drift, trajectories, flows
training_commands.register(app)  # train
demo.register(app)  # demo
loop_commands.register(app)  # loop
cluster_commands.register(app)  # cluster gather (Ray imported when it runs)
certify_commands.register(app)  # certify (a harness x model fit to train on?)
view_commands.register(app)  # view (the run viewer)
trial_commands.register(app)  # docker start|stop|status|env|stand-in


@app.command()
def version() -> None:
    """Print Polar's version."""
    print("polar 0.1.0")


if __name__ == "__main__":
    app()
