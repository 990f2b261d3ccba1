"""The `polar` command line: the top of the layers, where the areas are wired together.

Each area registers its own commands from its own module (a ``register(app)`` function), so the
CLI stays a thin index and every command lives next to the code it drives. This is the one place
that hands one area's code to another: the proxy's request translators to the analysis (to read
saved flows back into records).
"""

from __future__ import annotations

import typer

from polar_analysis import commands as analysis_commands
from polar_proxy import commands as proxy_commands
from polar_runtime import commands as runtime_commands
from polar_runtime import demo, evaluation, rollout_commands
from polar_runtime.cluster import commands as cluster_commands
from polar_runtime.loop import commands as loop_commands
from polar_training import commands as training_commands

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Polar: token-faithful rollouts and GRPO training for unmodified agent harnesses.",
)


def _translate(provider: str, body, path: str, query: dict[str, str]):
    """The proxy's translators, imported on first use (``polar --help`` stays fast)."""
    from polar_proxy.providers import chat_request_of

    return chat_request_of(provider, body, path, query)


# Order is the order of `polar --help`.
runtime_commands.register(app)  # models, serve
proxy_commands.register(app)  # proxy
rollout_commands.register(app)  # harness, rollout
evaluation.register(app)  # eval
analysis_commands.register(app, translate=_translate)  # calls, inspect, align, drift, trajectories, flows
training_commands.register(app)  # train
demo.register(app)  # demo
loop_commands.register(app)  # loop
cluster_commands.register(app)  # cluster gather (Ray imported when it runs)


@app.command()
def version() -> None:
    """Print Polar's version."""
    print("polar 0.1.0")


if __name__ == "__main__":
    app()
