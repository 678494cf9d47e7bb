"""The console every command prints its tables on."""

from __future__ import annotations

import argparse
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



def fits(console: Any, table: Any) -> bool:
    """Whether ``table`` prints on ``console`` with every word whole (rich cuts words to "…" below that)."""
    from rich.measure import Measurement

    unclamped = console.options.update_width(1 << 16)   # measured against the console's own width, it says that width
    return Measurement.get(console, unclamped, table).minimum <= console.width


def print_rows(console: Any, headings: list[str], rows: list[list[str]], *, title: str | None = None,
               right: tuple[str, ...] = (), **table_options: Any) -> None:
    """Print ``rows`` as a table under ``headings`` (those in ``right`` right-justified), or, on a terminal
    too narrow for its words (a 60-column terminal, a split pane), one record per row: each heading
    beside its value, the records apart by a blank line, so no figure is cut to "…"."""
    from rich.markup import escape
    from rich.table import Table

    rows = [[escape(cell) for cell in row] for row in rows]   # a device named "gpu[x]" is text, not markup
    table = Table(title=title, **table_options)
    for heading in headings:
        table.add_column(heading, justify="right" if heading in right else "left")
    for row in rows:
        table.add_row(*row)
    if not rows or fits(console, table):
        console.print(table)
        return
    if title:
        console.print(title, style="italic")
    for i, row in enumerate(rows):
        if i:
            console.print()
        record = Table.grid(padding=(0, 1))
        record.add_column(style="bold", no_wrap=True)
        record.add_column(overflow="fold")   # a path longer than the terminal folds, whole
        for heading, cell in zip(headings, row):
            record.add_row(heading, cell)
        console.print(record)
    console.print()


class DefaultsShown(argparse.HelpFormatter):
    """--help names each option's default as the code has it (simulate, profile, k8s, demo and the benchmarks);
    an option whose help already says its default, or whose default is none, off or empty, is left alone."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "(default" in text or default is argparse.SUPPRESS
                or default is None or default is False or default == []):
            return text
        return f"{text} (default: %(default)s)"
