"""Local discovery with faked torch.cuda and pynvml, and on this GPU-less machine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from hetrain.hardware.catalog import CPU_SPEC
from hetrain.hardware.discovery import discover, local_islands, local_peer_access
from hetrain.hardware.topology import suggested_intra_link


class FakeCuda:
    """torch.cuda's discovery calls over a list of (name, total_memory, (major, minor))."""

    def __init__(self, gpus: list[tuple[str, int, tuple[int, int]]]):
        self.gpus = gpus

    def is_available(self) -> bool:
        return bool(self.gpus)

    def device_count(self) -> int:
        return len(self.gpus)

    def get_device_properties(self, i: int) -> SimpleNamespace:
        name, memory, (major, minor) = self.gpus[i]
        return SimpleNamespace(name=name, total_memory=memory, major=major, minor=minor)


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    NVMLError = FakeNVMLError

    NVML_P2P_CAPS_INDEX_READ, NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK = 0, 2, 0

    def __init__(self, gpus: list[tuple[bytes | str, int, tuple[int, int]]], fail_init: bool = False,
                 peer_read: set[tuple[int, int]] = frozenset()):
        self.gpus, self.fail_init, self.peer_read = gpus, fail_init, peer_read
        self.inits = self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise FakeNVMLError("Driver Not Loaded")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes | str:
        return self.gpus[h][0]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=self.gpus[h][1], free=0, used=0)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return self.gpus[h][2]

    def nvmlDeviceGetP2PStatus(self, h1: int, h2: int, index: int) -> int:
        """OK (0) for read access between the pairs in `peer_read`; 4 (not supported) otherwise."""
        ok = index == self.NVML_P2P_CAPS_INDEX_READ and (min(h1, h2), max(h1, h2)) in self.peer_read
        return 0 if ok else 4


A100 = ("NVIDIA A100-SXM4-80GB", 85_899_345_920, (8, 0))
V100 = ("Tesla V100-SXM2-32GB", 34_089_730_048, (7, 0))


def test_two_different_gpus_from_torch() -> None:
    nvml = FakeNVML([])
    devices = discover(cuda=FakeCuda([A100, V100]), nvml=nvml)
    assert [(d.index, d.kind, d.source) for d in devices] == [(0, "cuda", "torch.cuda"), (1, "cuda", "torch.cuda")]
    assert [d.catalog_name for d in devices] == ["a100-sxm4-80gb", "v100-sxm2-32gb"]
    assert [d.compute_capability for d in devices] == [(8, 0), (7, 0)]
    assert devices[0].memory_bytes == 85_899_345_920 and devices[1].name == "Tesla V100-SXM2-32GB"
    assert nvml.inits == 0  # torch saw the GPUs; NVML was not needed


def test_unknown_gpu_has_no_spec() -> None:
    (device,) = discover(cuda=FakeCuda([("NVIDIA A10G", 23_836_033_024, (8, 6))]), use_nvml=False)
    assert device.kind == "cuda" and device.spec is None and device.catalog_name is None


def test_no_gpu_gives_one_cpu_device() -> None:
    (device,) = discover(cuda=FakeCuda([]), nvml=FakeNVML([]))
    assert (device.index, device.name, device.kind, device.source) == (0, "cpu", "cpu", "cpu")
    assert device.spec is CPU_SPEC and device.memory_bytes == CPU_SPEC.memory_bytes
    assert device.compute_capability is None


def test_nvml_lists_gpus_torch_cannot_see() -> None:
    nvml = FakeNVML([(b"NVIDIA H100 80GB HBM3", 85_520_809_984, (9, 0)), ("NVIDIA L4", 24_152_899_584, (8, 9))])
    devices = discover(cuda=FakeCuda([]), nvml=nvml)
    assert [(d.source, d.catalog_name, d.compute_capability) for d in devices] == [
        ("nvml", "h100-sxm5-80gb", (9, 0)),
        ("nvml", "l4", (8, 9)),
    ]
    assert devices[0].name == "NVIDIA H100 80GB HBM3"
    assert nvml.inits == nvml.shutdowns == 1
    assert [d.kind for d in discover(cuda=FakeCuda([]), nvml=nvml, use_nvml=False)] == ["cpu"]


def test_nvml_without_driver_falls_back_to_cpu() -> None:
    devices = discover(cuda=FakeCuda([]), nvml=FakeNVML([A100], fail_init=True))
    assert [d.kind for d in devices] == ["cpu"]


def test_torch_raising_counts_as_no_gpu() -> None:
    class Broken(FakeCuda):
        def device_count(self) -> int:
            raise RuntimeError("CUDA driver initialization failed")

    assert [d.kind for d in discover(cuda=Broken([A100]), use_nvml=False)] == ["cpu"]


def test_this_machine() -> None:
    devices = discover()
    assert devices, "discover always returns at least one device"
    for d in devices:
        assert d.kind in ("cuda", "cpu") and d.memory_bytes > 0


def test_local_islands() -> None:
    devices = discover(cuda=FakeCuda([A100] * 4), use_nvml=False)
    text = (Path(__file__).parent / "fixtures" / "topo_two_nvlink_pairs.txt").read_text()
    assert local_islands(devices, topo_text=text) == [[0, 1], [2, 3]]
    assert local_islands(devices[:3], topo_text=text) == [[0, 1], [2]]
    assert local_islands(devices, topo_text="", nvml=FakeNVML([A100] * 4)) == [[0], [1], [2], [3]]
    assert local_islands(discover(cuda=FakeCuda([]), use_nvml=False)) == [[0]]


RTX4090 = ("NVIDIA GeForce RTX 4090", 25_386_352_640, (8, 9))


def test_peer_access_from_nvml_tells_a_pcie_node_from_a_host_staged_one() -> None:
    """A GeForce box whose driver gives peer access is a pcie node, one whose driver does not is a
    host node: NVML's P2P read status says which, where the catalog can only assume."""
    devices = discover(cuda=FakeCuda([RTX4090] * 3), use_nvml=False)
    every_pair = {(0, 1), (0, 2), (1, 2)}
    nvml = FakeNVML([RTX4090] * 3, peer_read=every_pair)
    assert local_peer_access(devices, nvml=nvml) is True and nvml.inits == nvml.shutdowns == 1
    assert local_peer_access(devices, nvml=FakeNVML([RTX4090] * 3, peer_read={(0, 1), (1, 2)})) is False
    islands = [[0], [1], [2]]
    assert suggested_intra_link(islands, 3, True) == "pcie"
    assert suggested_intra_link(islands, 3, False) == "host"
    assert suggested_intra_link(islands, 3, None) is None
    assert suggested_intra_link([[0, 1, 2]], 3, False) == "nvlink"   # one NVLink island holds them all
    assert suggested_intra_link([[0]], 1, True) is None


def test_peer_access_is_unknown_without_nvml_or_a_second_gpu() -> None:
    two = discover(cuda=FakeCuda([RTX4090] * 2), use_nvml=False)
    assert local_peer_access(two, nvml=FakeNVML([RTX4090] * 2, fail_init=True)) is None
    assert local_peer_access(two[:1], nvml=FakeNVML([RTX4090], peer_read={(0, 1)})) is None
    assert local_peer_access(discover(cuda=FakeCuda([]), use_nvml=False)) is None
