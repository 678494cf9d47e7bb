"""`nvidia-smi topo -m` parsing on recorded outputs, and NVLink islands from a fake NVML."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetrain.errors import HetrainError
from hetrain.hardware.topology import islands_from_topo, nvlink_islands_from_nvml, parse_topo

FIXTURES = Path(__file__).parent / "fixtures"


def _text(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_dgx_a100_full_mesh_with_nics() -> None:
    topo = parse_topo(_text("topo_dgx_a100.txt"))
    assert topo.gpus == tuple(range(8))  # the 10 mlx5 NIC rows and columns are not GPUs
    assert all(len(row) == 8 for row in topo.links)
    for a in range(8):
        for b in range(8):
            assert topo.link(a, b) == ("X" if a == b else "NV12")
            assert topo.nvlinks(a, b) == (0 if a == b else 12)
    assert topo.islands() == [list(range(8))]
    assert topo.cpu_affinity[0] == "48-63,176-191" and topo.numa_affinity[0] == "3"
    assert topo.numa_affinity == ("3", "3", "1", "1", "7", "7", "5", "5")


def test_four_v100_pcie_have_no_islands() -> None:
    topo = parse_topo(_text("topo_4x_v100_pcie.txt"))
    assert topo.gpus == (0, 1, 2, 3)
    assert topo.link(0, 1) == "PIX" and topo.link(2, 3) == "PHB" and topo.link(1, 2) == "SYS"
    assert topo.link(3, 0) == "SYS" and topo.nvlinks(0, 1) == 0
    assert topo.islands() == [[0], [1], [2], [3]]
    assert topo.cpu_affinity == ("0-11,24-35", "0-11,24-35", "12-23,36-47", "12-23,36-47")
    assert topo.numa_affinity == (None, None, None, None)  # older drivers print no NUMA column


def test_two_nvlink_pairs_over_sys() -> None:
    text = _text("topo_two_nvlink_pairs.txt")
    topo = parse_topo(text)
    assert topo.gpus == (0, 1, 2, 3)  # NIC0/NIC1 and the NIC legend are ignored
    assert topo.link(0, 1) == "NV4" and topo.link(1, 2) == "SYS" and topo.link(2, 3) == "NV4"
    assert islands_from_topo(text) == [[0, 1], [2, 3]]
    assert topo.numa_affinity == ("0", "0", "1", "1")  # the GPU NUMA ID column does not shift it


def test_islands_are_connected_components_not_cliques() -> None:
    # DGX-1: GPU0 and GPU5 meet only over SYS, yet NVLink paths join all eight.
    topo = parse_topo(_text("topo_dgx1_v100.txt"))
    assert topo.link(0, 5) == "SYS" and topo.link(0, 3) == "NV2" and topo.link(0, 1) == "NV1"
    assert topo.islands() == [list(range(8))]


def test_spaces_instead_of_tabs_and_terminal_colours() -> None:
    text = _text("topo_two_nvlink_pairs.txt")
    spaced = text.expandtabs(8)
    assert "\t" not in spaced
    assert parse_topo(spaced) == parse_topo(text)
    lines = text.splitlines()
    lines[0] = "\x1b[4m" + lines[0] + "\x1b[0m"  # nvidia-smi underlines the header on a terminal
    assert parse_topo("\n".join(lines)) == parse_topo(text)


def test_single_gpu() -> None:
    text = "\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-15\t0\n\nLegend:\n\n  X    = Self\n"
    topo = parse_topo(text)
    assert topo.gpus == (0,) and topo.islands() == [[0]] and topo.cpu_affinity == ("0-15",)


def test_partial_island_mix() -> None:
    text = (
        "\tGPU0\tGPU1\tGPU2\n"
        "GPU0\t X \tNV2\tPHB\n"
        "GPU1\tNV2\t X \tPHB\n"
        "GPU2\tPHB\tPHB\t X \n"
    )
    assert islands_from_topo(text) == [[0, 1], [2]]


@pytest.mark.parametrize(
    "text, what",
    [
        ("No devices were found\n", "no GPU matrix"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV2\n", "no row for GPU1"),
        ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV2\t X \n", "row GPU0 has 1 cells"),
        ("\tGPU0\tGPU1\nGPU0\t X \tQPI\nGPU1\tQPI\t X \n", "unknown link kind 'QPI'"),
    ],
)
def test_not_a_topology(text: str, what: str) -> None:
    with pytest.raises(HetrainError, match=what):
        parse_topo(text)


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The pynvml calls hetrain makes, answering NVLink P2P status from a set of linked pairs."""

    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVMLError = FakeNVMLError

    def __init__(self, count: int, linked: set[tuple[int, int]], broken: set[tuple[int, int]] = frozenset()):
        self.count, self.linked, self.broken = count, linked, broken
        self.asked: list[int] = []

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"handle{i}"

    def nvmlDeviceGetP2PStatus(self, h1: str, h2: str, index: int) -> int:
        self.asked.append(index)
        a, b = int(h1[6:]), int(h2[6:])
        pair = (min(a, b), max(a, b))
        if pair in self.broken:
            raise FakeNVMLError("Not Supported")
        return 0 if pair in self.linked else 4  # 4: NVML_P2P_STATUS_NOT_SUPPORTED


def test_nvml_full_mesh() -> None:
    nvml = FakeNVML(8, {(a, b) for a in range(8) for b in range(a + 1, 8)})
    assert nvlink_islands_from_nvml(nvml) == [list(range(8))]
    assert set(nvml.asked) == {2}


def test_nvml_pairs_and_failures() -> None:
    nvml = FakeNVML(4, {(0, 1), (2, 3)}, broken={(1, 2)})
    assert nvlink_islands_from_nvml(nvml) == [[0, 1], [2, 3]]
    assert nvlink_islands_from_nvml(FakeNVML(3, set())) == [[0], [1], [2]]
