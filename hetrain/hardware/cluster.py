"""The cluster file: which devices, on which nodes, joined by which links.

A cluster is nodes of device groups; ranks are numbered node by node, group by group.
Each node is one island (its devices share NVLink or PCIe); nodes talk over the network. Devices
without peer-to-peer access over PCIe (GeForce parts, see gpus.csv) exchange data through host
memory: their node's link is "host".
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hetrain.errors import HetrainError
from hetrain.hardware.catalog import GpuSpec, get_gpu
from hetrain.userfiles import read_text

MAX_DEVICES = 65_536
"""Most devices a cluster may hold: counts are checked against it before anything is expanded."""
MAX_CLUSTER_FILE_BYTES = 8 * 2**20
"""Largest cluster file read (8 MiB): 65,536 one-device nodes, one key a line, take 4.2 MiB."""
MAX_YAML_VALUES = 2_000_000
"""Most values a cluster file may hold once its YAML aliases (``*name``) are expanded: 65,536
written-out nodes hold under a million, and a few kilobytes of nested aliases can stand for
billions."""


Link = Literal["nvlink", "pcie", "host"]
"""How a node's devices reach each other: NVLink; PCIe peer to peer; PCIe staged through host memory."""
HOST_STAGED_SHARE = 0.5
"""Share of PCIe bandwidth a host-staged transfer gets: each byte crosses PCIe twice, into host memory
and out of it."""


def default_link(specs: list[GpuSpec]) -> Link:
    """The link between these devices when a cluster file does not say: NVLink if every one has it and
    they are one model (NVLink joins boards of one baseboard or bridge, never two generations), else
    PCIe peer to peer if every one allows it, else host-staged."""
    if all(s.has_nvlink for s in specs) and len({s.name for s in specs}) == 1:
        return "nvlink"
    return "pcie" if all(s.pcie_p2p for s in specs) else "host"


def link_bytes_per_s(specs: list[GpuSpec], link: Link) -> float:
    """Per-device bandwidth of `link` between these devices, one direction: the slowest device's rate.
    CPU devices, which have neither link, talk through host memory."""
    if link == "nvlink":
        return min(s.nvlink_bytes_per_s or 0.0 for s in specs)
    share = HOST_STAGED_SHARE if link == "host" else 1.0
    return min(s.pcie_bytes_per_s * share if s.pcie_bytes_per_s else s.mem_bw_bytes_per_s for s in specs)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeviceGroup(_Strict):
    """`count` devices of one catalog model."""

    model: str = Field(description="catalog name or alias (a100, v100-sxm2-32gb, ...); stored as the catalog name")
    count: int = Field(1, ge=1, le=MAX_DEVICES, strict=True,
                       description="how many devices of this model the node holds")

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        return get_gpu(value).name  # unknown names raise HetrainError naming the closest

    @property
    def spec(self) -> GpuSpec:
        """The catalog entry of this group's model."""
        return get_gpu(self.model)


class Node(_Strict):
    """One machine: its device groups and the link between its devices."""

    name: str = Field(min_length=1)
    devices: list[DeviceGroup] = Field(min_length=1)
    intra_link: Link | None = Field(
        None, description="None: nvlink if every device of the node has NVLink and is one model, else pcie "
                          "if every one allows PCIe peer-to-peer access, else host (staged through host memory)"
    )

    @model_validator(mode="after")
    def _nvlink_possible(self) -> Node:
        if self.intra_link == "nvlink":
            lacking = [g.model for g in self.devices if not g.spec.has_nvlink]
            if lacking:
                raise ValueError(
                    f"intra_link is nvlink but the catalog lists no NVLink for {lacking[0]}; "
                    "fix: write intra_link: pcie or remove the line"
                )
        return self

    @property
    def link(self) -> Link:
        """The link between this node's devices, with the default resolved (`default_link`)."""
        if self.intra_link is not None:
            return self.intra_link
        return default_link([g.spec for g in self.devices])

    @property
    def link_bytes_per_s(self) -> float:
        """Per-device bandwidth of the node's link, one direction: the slowest device's rate."""
        return link_bytes_per_s([g.spec for g in self.devices], self.link)

    @property
    def size(self) -> int:
        """How many devices the node holds."""
        return sum(g.count for g in self.devices)


@dataclass(frozen=True)
class ClusterDevice:
    """One rank's device in a cluster."""

    rank: int
    node: int
    local_rank: int
    spec: GpuSpec
    island: int
    """index into Cluster.islands()"""
    intra_bytes_per_s: float
    """bandwidth of its node's link (NVLink or PCIe), one direction"""
    host_staged: bool = False
    """whether its node's link is staged through host memory (no peer-to-peer access)"""


class Cluster(_Strict):
    """Nodes of devices and the network between them."""

    name: str = "cluster"
    nodes: list[Node] = Field(min_length=1, max_length=MAX_DEVICES)
    inter_node_gbps: float = Field(100.0, gt=0, strict=True, allow_inf_nan=False,
                                   description="network bandwidth per node, Gb/s")

    @model_validator(mode="after")
    def _unique_node_names(self) -> Cluster:
        if self.size > MAX_DEVICES:
            raise ValueError(
                f"the cluster has {self.size:,} devices; hetrain plans at most {MAX_DEVICES:,}; "
                "fix: describe fewer devices"
            )
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise ValueError(f"node name {node.name!r} appears twice; fix: give each node its own name")
            seen.add(node.name)
        return self

    def devices(self) -> list[ClusterDevice]:
        """Every device, flattened in rank order (node by node, group by group)."""
        out: list[ClusterDevice] = []
        for n, node in enumerate(self.nodes):
            bw, staged = node.link_bytes_per_s, node.link == "host"
            local = 0
            for group in node.devices:
                spec = group.spec
                for _ in range(group.count):
                    out.append(ClusterDevice(len(out), n, local, spec, n, bw, staged))
                    local += 1
        return out

    def islands(self) -> list[list[int]]:
        """Ranks sharing a fast link: one island per node (NVLink or PCIe, see Node.link)."""
        out: list[list[int]] = []
        start = 0
        for node in self.nodes:
            out.append(list(range(start, start + node.size)))
            start += node.size
        return out

    def kinds(self) -> dict[str, int]:
        """Catalog name -> device count, in order of first appearance."""
        counts: dict[str, int] = {}
        for node in self.nodes:
            for group in node.devices:
                counts[group.model] = counts.get(group.model, 0) + group.count
        return counts

    @property
    def size(self) -> int:
        """How many devices (ranks) the cluster holds."""
        return sum(node.size for node in self.nodes)

    @property
    def inter_node_bytes_per_s(self) -> float:
        """Network bandwidth per node in bytes/s."""
        return self.inter_node_gbps * 1e9 / 8


# ---- loading and writing -------------------------------------------------------------------

_KEYS = {
    "cluster": ("name", "nodes", "inter_node_gbps"),
    "node": ("name", "devices", "intra_link"),
    "group": ("model", "count"),
}


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "top level"


def _keys_at(loc: tuple[Any, ...]) -> tuple[str, ...]:
    depth = len([p for p in loc if isinstance(p, str)])
    return _KEYS["cluster"] if depth <= 1 else _KEYS["node"] if depth == 2 else _KEYS["group"]


def _repeated_name_line(root: yaml.Node | None) -> int | None:
    """The line of the second node whose `name` an earlier node already has."""
    nodes = next((v for k, v in root.value if k.value == "nodes"), None) if isinstance(root, yaml.MappingNode) else None
    seen: set[str] = set()
    for item in nodes.value if isinstance(nodes, yaml.SequenceNode) else []:
        name = next((v for k, v in item.value if k.value == "name"), None) if isinstance(item, yaml.MappingNode) else None
        if isinstance(name, yaml.ScalarNode):
            if name.value in seen:
                return name.start_mark.line + 1
            seen.add(name.value)
    return None


def _line_of(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based YAML line of the value at `loc`, walking the composed node tree."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == part), None)
            if match is None:
                break
            line = match[0].start_mark.line + 1
            node = match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


class _Shown:
    """A value as an error line shows it: its repr, cut to `limit` characters."""

    def __init__(self, value: Any, limit: int = 60) -> None:
        self.value, self.limit = value, limit

    def __repr__(self) -> str:
        text = repr(self.value) if not isinstance(self.value, (list, dict)) else _repr_prefix(self.value, self.limit)
        return text if len(text) <= self.limit else text[: self.limit - 3] + "..."


def _repr_prefix(value: list | dict, limit: int) -> str:
    """The start of a container's repr without building all of it (it may be huge)."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 3, 4, 4, limit, limit
    return r.repr(value)


def _explain(err: dict[str, Any]) -> str:
    kind, loc, got = err["type"], err["loc"], _Shown(err.get("input"))
    key = loc[-1] if loc else ""
    if kind == "extra_forbidden":
        return f"unknown key {key!r}; fix: remove it or use one of: {', '.join(_keys_at(loc))}"
    if kind == "missing":
        return f"missing key {key!r}; fix: add it"
    if kind == "value_error":
        return str(err.get("ctx", {}).get("error", err["msg"]))
    if kind == "too_short" and key == "nodes":
        return "the cluster has no devices; fix: list at least one node with at least one device"
    if kind == "too_short":
        return f"{key} is empty; fix: list at least one entry"
    if kind == "greater_than_equal":
        return f"{key} must be at least {err['ctx']['ge']}, got {got!r}; fix: use {err['ctx']['ge']} or more"
    if kind == "less_than_equal":
        return f"{key} must be at most {err['ctx']['le']:,}, got {got!r}; fix: use {err['ctx']['le']:,} or fewer"
    if kind == "too_long":
        return f"{key} lists {err['ctx']['actual_length']:,} entries, at most {err['ctx']['max_length']:,} allowed; fix: list fewer"
    if kind in ("int_type", "int_from_float"):
        return f"{key} must be a whole number, got {got!r}; fix: write a number such as 4"
    if kind in ("float_type", "finite_number"):
        if isinstance(got.value, str) and _is_number(got.value):   # YAML 1.1 reads 1e2 (no dot, no sign) as text
            return (f"{key} must be a finite number, got {got!r}, which YAML reads as text; fix: write it with a "
                    f"dot and a signed exponent (1.0e+2) or in full (100)")
        return f"{key} must be a finite number, got {got!r}; fix: write a number such as 100"
    if kind == "string_type" and isinstance(got.value, (bool, int, float)):   # model: 3090, name: on
        what = "true or false (as it reads on, off, yes and no)" if isinstance(got.value, bool) else "a number"
        return f"{key} must be text, got {got!r}: YAML reads it as {what}; fix: quote it (\"...\")"
    if kind == "model_type" and len(loc) >= 2 and loc[-2] in ("devices", "nodes"):   # `devices: [a100]`
        what, such, how = (("a device group", "{model: a100, count: 4}", "`- model: NAME` with `count: N` under it")
                           if loc[-2] == "devices" else ("a node", "{name: n1, devices: [...]}",
                                                         "`- name: NAME` with its `devices:` under it"))
        return f"{what} must be a mapping such as {such}, got {got!r}; fix: write it as {how} (docs/cluster-file.md)"
    if kind == "greater_than":
        return f"{key} must be more than {err['ctx']['gt']}, got {got!r}; fix: use a positive value"
    if kind == "literal_error":
        return f"{key} must be {err['msg'].split('Input should be ')[-1]}, got {got!r}; fix: use one of those"
    return f"{err['msg'].lower()}, got {got!r}; fix: correct the value"


def _is_number(text: str) -> bool:
    """A finite number as Python reads it (1e2), which YAML 1.1 left as text."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _validation_message(source: str, exc: ValidationError, root: yaml.Node | None) -> str:
    errors = exc.errors()
    err, told = errors[0], 1
    explained = _explain(err)
    if err["type"] == "missing":   # a key written wrong is both unknown and missing: name it by its spelling
        key, parent = err["loc"][-1], tuple(err["loc"][:-1])
        unknown = [e for e in errors if e["type"] == "extra_forbidden" and tuple(e["loc"][:-1]) == parent]
        # the one unknown key there, or the one spelt like it (of several, the others are not a rename)
        typo = next((e for e in unknown if len(unknown) == 1
                     or difflib.get_close_matches(str(e["loc"][-1]), [str(key)], n=1, cutoff=0.6)), None)
        if typo is not None:
            err, told = typo, 2
            explained = f"unknown key {typo['loc'][-1]!r}, and {key!r} is missing; fix: rename it to {key!r}"
    loc = tuple(err["loc"])
    line = _line_of(root, loc) or (_repeated_name_line(root) if "appears twice" in err["msg"] else None)
    place = f"{source}:{line}" if line else source
    more = f" (and {len(errors) - told} more)" if len(errors) > told else ""
    return f"{place}: {_where(loc)}: {explained}{more}"


def cluster_from_dict(data: Any, source: str = "cluster", root: yaml.Node | None = None) -> Cluster:
    """Validate a cluster mapping; errors name `source`, the line, the key, the problem and the fix."""
    if data is None:
        raise HetrainError(f"{source}: the file is empty; fix: list the cluster's nodes (see docs/cluster-file.md)")
    if not isinstance(data, dict):
        raise HetrainError(
            f"{source}: expected a mapping with a 'nodes' list, got {type(data).__name__}; "
            "fix: see docs/cluster-file.md for the format"
        )
    if "nodes" not in data and {"ranks", "global_batch_size", "plan"} & set(data):
        raise HetrainError(f"{source}: this is a plan (hetrain plan's output), not a cluster file; fix: pass it to "
                           "`hetrain launch --plan`; a cluster file lists the cluster's 'nodes' (docs/cluster-file.md)")
    try:
        return Cluster.model_validate(data)
    except ValidationError as e:
        raise HetrainError(_validation_message(source, e, root)) from None


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """YAML's safe loader, refusing a key given twice in one mapping (YAML would keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            # a merge key (`<<: *anchor`) is no key of its own: the keys it brings are overridden by those
            # written beside it, as YAML merges them (flatten_mapping, below), not given twice
            key = "<<" if key_node.tag == "tag:yaml.org,2002:merge" else self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise HetrainError(
                    f"{self.source}:{line}: key {key!r} appears twice in one mapping (first on line "
                    f"{seen[key]}); fix: keep one of them"
                )
            seen[key] = line
        self.flatten_mapping(node)
        return super().construct_mapping(node, deep=deep)


def _check_expanded_size(root: yaml.Node | None, source: str, limit: int = MAX_YAML_VALUES) -> None:
    """Refuse a document whose aliases expand to more than `limit` values, before building it."""
    stack, seen = [root] if root is not None else [], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > limit:
            raise HetrainError(
                f"{source}: its YAML aliases (*name) expand to more than {limit:,} values; hetrain reads "
                f"clusters of at most {MAX_DEVICES:,} devices; fix: write the nodes out, or give a group's "
                "size with 'count' instead of repeating it"
            )
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack += (key, value)
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster YAML file (at most MAX_CLUSTER_FILE_BYTES, MAX_DEVICES devices)."""
    path = Path(path)
    text = read_text(path, "cluster file", MAX_CLUSTER_FILE_BYTES)
    loader = _UniqueKeyLoader(text)
    loader.source = str(path)
    try:
        root = loader.get_single_node()
        _check_expanded_size(root, str(path))
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        place = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        line = text.splitlines()[mark.line] if mark and mark.line < len(text.splitlines()) else ""
        if "\t" in line[: len(line) - len(line.lstrip())]:
            raise HetrainError(f"{place}: malformed YAML: a tab in the indentation; fix: indent with spaces") from None
        raise HetrainError(f"{place}: malformed YAML: {problem}; fix: correct the YAML syntax there") from None
    finally:
        loader.dispose()
    return cluster_from_dict(data, str(path), root)


def dump_cluster(cluster: Cluster) -> str:
    """The cluster as YAML text that load_cluster reads back to an equal Cluster."""
    return yaml.safe_dump(cluster.model_dump(mode="json", exclude_none=True), sort_keys=False)


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write the cluster as a YAML file."""
    Path(path).write_text(dump_cluster(cluster), encoding="utf-8")


def cluster_from_devices(arg: str, name: str = "cluster", inter_node_gbps: float = 100.0) -> Cluster:
    """One node from "MODEL:COUNT,..." (e.g. "a100:4,v100-sxm2-32gb:4"); its link as `default_link` says."""
    groups = []
    for item in (p.strip() for p in arg.split(",")):
        if not item:
            continue
        model, _, count = item.partition(":")
        count = count.strip() or "1"
        if not (count.isascii() and count.isdigit()) or not count.strip("0"):
            raise HetrainError(
                f"devices {arg!r}: count {count!r} of {model.strip()!r} is not a positive integer; "
                "fix: write MODEL:COUNT,..., e.g. a100:4,v100:4"
            )
        if len(count.lstrip("0")) > len(str(MAX_DEVICES)) or int(count) > MAX_DEVICES:
            raise HetrainError(
                f"devices {arg!r}: count {count} of {model.strip()!r} is more than hetrain plans "
                f"({MAX_DEVICES:,} devices at most); fix: give a smaller count"
            )
        groups.append({"model": model.strip(), "count": int(count)})
    if not groups:
        raise HetrainError(f"devices {arg!r} names no device; fix: write MODEL:COUNT,..., e.g. a100:4,v100:4")
    try:
        return Cluster(name=name, nodes=[Node(name="node0", devices=groups)], inter_node_gbps=inter_node_gbps)
    except ValidationError as e:
        err = e.errors()[0]
        raise HetrainError(f"devices {arg!r}: {_explain(err)}") from None


# ---- presets --------------------------------------------------------------------------------

PRESETS: dict[str, str] = {
    "a100x8": "one node, 8x a100-sxm4-80gb on NVLink",
    "v100x8": "one node, 8x v100-sxm2-32gb on NVLink",
    "a100x4+v100x4": "two nodes: 4x a100-sxm4-80gb (NVLink) and 4x v100-sxm2-32gb (NVLink), 100 Gb/s between",
    "mix1024": "128 nodes, 1024 GPUs: 32x8 h100-sxm5-80gb, 32x8 a100-sxm4-80gb, 32x8 v100-sxm2-32gb "
    "(NVLink), 32x8 l4 (PCIe); 200 Gb/s per node",
}


def _nodes(prefix: str, count: int, model: str, per_node: int) -> list[dict[str, Any]]:
    return [{"name": f"{prefix}{i}", "devices": [{"model": model, "count": per_node}]} for i in range(count)]


def get_preset(name: str) -> Cluster:
    """A named example cluster (see PRESETS)."""
    key = name.strip().lower()
    if key == "a100x8":
        data = {"name": key, "nodes": _nodes("a100-", 1, "a100-sxm4-80gb", 8)}
    elif key == "v100x8":
        data = {"name": key, "nodes": _nodes("v100-", 1, "v100-sxm2-32gb", 8)}
    elif key == "a100x4+v100x4":
        nodes = _nodes("a100-", 1, "a100-sxm4-80gb", 4) + _nodes("v100-", 1, "v100-sxm2-32gb", 4)
        data = {"name": key, "nodes": nodes, "inter_node_gbps": 100.0}
    elif key == "mix1024":
        nodes = (
            _nodes("h100-", 32, "h100-sxm5-80gb", 8)
            + _nodes("a100-", 32, "a100-sxm4-80gb", 8)
            + _nodes("v100-", 32, "v100-sxm2-32gb", 8)
            + _nodes("l4-", 32, "l4", 8)
        )
        data = {"name": key, "nodes": nodes, "inter_node_gbps": 200.0}
    else:
        raise HetrainError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return Cluster.model_validate(data)
