"""Links between the GPUs of one machine: `nvidia-smi topo -m` text or NVML, to NVLink islands.

An island is a set of GPUs joined by NVLink (directly or through other NVLink GPUs or NVSwitches);
collectives inside an island are fast, between islands they cross PCIe, the CPU or the network.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from hetrain.errors import HetrainError

# Link kinds of `nvidia-smi topo -m`, nearest first (NV# is NVLink with # bonded links).
PCIE_KINDS = ("PIX", "PXB", "PHB", "NODE", "SYS")
LINK_NAMES = {
    "X": "self",
    "NV": "NVLink",
    "PIX": "at most one PCIe bridge",
    "PXB": "several PCIe bridges, no host bridge",
    "PHB": "through a PCIe host bridge (the CPU)",
    "NODE": "between PCIe host bridges within a NUMA node",
    "SYS": "across the interconnect between NUMA nodes",
}
_MULTIWORD_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU = re.compile(r"GPU(\d+)$")
_LINK = re.compile(r"X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC")


@dataclass(frozen=True)
class TopoMatrix:
    """The GPU-to-GPU part of `nvidia-smi topo -m`: NIC rows and columns and the legend dropped."""

    gpus: tuple[int, ...]
    """GPU indices, in the order of the rows"""
    links: tuple[tuple[str, ...], ...]
    """links[i][j]: the link kind between gpus[i] and gpus[j] ("X" on the diagonal)"""
    cpu_affinity: tuple[str | None, ...]
    numa_affinity: tuple[str | None, ...]

    def link(self, a: int, b: int) -> str:
        """The link kind between GPU indices a and b ("X", "NV12", "PIX", ..., "SYS")."""
        return self.links[self.gpus.index(a)][self.gpus.index(b)]

    def nvlinks(self, a: int, b: int) -> int:
        """How many bonded NVLinks join GPUs a and b (0: none)."""
        kind = self.link(a, b)
        return int(kind[2:]) if kind.startswith("NV") else 0

    def islands(self) -> list[list[int]]:
        """NVLink islands: connected components over NV# links, each sorted, ordered by first GPU."""
        edges = [
            (a, b) for i, a in enumerate(self.gpus) for b in self.gpus[i + 1:] if self.nvlinks(a, b) > 0
        ]
        return components(list(self.gpus), edges)


def components(nodes: list[Any], edges: list[tuple[Any, Any]]) -> list[list[Any]]:
    """Connected components (union-find); each component sorted, components ordered by first member."""
    parent = {n: n for n in nodes}

    def find(n: Any) -> Any:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for a, b in edges:
        parent.setdefault(a, a)
        parent.setdefault(b, b)
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra
    groups: dict[Any, list[Any]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def _header_columns(line: str) -> list[str]:
    pattern = "|".join(re.escape(c) for c in _MULTIWORD_COLUMNS) + r"|\S+"
    return re.findall(pattern, line)


def parse_topo(text: str) -> TopoMatrix:
    """Parse the matrix printed by `nvidia-smi topo -m` (tabs or spaces; NIC lines and legend ignored)."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header_at = next(
        (i for i, line in enumerate(lines) if line.split()[:1] and _GPU.match(line.split()[0]) and
         not _LINK.fullmatch((line.split() + ["", ""])[1])),
        None,
    )
    if header_at is None:
        raise HetrainError(
            "no GPU matrix found in the topology text; fix: pass the output of `nvidia-smi topo -m`"
        )
    columns = _header_columns(lines[header_at])
    devices = [c for c in columns if c not in _MULTIWORD_COLUMNS]
    gpu_cols = [k for k, c in enumerate(devices) if _GPU.match(c)]
    extra = columns[len(devices):]
    rows: dict[int, list[str]] = {}
    cpu: dict[int, str | None] = {}
    numa: dict[int, str | None] = {}
    for line in lines[header_at + 1:]:
        cells = line.split()
        if not cells or cells[0].startswith("Legend"):
            if rows:
                break
            continue
        m = _GPU.match(cells[0])
        if not m:
            continue  # a NIC row (mlx5_0, NIC0): not a GPU-to-GPU link
        values = cells[1:]
        if len(values) < len(devices):
            raise HetrainError(
                f"topology row {cells[0]} has {len(values)} cells, the header names {len(devices)} "
                "devices; fix: pass the unmodified output of `nvidia-smi topo -m`"
            )
        kinds = [values[k] for k in gpu_cols]
        bad = [k for k in kinds if not _LINK.fullmatch(k)]
        if bad:
            raise HetrainError(
                f"topology row {cells[0]} has unknown link kind {bad[0]!r}; known: X, NV#, "
                f"{', '.join(PCIE_KINDS)}; fix: pass the output of `nvidia-smi topo -m`"
            )
        index = int(m.group(1))
        rows[index] = [("SYS" if k == "SOC" else k) for k in kinds]  # SOC: older drivers' SYS
        tail = values[len(devices):]
        info = dict(zip(extra, tail))
        cpu[index] = info.get("CPU Affinity")
        numa[index] = info.get("NUMA Affinity")
    gpus = tuple(int(_GPU.match(devices[k]).group(1)) for k in gpu_cols)
    missing = [g for g in gpus if g not in rows]
    if missing:
        raise HetrainError(
            f"topology text has no row for GPU{missing[0]}; fix: pass the whole output of `nvidia-smi topo -m`"
        )
    return TopoMatrix(
        gpus=gpus,
        links=tuple(tuple(rows[g]) for g in gpus),
        cpu_affinity=tuple(cpu[g] for g in gpus),
        numa_affinity=tuple(numa[g] for g in gpus),
    )


def islands_from_topo(text: str) -> list[list[int]]:
    """NVLink islands of the GPUs in `nvidia-smi topo -m` text."""
    return parse_topo(text).islands()


def read_local_topo(timeout_s: float = 10.0) -> str | None:
    """This machine's `nvidia-smi topo -m` text, or None where nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _p2p_statuses(nvml: Any, indices: list[int], caps_index: int) -> dict[tuple[int, int], bool | None]:
    """Per pair (i, j), i < j, of the GPUs `indices`: whether NVML reports OK for P2P capability
    `caps_index`; None where its query fails."""
    status_ok = getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    nvml_error = getattr(nvml, "NVMLError", Exception)
    handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
    out: dict[tuple[int, int], bool | None] = {}
    for a, i in enumerate(indices):
        for j in indices[a + 1:]:
            try:
                out[(i, j)] = nvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], caps_index) == status_ok
            except nvml_error:
                out[(i, j)] = None
    return out


def nvlink_islands_from_nvml(nvml: Any) -> list[list[int]]:
    """NVLink islands from an initialised pynvml-like module: pairs whose NVLink P2P status is OK.

    NVML reports OK both for direct links and through NVSwitch, so a DGX is one island.
    A pair whose query fails counts as not linked.
    """
    gpus = list(range(int(nvml.nvmlDeviceGetCount())))
    statuses = _p2p_statuses(nvml, gpus, getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2))
    return components(gpus, [pair for pair, ok in statuses.items() if ok])


def peer_read_from_nvml(nvml: Any, indices: list[int]) -> bool | None:
    """Whether every pair of the GPUs `indices` can read the other's memory directly (NVML's P2P
    read status, which is what a PCIe node without NVLink needs for NCCL to skip host memory), from
    an initialised pynvml-like module; None where a query fails."""
    try:
        statuses = _p2p_statuses(nvml, indices, getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)).values()
    except (getattr(nvml, "NVMLError", Exception), AttributeError):   # no handle, or no P2P query
        return None
    return None if None in statuses else all(statuses)


def suggested_intra_link(islands: list[list[int]], gpus: int, peer_read: bool | None) -> str | None:
    """What a cluster file should say for a node of `gpus` GPUs with these NVLink islands and
    peer access: nvlink when one island holds them all, else pcie with peer access, host without,
    None for one GPU or when peer access is unknown."""
    if gpus < 2:
        return None
    if len(islands) == 1 and len(islands[0]) == gpus:
        return "nvlink"
    if peer_read is None:
        return None
    return "pcie" if peer_read else "host"
