"""``polar cluster gather``: the captures every node kept, copied into one directory (``gather.py``).
Ray is imported only when the command runs (``polar --help`` and one-machine use never need it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

cluster_app = typer.Typer(help="The Ray placement's cluster: gather the captures each node kept (docs/cluster.md).",
                          no_args_is_help=True)


@cluster_app.command("gather")
def gather_command(
    to: Annotated[Path, typer.Option("--to", help="Where to copy: DIR/<node id>/ per node, DIR/gather.json.")],
    config: Annotated[Optional[Path], typer.Option(help="The loop's TOML: its [placement] address and node_dir.")] = None,
    address: Annotated[Optional[str], typer.Option(help="The Ray cluster (HOST:6379, or auto).")] = None,
    node_dir: Annotated[Optional[str], typer.Option(help="The node directory every node used (absolute).")] = None,
    node_resource: Annotated[str, typer.Option(help="Only nodes with this custom resource.")] = "",
) -> None:
    """Copy every node's capture directory (and logs) into DIR/<node id>/, through Ray."""
    from polar_core import paths

    if config is not None:
        from polar_runtime.loop.config import ConfigError, load_config

        try:
            cfg = load_config(config)
        except ConfigError as exc:
            raise typer.BadParameter(str(exc)) from None
        address = address or cfg.placement.address or None
        node_dir = node_dir or cfg.placement.node_dir or str(paths.absolute(Path(cfg.out)) / "nodes")
        node_resource = node_resource or cfg.placement.node_resource
    if not node_dir or not address:
        raise typer.BadParameter("give --config LOOP.toml, or --address and --node-dir")
    import ray

    from .gather import gather

    ray.init(address=address, namespace="polar", log_to_driver=False)
    try:
        res = gather(node_dir, paths.absolute(to), node_resource)
    finally:
        ray.shutdown()
    lost = [n for n, r in res.items() if r["state"] == "unreachable"]
    typer.echo(f"{sum(r['files'] for r in res.values())} files from {len(res)} node dir(s) into {to}"
               + (f"; unreachable (lost, no live node sees them): {', '.join(n[:12] for n in lost)}" if lost else ""))
    if lost:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(cluster_app, name="cluster")
