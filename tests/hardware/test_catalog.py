"""The GPU catalog: figures from the csv, aliases, errors, device-name matching."""

from __future__ import annotations

import csv
import io
from importlib import resources

import pytest

from hetrain.errors import HetrainError
from hetrain.hardware.catalog import (
    ALIASES,
    CPU_SPEC,
    get_gpu,
    host_memory_bytes,
    load_catalog,
    match_device_name,
    parse_catalog_csv,
)


def _csv_rows() -> list[dict[str, str]]:
    text = resources.files("hetrain").joinpath("data", "gpus.csv").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def test_every_csv_row_is_in_the_catalog_in_si_units() -> None:
    catalog = load_catalog()
    rows = _csv_rows()
    assert len(rows) >= 15
    for row in rows:
        spec = catalog[row["model"]]
        assert spec.memory_bytes == round(float(row["memory_gb"]) * 1e9)
        assert spec.mem_bw_bytes_per_s == pytest.approx(float(row["mem_bw_gbps"]) * 1e9)
        assert spec.peak_flops["fp32"] == pytest.approx(float(row["fp32_tflops"]) * 1e12)
        assert spec.peak_flops["fp16"] == pytest.approx(float(row["tensor_fp16_tflops"]) * 1e12)
        assert set(spec.peak_flops) == {"fp32", "tf32", "fp16", "bf16"}
        assert spec.bf16 == (row["bf16"] == "yes")
        assert spec.compute_capability == tuple(int(p) for p in row["compute_capability"].split("."))


def test_a100_and_v100_figures() -> None:
    a100 = get_gpu("a100-sxm4-80gb")
    assert a100.peak_flops["bf16"] == pytest.approx(312e12)
    assert a100.peak_flops["tf32"] == pytest.approx(156e12)
    assert a100.memory_bytes == 80_000_000_000
    assert a100.nvlink_bytes_per_s == pytest.approx(300e9)
    assert a100.pcie_bytes_per_s == pytest.approx(31.5e9)
    assert a100.compute_capability == (8, 0)
    assert all(a100.supports(p) for p in ("fp32", "tf32", "fp16", "bf16"))

    v100 = get_gpu("v100-sxm2-32gb")
    assert not v100.bf16 and not v100.supports("bf16")
    assert v100.peak_flops["bf16"] == 0.0
    assert not v100.supports("tf32")
    assert v100.peak_flops["tf32"] == v100.peak_flops["fp32"] == pytest.approx(15.7e12)  # no TF32 on Volta
    assert v100.supports("fp16") and v100.peak_flops["fp16"] == pytest.approx(125e12)


def test_pcie_only_cards_have_no_nvlink() -> None:
    for name in ("l4", "t4", "a10", "a100-pcie-40gb"):
        spec = get_gpu(name)
        assert spec.nvlink_bytes_per_s is None and spec.nvlink_gen is None and not spec.has_nvlink


def test_unknown_precision_is_a_user_error() -> None:
    with pytest.raises(HetrainError, match="unknown precision 'int4'"):
        get_gpu("a100").supports("int4")


@pytest.mark.parametrize(
    "alias, name",
    [
        ("a100", "a100-sxm4-80gb"),
        ("a100-40gb", "a100-sxm4-40gb"),
        ("v100", "v100-sxm2-32gb"),
        ("v100-16gb", "v100-sxm2-16gb"),
        ("h100", "h100-sxm5-80gb"),
        ("h200", "h200-sxm-141gb"),
        ("t4", "t4"),
        ("l4", "l4"),
        ("a10", "a10"),
        ("rtx-3090", "rtx-3090"),
        ("rtx-4090", "rtx-4090"),
        ("A100", "a100-sxm4-80gb"),
        (" H100 ", "h100-sxm5-80gb"),
        ("V100-SXM2-32GB", "v100-sxm2-32gb"),
    ],
)
def test_aliases_and_case(alias: str, name: str) -> None:
    assert get_gpu(alias).name == name


def test_every_alias_points_into_the_catalog() -> None:
    catalog = load_catalog()
    assert all(target in catalog for target in ALIASES.values())


def test_unknown_model_names_the_closest_on_one_line() -> None:
    with pytest.raises(HetrainError) as info:
        get_gpu("a1000")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("unknown GPU model 'a1000'; closest catalog names: a100, a10")
    assert "`hetrain devices --catalog`" in msg


def test_cpu_entry() -> None:
    assert get_gpu("cpu") is CPU_SPEC
    assert load_catalog()["cpu"] is CPU_SPEC
    assert CPU_SPEC.memory_bytes == host_memory_bytes() > 0
    assert CPU_SPEC.supports("fp32")
    assert not any(CPU_SPEC.supports(p) for p in ("tf32", "fp16", "bf16"))
    assert 0 < CPU_SPEC.peak_flops["fp32"] < get_gpu("t4").peak_flops["fp32"]


def test_cpu_memory_matches_proc_meminfo() -> None:
    try:
        text = open("/proc/meminfo").read()
    except OSError:
        pytest.skip("no /proc/meminfo")
    kib = int(next(line for line in text.splitlines() if line.startswith("MemTotal:")).split()[1])
    assert CPU_SPEC.memory_bytes == kib * 1024


@pytest.mark.parametrize("name, memory_gb, bandwidth, fp32, tensor_fp16, tdp", [
    ("a30", 24, 933, 10.3, 165, 165),                # NVIDIA A30 datasheet
    ("a40", 48, 696, 37.4, 149.7, 300),              # NVIDIA A40 datasheet
    ("rtx-a6000", 48, 768, 38.7, 154.8, 300),        # RTX A6000: 309.7 TFLOPS with sparsity, halved
    ("l40", 48, 864, 90.5, 181, 300),                # NVIDIA L40 datasheet
    ("l40s", 48, 864, 91.6, 362, 350),               # NVIDIA L40S datasheet
    ("rtx-6000-ada", 48, 960, 91.1, 364.2, 300),
    ("rtx-3080", 10, 760, 29.8, 59.5, 320),          # GeForce: FP32-accumulate tensor rate at half
    ("rtx-3060", 12, 360, 12.7, 25.4, 170),
    ("rtx-4080", 16, 716.8, 48.7, 97.5, 320),
    ("v100-pcie-16gb", 16, 900, 14.0, 112, 250),
])
def test_the_catalog_has_the_cards_mixed_clusters_are_made_of(name, memory_gb, bandwidth, fp32, tensor_fp16, tdp):
    spec = get_gpu(name)
    assert spec.memory_bytes == memory_gb * 1_000_000_000
    assert spec.mem_bw_bytes_per_s == pytest.approx(bandwidth * 1e9)
    assert spec.peak_flops["fp32"] == pytest.approx(fp32 * 1e12)
    assert spec.peak_flops["fp16"] == pytest.approx(tensor_fp16 * 1e12)
    assert spec.tdp_w == tdp
    assert spec.bf16 == (spec.arch != "volta")
    assert not spec.has_nvlink            # bridged pairs at most: a node of them is a PCIe node


def test_parse_catalog_csv_skips_comments_and_fills_tf32() -> None:
    text = (
        "# a comment\n"
        "model,arch,compute_capability,memory_gb,mem_bw_gbps,fp32_tflops,tf32_tflops,tensor_fp16_tflops,"
        "bf16,nvlink_gen,nvlink_gbps,pcie_gen,pcie_gbps,tdp_w\n"
        "# another\n"
        "x1,turing,7.5,8,400,10,,40,no,,,3,15.75,\n"
    )
    spec = parse_catalog_csv(text)["x1"]
    assert spec.peak_flops == {"fp32": 10e12, "tf32": 10e12, "fp16": 40e12, "bf16": 0.0}
    assert spec.tdp_w is None and spec.memory_bytes == 8_000_000_000
    assert not spec.power_reference        # the column is optional


@pytest.mark.parametrize(
    "torch_name, name",
    [
        ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
        ("Tesla V100-SXM2-32GB", "v100-sxm2-32gb"),
        ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),
        ("Tesla V100-PCIE-32GB", "v100-pcie-32gb"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm5-80gb"),
        ("NVIDIA H100 PCIe", "h100-pcie-80gb"),
        ("NVIDIA H200", "h200-sxm-141gb"),
        ("NVIDIA L4", "l4"),
        ("Tesla T4", "t4"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA GeForce RTX 3090", "rtx-3090"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("Tesla V100-PCIE-16GB", "v100-pcie-16gb"),
        ("NVIDIA A30", "a30"),
        ("NVIDIA A40", "a40"),
        ("NVIDIA RTX A6000", "rtx-a6000"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
        ("NVIDIA GeForce RTX 3080", "rtx-3080"),
        ("NVIDIA GeForce RTX 3060", "rtx-3060"),
        ("NVIDIA GeForce RTX 4080", "rtx-4080"),
        ("NVIDIA GeForce RTX 2080 Ti", "rtx-2080-ti"),
        ("NVIDIA TITAN RTX", "titan-rtx"),
        ("Quadro RTX 8000", "quadro-rtx-8000"),
        ("Quadro RTX 6000", "quadro-rtx-6000"),
        ("Quadro RTX 5000", "quadro-rtx-5000"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GH200 480GB", "gh200-96gb"),
    ],
)
def test_match_real_device_names(torch_name: str, name: str) -> None:
    spec = match_device_name(torch_name)
    assert spec is not None and spec.name == name


@pytest.mark.parametrize(
    "torch_name",
    ["NVIDIA A10G", "Tesla V100S-PCIE-32GB", "NVIDIA H100 NVL", "NVIDIA GeForce RTX 3090 Ti",
     "NVIDIA GeForce RTX 3080 Ti", "NVIDIA GeForce RTX 4080 SUPER", "NVIDIA GeForce RTX 2080", "NVIDIA GeForce RTX 2080 SUPER",
     "NVIDIA RTX 5000 Ada Generation", "NVIDIA RTX A4000", "NVIDIA GB200",
     "AMD Instinct MI250X", "cpu"],
)
def test_products_outside_the_catalog_match_nothing(torch_name: str) -> None:
    assert match_device_name(torch_name) is None


def test_a_superchip_name_counts_cpu_memory_so_the_driver_memory_picks_the_part() -> None:
    """"NVIDIA GH200 480GB" is the 96 GB GPU with 480 GB of CPU memory; the 144 GB part says HBM3e."""
    assert match_device_name("NVIDIA GH200 480GB", 97871 * 2**20).name == "gh200-96gb"
    assert match_device_name("NVIDIA GH200 144G HBM3e", 146 * 2**30).name == "gh200-144gb"


def test_memory_size_picks_between_sizes() -> None:
    # What the driver reports: an A100 40GB has 40,960 MiB minus reserved, a V100 16GB about 15.8 GiB.
    assert match_device_name("NVIDIA A100", 42_505_273_344).name == "a100-sxm4-40gb"
    assert match_device_name("NVIDIA A100", 85_899_345_920).name == "a100-sxm4-80gb"
    assert match_device_name("Tesla V100", 16_945_512_448).name == "v100-sxm2-16gb"
    assert match_device_name("Tesla V100", 34_089_730_048).name == "v100-sxm2-32gb"
    assert match_device_name("NVIDIA A100", None).name == "a100-sxm4-80gb"
