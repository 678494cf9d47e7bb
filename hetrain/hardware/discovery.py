"""The devices of this machine: torch.cuda first, NVML where torch sees no GPU, else the CPU.

torch.cuda and pynvml are parameters so tests (and machines without GPUs) can pass fakes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hetrain.hardware.catalog import CPU_SPEC, GpuSpec, match_device_name


@dataclass
class LocalDevice:
    """One device this process can use, matched to the catalog where its name is known."""

    index: int
    name: str
    """the name the driver reports, e.g. "NVIDIA A100-SXM4-80GB"; "cpu" for the host"""
    kind: str
    """"cuda" or "cpu\""""
    memory_bytes: int
    compute_capability: tuple[int, int] | None
    spec: GpuSpec | None
    """the catalog entry, or None where no entry fits the name"""
    source: str
    """where it was found: "torch.cuda", "nvml" or "cpu\""""

    @property
    def catalog_name(self) -> str | None:
        """The matched catalog name, or None."""
        return self.spec.name if self.spec else None


def _import_torch_cuda() -> Any:
    import torch

    return torch.cuda


def _import_pynvml() -> Any | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    return pynvml


def _from_torch(cuda: Any) -> list[LocalDevice]:
    try:
        if not cuda.is_available():
            return []
        count = int(cuda.device_count())
    except (RuntimeError, AssertionError):  # a CUDA build without a usable driver
        return []
    devices = []
    for i in range(count):
        props = cuda.get_device_properties(i)
        memory = int(props.total_memory)
        devices.append(
            LocalDevice(
                index=i,
                name=str(props.name),
                kind="cuda",
                memory_bytes=memory,
                compute_capability=(int(props.major), int(props.minor)),
                spec=match_device_name(str(props.name), memory),
                source="torch.cuda",
            )
        )
    return devices


@contextmanager
def _nvml_open(nvml: Any | None) -> Iterator[Any | None]:
    """The pynvml-like module (pynvml itself when None), initialised and shut down around the block;
    None inside when there is no pynvml or no driver."""
    module = nvml if nvml is not None else _import_pynvml()
    if module is None:
        yield None
        return
    try:
        module.nvmlInit()
    except getattr(module, "NVMLError", Exception):
        yield None  # library present, no driver
        return
    try:
        yield module
    finally:
        module.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _from_nvml(nvml: Any) -> list[LocalDevice]:
    nvml_error = getattr(nvml, "NVMLError", Exception)
    with _nvml_open(nvml) as module:
        if module is None:
            return []
        devices = []
        for i in range(int(module.nvmlDeviceGetCount())):
            handle = module.nvmlDeviceGetHandleByIndex(i)
            name = _text(module.nvmlDeviceGetName(handle))
            memory = int(module.nvmlDeviceGetMemoryInfo(handle).total)
            try:
                cc = tuple(int(v) for v in module.nvmlDeviceGetCudaComputeCapability(handle))
            except (nvml_error, AttributeError):
                cc = None
            devices.append(
                LocalDevice(i, name, "cuda", memory, cc, match_device_name(name, memory), "nvml")  # type: ignore[arg-type]
            )
        return devices


def cpu_device() -> LocalDevice:
    """The host CPU as a device (memory: host RAM)."""
    return LocalDevice(0, "cpu", "cpu", CPU_SPEC.memory_bytes, None, CPU_SPEC, "cpu")


def discover(use_nvml: bool = True, cuda: Any | None = None, nvml: Any | None = None) -> list[LocalDevice]:
    """The devices of this machine: CUDA devices via torch.cuda, matched to the catalog.

    Where torch sees no GPU (a CPU build of torch on a GPU machine), NVML lists the GPUs if
    pynvml is importable and `use_nvml`. With no GPU at all, one CPU device.
    `cuda` (torch.cuda-like) and `nvml` (pynvml-like) replace the real modules when given.
    """
    devices = _from_torch(cuda if cuda is not None else _import_torch_cuda())
    if not devices and use_nvml:
        module = nvml if nvml is not None else _import_pynvml()
        if module is not None:
            devices = _from_nvml(module)
    return devices or [cpu_device()]


def local_islands(devices: list[LocalDevice], topo_text: str | None = None, nvml: Any | None = None) -> list[list[int]]:
    """NVLink islands of the local GPUs: from `nvidia-smi topo -m` text, else NVML, else one per GPU.

    Indices are the driver's (nvidia-smi's); with CUDA_VISIBLE_DEVICES set they may differ from torch's.
    """
    from hetrain.hardware import topology

    indices = [d.index for d in devices if d.kind == "cuda"]
    if not indices:
        return [[d.index] for d in devices]
    text = topo_text if topo_text is not None else topology.read_local_topo()
    if text:
        islands = topology.parse_topo(text).islands()
    else:
        with _nvml_open(nvml) as module:
            if module is None:
                return [[i] for i in indices]
            islands = topology.nvlink_islands_from_nvml(module)
    wanted = set(indices)
    return [kept for island in islands if (kept := [i for i in island if i in wanted])]


def local_peer_access(devices: list[LocalDevice], nvml: Any | None = None) -> bool | None:
    """Whether every pair of the local GPUs has peer-to-peer read access (NVML); None with fewer
    than two GPUs, without pynvml or a driver, or when NVML cannot say."""
    from hetrain.hardware import topology

    indices = [d.index for d in devices if d.kind == "cuda"]
    if len(indices) < 2:
        return None
    with _nvml_open(nvml) as module:
        return None if module is None else topology.peer_read_from_nvml(module, indices)
