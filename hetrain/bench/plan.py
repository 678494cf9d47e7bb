"""`hetrain bench plan`: how long planning takes on large clusters, and how it grows with the
number of devices and of device kinds (the split searches over kinds, not ranks)."""

from __future__ import annotations

import argparse
import time

from hetrain.bench.args import whole


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-1.5b", help="reference model to plan")
    parser.add_argument("--repeat", type=whole(1), default=3, help="timed runs per point (the best counts)")


def _best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def kinds_nodes(kinds: list[str], devices: int, per_node: int = 8) -> list[dict]:
    """Nodes of `per_node` devices of one kind each, `devices` in all, the kinds as even as whole nodes
    allow (512 devices of 6 kinds: 64 nodes, 11 of the first 4 kinds and 10 of the last 2)."""
    nodes_total, left = divmod(devices, per_node)
    if left:
        raise ValueError(f"{devices} devices do not fill nodes of {per_node}")
    base, extra = divmod(nodes_total, len(kinds))
    return [{"name": f"{m}-{i}", "devices": [{"model": m, "count": per_node}]}
            for j, m in enumerate(kinds) for i in range(base + (j < extra))]


def run(args: argparse.Namespace) -> dict:
    from hetrain.hardware.cluster import Cluster, get_preset
    from hetrain.planning.cost_model import default_calibration
    from hetrain.planning.planner import plan_job
    from hetrain.workload import get_profile

    t0 = time.perf_counter()
    default_calibration()
    calibration_s = time.perf_counter() - t0
    profile = get_profile(args.model)
    mix = get_preset("mix1024")
    result = {}
    t_mix = _best_time(lambda: plan_job(mix, profile, 4 * mix.size), args.repeat)
    chosen = plan_job(mix, profile, 4 * mix.size)
    result["model"] = args.model
    result["mix1024_plan_seconds"] = round(t_mix, 4)
    result["mix1024_strategy"] = chosen.plan.strategy
    result["mix1024_predicted_samples_per_s"] = round(chosen.plan.predicted_samples_per_s, 1)
    result["calibration_fit_seconds"] = round(calibration_s, 4)
    kinds = ["h100-sxm5-80gb", "a100-sxm4-80gb", "v100-sxm2-32gb", "l4"]
    by_devices = {}
    for nodes_per_kind in (1, 4, 16, 64):
        nodes = [{"name": f"{k}-{i}", "devices": [{"model": k, "count": 8}]} for k in kinds for i in range(nodes_per_kind)]
        c = Cluster.model_validate({"name": "b", "nodes": nodes, "inter_node_gbps": 200.0})
        by_devices[c.size] = round(_best_time(lambda c=c: plan_job(c, profile, 4 * c.size), args.repeat), 4)
    result["seconds_by_devices_4_kinds"] = by_devices
    catalog = ["h100-sxm5-80gb", "a100-sxm4-80gb", "h200-sxm-141gb", "a100-sxm4-40gb", "h100-pcie-80gb", "a100-pcie-80gb"]
    by_kinds = {}
    for k in (1, 2, 4, 6):
        c = Cluster.model_validate({"name": "b", "nodes": kinds_nodes(catalog[:k], 512), "inter_node_gbps": 200.0})
        by_kinds[k] = round(_best_time(lambda c=c: plan_job(c, profile, 4 * c.size), args.repeat), 4)
    result["seconds_by_kinds_512_devices"] = by_kinds
    result["target_seconds"] = 2.0
    result["meets_target"] = t_mix < 2.0
    result["emulated"] = False   # the planner's own time on this machine; the clusters are catalog GPUs it plans for
    return result
