"""`hetrain simulate`: sweep cluster sizes or mixes, plot predicted samples/s and scaling
efficiency per strategy (PNG), and write the figures (CSV)."""

from __future__ import annotations

import argparse
import os
import math
import csv
import sys

from hetrain.cli.console import DefaultsShown
from hetrain.errors import HetrainError, NoPlanFits
from hetrain.userfiles import check_writable_file

NO_FIT = "does not fit"   # the strategy cell of a CSV row for a size where no plan fits


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsShown
    parser.add_argument("--model", default="resnet152", help="reference model name (see hetrain plan --help)")
    parser.add_argument("--mix", default="a100:1,v100:1",
                        help="device mix repeated at each size, MODEL:COUNT,...")
    parser.add_argument("--sizes", default="1,2,4,8,16,32", help="how many copies of the mix, comma-separated")
    parser.add_argument("--per-node", type=int, default=8, help="devices per node (NVLink inside, network between)")
    parser.add_argument("--inter-node-gbps", type=float, default=100.0, help="network bandwidth per node, Gb/s")
    parser.add_argument("--batch-per-device", type=int, default=64, help="global batch = this x devices")
    parser.add_argument("--out", default="simulate",
                        help="output prefix: PREFIX.png and PREFIX.csv (a .png or .csv ending is dropped: "
                             "--out sweep.png writes sweep.png and sweep.csv; a directory gets DIR/simulate.*)")


def _mix(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        name, _, count = item.strip().partition(":")
        if not name or not (count or "1").isdigit() or int(count or "1") < 1:
            raise HetrainError(f"--mix {text!r}: write MODEL:COUNT,... with positive counts, e.g. a100:1,v100:1")
        out.append((name, int(count or "1")))
    return out


def sweep_cluster(mix: list[tuple[str, int]], copies: int, per_node: int, gbps: float):
    """`copies` of the mix, packed onto nodes of `per_node` devices of one model each."""
    from hetrain.hardware.cluster import cluster_from_dict

    nodes = []
    for name, count in mix:
        left = count * copies
        while left > 0:
            n = min(per_node, left)
            nodes.append({"name": f"{name}-{len(nodes)}", "devices": [{"model": name, "count": n}]})
            left -= n
    return cluster_from_dict({"name": "sweep", "nodes": nodes, "inter_node_gbps": gbps}, source="simulate")


def run(args: argparse.Namespace) -> int:
    from hetrain.planning.planner import plan_job
    from hetrain.workload import get_profile

    profile = get_profile(args.model)
    mix = _mix(args.mix)
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",")})   # the plot's lines go left to right
    except ValueError:
        raise HetrainError(f"--sizes {args.sizes!r}: write positive integers, e.g. 1,2,4,8") from None
    if any(s < 1 for s in sizes) or args.batch_per_device < 1 or args.per_node < 1:
        raise HetrainError("--sizes, --batch-per-device and --per-node must be positive")
    if not (math.isfinite(args.inter_node_gbps) and args.inter_node_gbps > 0):
        raise HetrainError(f"--inter-node-gbps {args.inter_node_gbps} must be a positive, finite bandwidth, e.g. 100")
    from hetrain.hardware.cluster import MAX_DEVICES

    largest = max(sizes) * sum(count for _, count in mix)
    if largest > MAX_DEVICES:
        raise HetrainError(f"--sizes {max(sizes)} copies of the mix make {largest} devices, over the limit of "
                           f"{MAX_DEVICES}; use smaller sizes")
    if args.out.endswith(("/", os.sep)) or os.path.isdir(args.out):   # a directory: its files get a name
        prefix = os.path.join(args.out, "simulate")
    else:
        prefix = args.out[:-4] if args.out.lower().endswith((".png", ".csv")) else args.out
    check_writable_file(f"{prefix}.csv", "--out")
    check_writable_file(f"{prefix}.png", "--out")
    rows, skipped = [], []   # skipped: (copies, devices, the planner's NoPlanFits) for the sizes where no plan fits
    for size in sizes:
        cluster = sweep_cluster(mix, size, args.per_node, args.inter_node_gbps)
        try:
            result = plan_job(cluster, profile, args.batch_per_device * cluster.size)
        except NoPlanFits as e:   # this size is left out and the sweep goes on
            skipped.append((size, cluster.size, e))
            rows.append({"devices": cluster.size, "strategy": NO_FIT, "compression": "", "samples_per_s": "",
                         "ideal_samples_per_s": "", "scaling_efficiency": "", "chosen": False})
            continue
        for c in result.candidates:
            if c.feasible:
                rows.append({"devices": cluster.size, "strategy": c.strategy, "compression": c.compression,
                             "samples_per_s": round(c.samples_per_s, 3), "ideal_samples_per_s": round(result.ideal_samples_per_s, 3),
                             "scaling_efficiency": round(c.samples_per_s / result.ideal_samples_per_s, 4),
                             "chosen": c.strategy == result.plan.strategy})
    points = [r for r in rows if r["strategy"] != NO_FIT]
    _, largest, why = max(skipped, key=lambda s: s[1]) if skipped else (None, 0, None)
    if not points:
        if skipped:
            raise HetrainError(f"no size in --sizes {args.sizes} fits {args.model} on copies of {args.mix}; at the "
                               f"largest, {_devices(largest)}: {why}")
        raise HetrainError(f"no feasible plan for {args.model} at any size; try a larger mix or another model")
    with open(f"{prefix}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    title = f"{args.model} on copies of {args.mix}"
    if skipped:
        gpus = ", ".join(str(d) for _, d, _ in skipped)
        title += f"; {gpus} GPU{'' if gpus == '1' else 's'} left out: no plan fits"
    _plot(points, f"{prefix}.png", title)
    if skipped:
        copies = ", ".join(str(c) for c, _, _ in skipped)
        print(f"hetrain simulate: sizes {copies} do not fit {args.model} on copies of {args.mix} "
              f"(at {_devices(largest)}, {why.shortfall or why}); left out of the plot, "
              f"'{NO_FIT}' rows in the CSV", file=sys.stderr)
    print(f"wrote {prefix}.csv and {prefix}.png ({len(points)} points)", file=sys.stdout)
    return 0


def _devices(n: int) -> str:
    return f"{n} device" + ("" if n == 1 else "s")


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = sweep_figure(rows, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep_figure(rows: list[dict], title: str):
    """The sweep's two panels: predicted samples/s with the ideal, and the fraction of ideal; the
    strategy `hetrain plan` chooses is ringed in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 5.5))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        pts = [r for r in rows if r["strategy"] == strategy]
        xs = [r["devices"] for r in pts]
        ax1.plot(xs, [r["samples_per_s"] for r in pts], marker="o", label=strategy)
        ax2.plot(xs, [r["scaling_efficiency"] for r in pts], marker="o", label=strategy)
    ideal = sorted({(r["devices"], r["ideal_samples_per_s"]) for r in rows})
    # a marker too: with one size plotted, a dashed line alone draws nothing
    ax1.plot([x for x, _ in ideal], [y for _, y in ideal], "k--", marker="x", markersize=8,
             label="ideal (sum of devices)")
    for ax, label in ((ax1, "predicted samples/s"), (ax2, "fraction of ideal")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    for ax, key in ((ax1, "samples_per_s"), (ax2, "scaling_efficiency")):
        chosen = [r for r in rows if r["chosen"]]
        names = ", ".join(dict.fromkeys(r["strategy"] for r in chosen))
        ax.scatter([r["devices"] for r in chosen], [r[key] for r in chosen], s=160, facecolors="none",
                   edgecolors="black", linewidths=1.6, zorder=5, label=f"chosen by hetrain plan ({names})")
        # below the panel: inside it, a legend can sit on the ringed point ("best" weighs points' centres,
        # not the ring around one, and a lone size puts its points on the panel's edges)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.suptitle(title + " (predicted by hetrain's cost model)")
    fig.tight_layout()
    return fig
