"""`hetrain devices`: this machine's devices, the GPU catalog, or a cluster's devices and links."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hetrain.cli.console import print_rows, stdout_console
from hetrain.errors import HetrainError
from hetrain.hardware.catalog import ALIASES, GpuSpec, load_catalog
from hetrain.hardware.cluster import PRESETS, Cluster, cluster_from_devices, get_preset, load_cluster
from hetrain.userfiles import MAX_TEXT_BYTES, read_text


def build_parser(parser: argparse.ArgumentParser) -> None:
    """Add the verb's arguments."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--catalog", action="store_true", help="the GPU catalog: published peak figures")
    what.add_argument("--cluster", metavar="FILE", help="a cluster YAML file (docs/cluster-file.md)")
    what.add_argument("--preset", metavar="NAME", help=f"a preset cluster: {', '.join(PRESETS)}")
    what.add_argument("--devices", metavar="MODEL:COUNT,...", help="one node of these devices, e.g. a100:4,v100:4")
    what.add_argument("--topo", metavar="FILE", help="NVLink islands of `nvidia-smi topo -m` output ('-': stdin)")


def run(args: argparse.Namespace) -> int:
    """Print what was asked for; HetrainError reaches the CLI as one line."""
    if args.catalog:
        doc = catalog_doc()
    elif args.cluster or args.preset or args.devices:
        doc = cluster_doc(_cluster(args))
    elif args.topo:
        doc = topo_doc(_read_stdin() if args.topo == "-" else read_text(args.topo, "topology file"))
    else:
        doc = local_doc()
    if args.json:
        print(json.dumps(doc))
    else:
        _render(doc)
    return 0


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.cluster:
        return load_cluster(args.cluster)
    if args.preset:
        return get_preset(args.preset)
    return cluster_from_devices(args.devices)


def _read_stdin() -> str:
    data = sys.stdin.buffer.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES or b"\x00" in data:
        raise HetrainError("the topology text on stdin is binary or too large; fix: pipe `nvidia-smi topo -m` into it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise HetrainError("the topology text on stdin is not UTF-8; fix: pipe `nvidia-smi topo -m` into it") from None


# ---- documents (what --json prints, and what the tables show) -------------------------------------


def spec_doc(spec: GpuSpec) -> dict[str, Any]:
    """A catalog entry as plain JSON-able values (SI units)."""
    return {
        "name": spec.name,
        "aliases": [alias for alias, target in ALIASES.items() if target == spec.name],
        "arch": spec.arch,
        "compute_capability": list(spec.compute_capability),
        "memory_bytes": spec.memory_bytes,
        "mem_bw_bytes_per_s": spec.mem_bw_bytes_per_s,
        "peak_flops": dict(spec.peak_flops),
        "bf16": spec.bf16,
        "nvlink_gen": spec.nvlink_gen,
        "nvlink_bytes_per_s": spec.nvlink_bytes_per_s,
        "pcie_gen": spec.pcie_gen,
        "pcie_bytes_per_s": spec.pcie_bytes_per_s,
        "pcie_p2p": spec.pcie_p2p,
        "tdp_w": spec.tdp_w,
        "estimate": spec.arch == "cpu",
    }


def catalog_doc() -> dict[str, Any]:
    """The whole catalog."""
    return {"catalog": [spec_doc(s) for s in load_catalog().values()]}


def local_doc() -> dict[str, Any]:
    """This machine's devices and, where there are GPUs, their NVLink islands."""
    from hetrain.hardware.discovery import discover, local_islands, local_peer_access
    from hetrain.hardware.topology import suggested_intra_link

    devices = discover()
    islands = local_islands(devices)
    peer = local_peer_access(devices)
    gpus = sum(1 for d in devices if d.kind == "cuda")
    return {
        "local": [
            {
                "index": d.index,
                "name": d.name,
                "kind": d.kind,
                "memory_bytes": d.memory_bytes,
                "compute_capability": list(d.compute_capability) if d.compute_capability else None,
                "catalog": d.catalog_name,
                "source": d.source,
            }
            for d in devices
        ],
        "islands": islands,
        "peer_access": peer,
        "intra_link": suggested_intra_link(islands, gpus, peer),
    }


def cluster_doc(cluster: Cluster) -> dict[str, Any]:
    """A cluster's nodes, links, islands and rank-ordered devices."""
    nodes, first = [], 0
    for node in cluster.nodes:
        nodes.append(
            {
                "name": node.name,
                "devices": [g.model_dump() for g in node.devices],
                "ranks": [first, first + node.size - 1],
                "link": node.link,
                "link_bytes_per_s": node.link_bytes_per_s,
            }
        )
        first += node.size
    return {
        "cluster": cluster.name,
        "size": cluster.size,
        "kinds": cluster.kinds(),
        "inter_node_gbps": cluster.inter_node_gbps,
        "inter_node_bytes_per_s": cluster.inter_node_bytes_per_s,
        "nodes": nodes,
        "islands": cluster.islands(),
        "devices": [
            {
                "rank": d.rank,
                "node": d.node,
                "local_rank": d.local_rank,
                "model": d.spec.name,
                "island": d.island,
                "intra_bytes_per_s": d.intra_bytes_per_s,
            }
            for d in cluster.devices()
        ],
    }


def topo_doc(text: str) -> dict[str, Any]:
    """The GPU link matrix of `nvidia-smi topo -m` text and its NVLink islands."""
    from hetrain.hardware.topology import parse_topo

    topo = parse_topo(text)
    return {
        "topo": {
            "gpus": list(topo.gpus),
            "links": [list(row) for row in topo.links],
            "cpu_affinity": list(topo.cpu_affinity),
            "numa_affinity": list(topo.numa_affinity),
        },
        "islands": topo.islands(),
    }


# ---- tables ------------------------------------------------------------------------------------


def _console() -> Any:
    return stdout_console(highlight=False)


def _num(value: float | None, scale: float, digits: int = 1) -> str:
    if not value:
        return "-"
    x = value / scale
    return f"{x:,.{digits}f}" if x >= 1 else f"{x:.2g}"


def _gb(value: float) -> str:
    return f"{value / 1e9:g}"


def _ranks(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _render(doc: dict[str, Any]) -> None:
    from rich.table import Table

    console = _console()
    if "catalog" in doc:
        headings = ["name", "aliases", "arch", "cc", "memory GB", "mem GB/s", "fp32", "tf32", "fp16", "bf16",
                    "NVLink GB/s", "PCIe GB/s", "TDP W"]
        rows = []
        for s in doc["catalog"]:
            flops = s["peak_flops"]
            rows.append([
                s["name"] + (" *" if s["estimate"] else ""), ", ".join(s["aliases"]), s["arch"],
                "-" if s["arch"] == "cpu" else ".".join(map(str, s["compute_capability"])),
                _num(s["memory_bytes"], 1e9, 0), _num(s["mem_bw_bytes_per_s"], 1e9, 0),
                *(_num(flops[p], 1e12) for p in ("fp32", "tf32", "fp16", "bf16")),
                _num(s["nvlink_bytes_per_s"], 1e9, 0),
                _num(s["pcie_bytes_per_s"], 1e9, 2) + ("" if s["pcie_p2p"] else " h"),
                _num(s["tdp_w"], 1, 0),
            ])
        print_rows(console, headings, rows, title="GPU catalog (vendor dense peaks; TFLOP/s, GB, GB/s one direction)",
                   right=tuple(headings[3:]))
        console.print("* cpu: this host's RAM; flops and bandwidth are estimates, not measurements")
        console.print("h: no peer-to-peer access over PCIe; a node of these talks through host memory "
                      "(intra_link: host, docs/cluster-file.md)")
    elif "local" in doc:
        rows = []
        for d in doc["local"]:
            cc = ".".join(map(str, d["compute_capability"])) if d["compute_capability"] else "-"
            catalog = d["catalog"] or "no catalog entry: name the model in a cluster file"
            rows.append([str(d["index"]), d["name"], d["kind"], _num(d["memory_bytes"], 1e9), cc, catalog, d["source"]])
        print_rows(console, ["index", "name", "kind", "memory GB", "cc", "catalog", "source"], rows,
                   title="devices on this machine")
        if any(d["kind"] == "cuda" for d in doc["local"]):
            console.print("NVLink islands: " + "  ".join(f"[{_ranks(i)}]" for i in doc["islands"]))
        if sum(d["kind"] == "cuda" for d in doc["local"]) > 1:
            peer = {True: "yes", False: "no", None: "unknown (no NVML answer)"}[doc["peer_access"]]
            console.print(f"peer-to-peer access between the GPUs (NVML): {peer}"
                          + (f"; a cluster file's node for this machine: intra_link: {doc['intra_link']}"
                             if doc["intra_link"] else ""))
    elif "topo" in doc:
        topo = doc["topo"]
        table = Table(title="GPU links (nvidia-smi topo -m)")
        table.add_column("")
        for g in topo["gpus"]:
            table.add_column(f"GPU{g}")
        for g, row in zip(topo["gpus"], topo["links"]):
            table.add_row(f"GPU{g}", *row)
        console.print(table)
        console.print("NVLink islands: " + "  ".join("[" + ",".join(map(str, i)) + "]" for i in doc["islands"]))
    else:
        _render_cluster(console, doc)


def _render_cluster(console: Any, doc: dict[str, Any]) -> None:
    from rich.table import Table

    kinds = ", ".join(f"{n}x {m}" for m, n in doc["kinds"].items())
    console.print(f"cluster {doc['cluster']}: {doc['size']} devices ({kinds}) on {len(doc['nodes'])} node{'s' if len(doc['nodes']) != 1 else ''}")
    table = Table()
    for col in ("nodes", "devices", "ranks", "link (per device, one direction)"):
        table.add_column(col)
    # Consecutive nodes of the same shape share one row, so a 128-node cluster stays readable.
    runs: list[list[dict[str, Any]]] = []
    for node in doc["nodes"]:
        shape = (node["devices"], node["link"], node["link_bytes_per_s"])
        if runs and (runs[-1][0]["devices"], runs[-1][0]["link"], runs[-1][0]["link_bytes_per_s"]) == shape:
            runs[-1].append(node)
        else:
            runs.append([node])
    for run_ in runs:
        head, tail = run_[0], run_[-1]
        names = head["name"] if len(run_) == 1 else f"{head['name']} .. {tail['name']} ({len(run_)} nodes)"
        devices = " + ".join(f"{g['count']}x {g['model']}" for g in head["devices"])
        ranks = f"{head['ranks'][0]}-{tail['ranks'][1]}"
        link = f"{head['link']} {_gb(head['link_bytes_per_s'])} GB/s"
        table.add_row(names, devices, ranks, link)
    console.print(table)
    islands = doc["islands"]
    shown = "  ".join(f"[{_ranks(i)}]" for i in islands[:8]) + ("  ..." if len(islands) > 8 else "")
    console.print(f"islands: {len(islands)} (one per node): {shown}")
    console.print(f"network: {doc['inter_node_gbps']:g} Gb/s per node ({_gb(doc['inter_node_bytes_per_s'])} GB/s)")
