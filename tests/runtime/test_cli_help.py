"""`polar --help` groups the commands by what a user does (``polar_runtime.cli.PANELS``).

Every registered command must have a panel: one registered without a row in the table would fall
into a leftover "Commands" panel at the top of the help, ahead of the four a newcomer needs.
"""

from __future__ import annotations

import re

import typer.main
from typer.testing import CliRunner

from polar_runtime import cli


def _registered() -> list[str]:
    group = typer.main.get_command(cli.app)
    return list(group.commands)


def test_every_registered_command_has_a_panel():
    names = _registered()
    assert len(names) >= 20, names  # the CLI really was built
    missing = [n for n in names if n not in cli.PLACE]
    assert not missing, f"commands without a panel in polar_runtime/cli.py PANELS: {missing}"


def test_the_help_shows_each_command_in_its_panel_in_the_table_order():
    out = CliRunner().invoke(cli.app, ["--help"], env={"COLUMNS": "100", "NO_COLOR": "1"}).output
    titles = [t for t in re.findall(r"╭─ (.+?) ─", out)]
    shown = [p for p in cli.PANELS if any(n in cli.PLACE and n in _registered() for n in cli.PANELS[p])]
    assert titles == ["Options", *shown], titles  # no leftover "Commands" panel, panels in order
    registered = set(_registered())
    for panel, body in zip(titles[1:], re.split(r"╭─ .+? ─+╮\n", out)[2:]):
        listed = re.findall(r"^│ (\S+)\s", body, re.M)
        expected = [n for n in cli.PANELS[panel] if n in registered]
        assert listed == expected, (panel, listed, expected)
