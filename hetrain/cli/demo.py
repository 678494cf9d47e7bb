"""`hetrain demo`: two CPU ranks at emulated speeds 1 and 0.5 train a digits classifier, first
with plain DDP and an even split, then with hetrain's balanced split; a table compares them."""

from __future__ import annotations

import argparse
import sys

from hetrain.bench.balance import add_job_options, run_job
from hetrain.cli.console import DefaultsShown, stdout_console
from hetrain.runtime.speeds import parse_speeds


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsShown
    add_job_options(parser)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    parse_speeds(args.speeds, "--speeds")   # a bad value in one line, before the banner
    console = stdout_console()
    console.print(f"[bold]hetrain demo[/]: {len(args.speeds.split(','))} CPU ranks at emulated speeds "
                  f"{args.speeds}, scikit-learn digits, global batch {args.global_batch}, "
                  f"{args.steps} steps per mode ({args.warmup} untimed)")
    r = run_job(args, progress=True, schedule="sequential")
    uni, bal = r["uniform"], r["balanced"]
    ideal = sum(r["solo_samples_per_s"])

    table = Table(title="plain DDP against hetrain (speeds emulated on CPU)")
    table.add_column("")
    table.add_column("plain DDP, even split", justify="right")
    table.add_column("hetrain, balanced", justify="right")
    table.add_row("samples/s", f"{uni['samples_per_s']:.0f}", f"{bal['samples_per_s']:.0f}")
    table.add_row("shares per rank", " / ".join(map(str, uni["shares"])), " / ".join(map(str, bal["shares"])))
    table.add_row("idle fraction per rank", " / ".join(f"{x:.0%}" for x in uni["idle_fraction"]),
                  " / ".join(f"{x:.0%}" for x in bal["idle_fraction"]))
    table.add_row("test accuracy", f"{uni['test_accuracy']:.1%}", f"{bal['test_accuracy']:.1%}")
    table.add_row("training loss", f"{uni['train_loss']:.4f}", f"{bal['train_loss']:.4f}")
    console.print(table)
    console.print(f"speed-up {bal['samples_per_s'] / uni['samples_per_s']:.2f}x over plain DDP; "
                  f"{bal['samples_per_s'] / ideal:.0%} of the ideal {ideal:.0f} samples/s "
                  f"(the sum of each rank's own rate)")
    for c in bal.get("split_changes", []):
        console.print(f"  balancer, step {c['step']}: split {c['old']} -> {c['new']}", style="dim")
    return 0


if __name__ == "__main__":   # `python -m hetrain.cli.demo [options]`: the same as `hetrain demo [options]`
    from hetrain.cli.main import main

    sys.exit(main(["demo", *sys.argv[1:]]))
