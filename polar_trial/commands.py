"""``polar docker``: a private Docker daemon for machines where none runs, and stand-in images.

    polar docker start [--dir D]       start one (own data root, exec root and socket; no iptables,
                                       no bridge); installs docker.io with apt when missing
    eval "$(polar docker env)"         point the docker CLI (and ``--sandbox docker``) at it
    polar docker stop  [--dir D]       stop it
    polar docker status [--dir D]
    polar docker stand-in IMAGE...     build a local stand-in for a base image no registry serves

The daemon lives in ``$POLAR_HOME/dockerd`` by default (``sandbox/dockerd.py``; docs/sandbox.md).

``polar podman``: podman's store of Polar's own (``sandbox/podmanroot.py``), which ``--sandbox
podman`` makes and mounts in ``$POLAR_HOME/podman`` as root and leaves mounted for the next run:

    polar podman status [--dir D]      mounted or not, and its containers
    eval "$(polar podman env)"         point the podman CLI at it
    polar podman stop   [--dir D]      remove its containers and unmount it (its loop device freed)

Wired into ``polar`` by ``polar_runtime/cli.py``, as the other areas' ``commands.py``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from polar_core.console import make_console

docker_app = typer.Typer(no_args_is_help=True, help="A private Docker daemon (start, stop, status, env) and stand-in images.")
console = make_console()
DirOpt = Annotated[Optional[Path], typer.Option("--dir", help="The daemon's directory (default $POLAR_HOME/dockerd).")]


def _daemon(dir: Path | None):
    from polar_trial.sandbox.dockerd import PrivateDockerd, default_root

    return PrivateDockerd(dir or default_root())


@docker_app.command("start")
def start_command(dir: DirOpt = None) -> None:
    """Start the private daemon (nothing when it already answers); prints how to use it."""
    from polar_trial.sandbox.dockerd import DaemonError

    d = _daemon(dir)
    t0 = time.monotonic()
    try:
        started = d.start()
    except DaemonError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None
    what = f"started in {time.monotonic() - t0:.1f} s" if started else "already running"
    console.print(f"dockerd {what}: pid {d.pid()}, data {d.root / 'data'}, log {d.log}")
    console.print(f"use it: export DOCKER_HOST={d.host}   (or: eval \"$(polar docker env)\")", markup=False)


@docker_app.command("stop")
def stop_command(dir: DirOpt = None) -> None:
    """Stop the private daemon of this directory (its containers end with it)."""
    d = _daemon(dir)
    console.print("dockerd stopped" if d.stop() else f"no dockerd of {d.root} is running")


@docker_app.command("status")
def status_command(dir: DirOpt = None) -> None:
    """Whether the private daemon runs and answers."""
    d = _daemon(dir)
    pid, answers = d.pid(), d.answers()
    console.print(f"dockerd of {d.root}: " + (f"pid {pid}, " if pid else "not running, ")
                  + ("answers on " + d.host if answers else "does not answer"), markup=False)
    if not answers:
        raise typer.Exit(1)


@docker_app.command("env")
def env_command(dir: DirOpt = None) -> None:
    """``export DOCKER_HOST=...`` for a shell's eval."""
    print(f"export DOCKER_HOST={_daemon(dir).host}")


@docker_app.command("stand-in")
def standin_command(images: Annotated[list[str], typer.Argument(help="Base images, e.g. python:3.11-slim ubuntu:24.04.")]) -> None:
    """Build (or reuse) a stand-in for each image on the daemon DOCKER_HOST names, from Debian
    packages (debootstrap); said loudly here and in every sandbox run's notes."""
    from polar_trial.sandbox.standin import StandInError, ensure_image

    bad = 0
    for image in images:
        try:
            r = ensure_image(image, env=dict(os.environ))
        except StandInError as e:
            console.print(f"[red]{image}: {e}[/red]")
            bad += 1
            continue
        what = r["stand_in"] or "a real image (not a stand-in)"
        console.print(f"{image}: {what} (rootfs {r['build_s']:g} s, import {r['import_s']:g} s)", markup=False)
    if bad:
        raise typer.Exit(1)


podman_app = typer.Typer(no_args_is_help=True, help="Podman's store of Polar's own (status, env, stop).")
PodmanDirOpt = Annotated[Optional[Path], typer.Option("--dir", help="The store's directory (default $POLAR_HOME/podman).")]


def _store(dir: Path | None):
    from polar_trial.sandbox.podmanroot import PodmanRoot, default_root

    return PodmanRoot(dir or default_root())


@podman_app.command("status")
def podman_status_command(dir: PodmanDirOpt = None) -> None:
    """Whether the store is mounted, and the containers in it (exit 1 when it is not mounted)."""
    import subprocess

    s = _store(dir)
    if not s.mounted():
        console.print(f"podman store of {s.root}: not mounted", markup=False)
        raise typer.Exit(1)
    r = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}} {{.Status}}"], capture_output=True, text=True,
                       env=dict(os.environ, **s.env()), stdin=subprocess.DEVNULL, timeout=60)
    names = r.stdout.split("\n") if r.returncode == 0 else []
    console.print(f"podman store of {s.root}: mounted at {s.root / 'data'}, "
                  f"{len([n for n in names if n])} container(s)", markup=False)


@podman_app.command("env")
def podman_env_command(dir: PodmanDirOpt = None) -> None:
    """``export CONTAINERS_STORAGE_CONF=... CONTAINERS_CONF=...`` for a shell's eval."""
    print("export " + " ".join(f"{k}={v}" for k, v in _store(dir).env().items()))


@podman_app.command("stop")
def podman_stop_command(dir: PodmanDirOpt = None) -> None:
    """Remove the store's containers and unmount it (the next ``--sandbox podman`` mounts it again)."""
    s = _store(dir)
    was = s.mounted()
    s.stop()
    console.print(f"podman store of {s.root}: " + ("unmounted" if was else "was not mounted"), markup=False)


def register(app: typer.Typer) -> None:
    app.add_typer(docker_app, name="docker")
    app.add_typer(podman_app, name="podman")
