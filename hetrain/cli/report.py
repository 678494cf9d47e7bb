"""`hetrain report RUN_DIR`: a PNG of a run's per-rank figures and a summary table, from its run log."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hetrain.cli.console import print_rows, stdout_console
from hetrain.errors import HetrainError
from hetrain.userfiles import check_writable_file

_IMAGE_FORMATS = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")   # matplotlib's


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run directory (HETRAIN_RUN_DIR, or the checkpoint directory)")
    parser.add_argument("--out", default=None, help="where to write the PNG (default: RUN_DIR/report.png)")
    parser.add_argument("--json", action="store_true", help="print the summary rows as JSON instead of a table")
    parser.add_argument("--tensorboard", nargs="?", const="", default=None, metavar="DIR",
                        help="also write TensorBoard scalars (default DIR: RUN_DIR/tensorboard); needs tensorboard")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _close(items: float | None, samples: float | None) -> bool:
    return items is None or samples is None or abs(items - samples) <= 1e-6 * max(abs(samples), 1.0)


def _place(row: dict, before: str) -> str:
    """A pipeline rank's stage (and replica, where there are several), counted from 0 as in the plan."""
    if row.get("stage") is None:
        return ""
    replica = f", replica {row['replica']}" if (row.get("replicas") or 1) > 1 else ""
    return f"{before}stage {row['stage']} of {row['stages']}{replica}"


def print_table(console, rows: list[dict]) -> None:
    from rich import box

    columns = [("rank", "d"), ("device", "s"), ("steps", "d"), ("step s", ".4f"), ("predicted step s", ".4f"),
               ("samples/s", ".1f"), ("share", ".1%"), ("compute", ".1%"), ("wait ranks", ".1%"),
               ("wait data", ".1%"), ("script", ".1%"), ("wait ckpt", ".1%"), ("MFU", ".2%"), ("comm sent", "s"),
               ("ckpts", "d"), ("restarts", "d")]
    keys = ["rank", "device", "steps", "step_seconds", "predicted_step_seconds", "samples_per_second", "share",
            "compute", "waiting on ranks", "waiting for data", "script", "checkpoint", "mfu", "comm_bytes",
            "checkpoints", "restarts"]
    if any(not _close(row.get("items_per_second"), row["samples_per_second"]) for row in rows):
        columns.insert(6, ("items/s", ".1f"))   # num_items counted tokens: the work varies by sample
        keys.insert(6, "items_per_second")
    split = {row["rank"] for row in rows if sum(r["rank"] == row["rank"] for r in rows) > 1}
    cells = []
    for row in rows:
        cells.append([])
        for key, (_, spec) in zip(keys, columns):
            value = row[key]
            if key == "device" and row["rank"] in split:   # a rank that resumed on another device: a row each
                cells[-1].append(f"{value}\nsteps {row['first_step']}-{row['last_step']}{_place(row, ', ')}")
            elif key == "device" and row.get("stage") is not None:
                cells[-1].append(f"{value}{_place(row, chr(10))}")
            elif key == "comm_bytes" and value is not None:
                cells[-1].append(f"{value / 1e9:.1f} GB" if value >= 1e10 else f"{value / 1e6:.1f} MB")
            else:
                cells[-1].append(_fmt(value, spec))
    headings = [name for name, _ in columns]
    # one space between columns and no side borders: sixteen columns and whole device names fit 136 columns
    print_rows(console, headings, cells, title="hetrain run report", right=tuple(h for h in headings if h != "device"),
               box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0))


def run(args: argparse.Namespace) -> int:
    if args.tensorboard is not None:   # refused before the table and the PNG are made, not after
        from importlib.util import find_spec

        if find_spec("tensorboard") is None:
            raise HetrainError("--tensorboard needs the tensorboard package; fix: pip install 'hetrain[tensorboard]'")
    from hetrain.metrics.report import load_run, summary_rows
    from hetrain.metrics.report_plot import draw

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        what = "is a file, not a directory" if run_dir.exists() else "does not exist"
        raise HetrainError(f"run directory {args.run_dir!r} {what}; give the directory the job wrote")
    runs = load_run(run_dir)
    for run in runs.values():   # on stderr: --json keeps stdout JSON
        if run.skipped_lines:
            print(f"hetrain report: note: {run.log}: {run.skipped_lines} line(s) skipped, not whole records (torn, "
                  "garbled or not UTF-8, or a step line missing a figure)", file=sys.stderr)
    rows = summary_rows(runs)
    emulated = any(r["emulated"] for r in rows)
    out = check_writable_file(args.out, "--out") if args.out else run_dir / "report.png"
    if not out.suffix:   # matplotlib writes a name without one as PNG, adding .png: say the name it writes
        out = out.with_name(out.name + ".png")
    if out.suffix.lower().lstrip(".") not in _IMAGE_FORMATS:
        raise HetrainError(f"--out {str(out)!r}: {out.suffix} is not an image format the report writes; "
                           f"use .png, .svg or .pdf (e.g. {out.name}.png)")
    title = f"hetrain run {run_dir.resolve().name}: {len(runs)} ranks" + (" (emulated device speeds)" if emulated else "")
    try:
        draw(runs, out, title)
    except OSError as e:
        raise HetrainError(f"cannot write --out {str(out)!r} ({e.strerror}); choose a writable path") from None
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        console = stdout_console()
        print_table(console, rows)
        if emulated:
            console.print("timings are emulated: CPU ranks standing in for other devices (a plan's devices, or "
                          "--emulate-speeds)")
        console.print(f"figure: {out}")
    if args.tensorboard is not None:
        from hetrain.metrics.tensorboard import write_scalars

        tb = write_scalars(runs, Path(args.tensorboard) if args.tensorboard else run_dir / "tensorboard")
        print(f"tensorboard scalars: {tb}", file=sys.stderr if args.json else sys.stdout)   # --json: stdout is JSON
    return 0
