"""`hetrain bench NAME [options] [--json]`: each benchmark lives in hetrain.bench.NAME.

A benchmark module defines `build_parser(parser)`, and `run(args) -> dict` returning the figures;
this verb prints them as one JSON object (`--json`) or as a table.
"""

from __future__ import annotations

import argparse
import importlib
import json

from hetrain.cli.console import DefaultsShown, stdout_console
from hetrain.errors import HetrainError

BENCHES = {
    "balance": "plain DDP with an even split against hetrain's balanced split, on emulated speeds",
    "plan": "planning time on large clusters",
    "memory": "optimizer-state and activation bytes per rank for each memory strategy",
    "recover": "a rank killed mid-run and restarted: steps lost, recovery time, checkpoint cost",
    "comm": "bytes per step and accuracy for each gradient compression",
    "predict": "a plan from a measured CPU profile against the measured step time of the job it plans",
    "pipeline": "the planner's uneven layer partition against an even one and data parallelism, on emulated speeds",
    "data": "plain DDP with DataLoader workers against hetrain's loader, on decoded JPEG images",
}


def build_parser(parser: argparse.ArgumentParser) -> None:
    # optional to argparse, so that a missing name is refused in run() with the list, not "required: name, rest"
    parser.add_argument("name", nargs="?", choices=sorted(BENCHES), help="which benchmark")
    parser.usage = f"%(prog)s [-h] {{{','.join(sorted(BENCHES))}}} [options] [--json]"
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")


def run(args: argparse.Namespace) -> int:
    if args.name is None:
        raise HetrainError(f"name a benchmark: one of {', '.join(sorted(BENCHES))}; "
                           "`hetrain bench NAME --help` for its options")
    module = importlib.import_module(f"hetrain.bench.{args.name}")
    parser = _OneLineParser(prog=f"hetrain bench {args.name}", description=BENCHES[args.name],
                            formatter_class=DefaultsShown)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    module.build_parser(parser)
    bargs = parser.parse_args(args.rest)
    result = module.run(bargs)
    if bargs.json:
        print(json.dumps(result, indent=2, sort_keys=False))
    else:
        _print_table(args.name, result)
    return 0


class _OneLineParser(argparse.ArgumentParser):
    """A benchmark's options: a bad one is one line naming it (no usage block), as every other
    refusal of a benchmark is; --help still shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _print_table(name: str, result: dict) -> None:
    from rich.table import Table

    table = Table(title=f"hetrain bench {name}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, (dict, list)):
            value = json.dumps(value)
        table.add_row(key, str(value))
    stdout_console().print(table)

