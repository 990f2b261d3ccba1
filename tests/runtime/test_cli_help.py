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


def _commands(group, path=()):
    """(path, click command) for every leaf command of the CLI tree."""
    import click

    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def test_no_help_text_loses_a_bracketed_word_to_rich_markup():
    """Rich reads ``[model]`` as a style tag and prints nothing for it (``polar certify --help`` once
    showed "its , , and keys are used"): a help text that names a TOML table must escape it ``\\[``."""
    group = typer.main.get_command(cli.app)
    runner = CliRunner()
    checked, lost = 0, []
    for path, cmd in _commands(group):
        words = {w for p in cmd.params for w in re.findall(r"\\?\[([a-z][a-z_.]*)\]", p.help or "")}
        if not words:
            continue
        out = runner.invoke(cli.app, [*path, "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"}).output
        checked += 1
        lost += [(" ".join(path), w) for w in words if f"[{w}]" not in out]
    assert checked >= 1  # the rule was really applied to some command
    assert not lost, f"bracketed words Rich's markup ate from the help: {lost}"
