"""The console every command prints its tables on."""

from __future__ import annotations

import os
import sys
from typing import Any

PIPED_WIDTH = 160
"""Least columns a table gets when stdout is a file or a pipe (a log, `| less`): wide enough that
no heading is cut, where a console would otherwise guess 80."""


def stdout_console(**kwargs: Any) -> Any:
    """A rich Console on stdout: the terminal's width on a terminal; piped, PIPED_WIDTH or COLUMNS,
    whichever is wider (a parent process's readline exports COLUMNS=80 to its children)."""
    from rich.console import Console

    class PipedConsole(Console):
        def on_broken_pipe(self) -> None:   # `hetrain plan | head -1`: rich exits 1; the verb's 141, as for print()
            self.quiet = True
            raise BrokenPipeError

    width = None
    if not sys.stdout.isatty():
        columns = os.environ.get("COLUMNS", "")
        width = max(PIPED_WIDTH, int(columns) if columns.isdigit() else 0)
    return PipedConsole(file=sys.stdout, width=width, **kwargs)
