"""What the machine is: the GPU catalog, this machine's devices, links between GPUs, the cluster file."""

from hetrain.hardware.catalog import CPU_SPEC, GpuSpec, get_gpu, load_catalog, match_device_name
from hetrain.hardware.cluster import (
    PRESETS,
    Cluster,
    ClusterDevice,
    DeviceGroup,
    Node,
    cluster_from_devices,
    dump_cluster,
    get_preset,
    load_cluster,
    save_cluster,
)
from hetrain.hardware.discovery import LocalDevice, discover
from hetrain.hardware.topology import TopoMatrix, islands_from_topo, nvlink_islands_from_nvml, parse_topo

__all__ = [
    "CPU_SPEC",
    "PRESETS",
    "Cluster",
    "ClusterDevice",
    "DeviceGroup",
    "GpuSpec",
    "LocalDevice",
    "Node",
    "TopoMatrix",
    "cluster_from_devices",
    "discover",
    "dump_cluster",
    "get_gpu",
    "get_preset",
    "islands_from_topo",
    "load_catalog",
    "load_cluster",
    "match_device_name",
    "nvlink_islands_from_nvml",
    "parse_topo",
    "save_cluster",
]
