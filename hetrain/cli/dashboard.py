"""`hetrain dashboard [--out FILE]`: the Grafana dashboard shipped in the package, for hetrain's
Prometheus series (`hetrain launch --metrics-port`); import it in Grafana (Dashboards, New, Import)."""

from __future__ import annotations

import argparse
import sys

from hetrain.userfiles import check_writable_file


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="write the JSON to FILE (default: print it to stdout)")


def run(args: argparse.Namespace) -> int:
    from hetrain.metrics.dashboard import shipped

    text = shipped()
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = check_writable_file(args.out, "--out")
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}; import it in Grafana (Dashboards, New, Import) and pick the Prometheus data source",
          file=sys.stderr)
    return 0
