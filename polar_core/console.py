"""The rich console every command prints with: whole rows when the output is not a terminal.

Rich lays tables out to the console's width, and a console that writes to a file, a pipe or CI's
log takes 80 columns: cells were cut to "dial…", "samp…", "environment/docker-compose.…", and a
log of ``polar tasks check`` could not be searched for a task's name. So, off a terminal, the
console is :data:`LOG_WIDTH` wide: a table is as wide as its content (rich pads nothing to the
console's width), one row per line. Rules (``console.rule``) stay terminal-wide. On a terminal
nothing changes: rich measures the terminal as before.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console

#: a log line may be this long before rich lays a table out narrower (a row is never cut below it)
LOG_WIDTH = 10_000
#: the width of a rule (``console.rule``) off a terminal
RULE_WIDTH = 100


class _LogConsole(Console):
    def rule(self, title: Any = "", *, characters: str = "─", style: Any = "rule.line", align: Any = "center") -> None:
        from rich.rule import Rule

        self.print(Rule(title=title, characters=characters, style=style, align=align), width=RULE_WIDTH)


def make_console(*, stderr: bool = False, **kwargs: Any) -> Console:
    """A rich ``Console`` (keyword arguments as rich's) that, when its stream is not a terminal,
    lays tables out :data:`LOG_WIDTH` wide instead of 80 columns."""
    stream = kwargs.get("file") or (sys.stderr if stderr else sys.stdout)
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty or "width" in kwargs:
        return Console(stderr=stderr, **kwargs)
    return _LogConsole(stderr=stderr, width=LOG_WIDTH, **kwargs)
