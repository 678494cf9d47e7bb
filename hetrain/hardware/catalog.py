"""The GPU catalog: vendor peak figures from `hetrain/data/gpus.csv`, looked up by name.

Every rate is the datasheet's dense peak (no sparsity), in SI units: bytes, bytes/s, FLOP/s.
The planner divides measured or modelled work by these rates; it never trusts them as achieved speed.
"""

from __future__ import annotations

import csv
import difflib
import io
import os
from pathlib import Path
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from hetrain.errors import HetrainError

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


@dataclass(frozen=True)
class GpuSpec:
    """One device model's published figures."""

    name: str
    """catalog key, e.g. "a100-sxm4-80gb"; "cpu" for the host CPU pseudo-device"""
    arch: str
    """volta, turing, ampere, ada, hopper, blackwell, cpu"""
    compute_capability: tuple[int, int]
    """CUDA compute capability; (0, 0) for the CPU"""
    memory_bytes: int
    """device memory; the csv's GB are 1e9 bytes"""
    mem_bw_bytes_per_s: float
    """peak memory bandwidth"""
    peak_flops: dict[str, float] = field(hash=False)
    """FLOP/s for "fp32", "tf32", "fp16", "bf16" (0.0 where the precision is not supported)"""
    bf16: bool
    """whether the chip has bfloat16 arithmetic"""
    nvlink_gen: int | None
    nvlink_bytes_per_s: float | None
    """NVLink bandwidth per GPU, one direction; None without NVLink"""
    pcie_gen: int | None
    pcie_bytes_per_s: float | None
    """PCIe x16 bandwidth, one direction"""
    tdp_w: float | None
    l2_bytes: float = 0.0
    """L2 cache (0 where the catalog does not say, and for the CPU)"""
    power_reference: bool = False
    """whether this part's power per peak FLOP stands for its die family (see gpus.csv)"""
    pcie_p2p: bool = True
    """whether the driver gives peer-to-peer access over PCIe (not on GeForce parts: see gpus.csv)"""

    def supports(self, precision: str) -> bool:
        """Whether this device computes in `precision` (fp32, tf32, fp16, bf16)."""
        if precision not in PRECISIONS:
            raise HetrainError(
                f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}"
            )
        if precision == "fp32":
            return True
        if self.arch == "cpu":
            return False
        if precision == "tf32":
            return self.compute_capability >= (8, 0)
        if precision == "fp16":
            return True
        return self.bf16

    @property
    def has_nvlink(self) -> bool:
        """Whether the catalog lists NVLink for this model."""
        return bool(self.nvlink_bytes_per_s)


# Short names a user may type; the full catalog names always work too.
ALIASES: dict[str, str] = {
    "a100": "a100-sxm4-80gb",
    "a100-80gb": "a100-sxm4-80gb",
    "a100-40gb": "a100-sxm4-40gb",
    "v100": "v100-sxm2-32gb",
    "v100-32gb": "v100-sxm2-32gb",
    "v100-16gb": "v100-sxm2-16gb",
    "h100": "h100-sxm5-80gb",
    "h200": "h200-sxm-141gb",
    "gh200": "gh200-96gb",
}

# Host CPU estimate: per core, 2 FMA units x 8 fp32 lanes x 2 FLOP at 2.5 GHz is the AVX2 peak;
# a training loop reaches far less, so hetrain counts a quarter of it (10 GFLOP/s per core).
_CPU_FLOPS_PER_CORE = 10e9
_CPU_MEM_BW = 20e9  # bytes/s: a conservative share of a server socket's DRAM bandwidth


def _tflops(text: str) -> float:
    return float(text) * 1e12 if text.strip() else 0.0


def _opt_float(text: str, scale: float = 1.0) -> float | None:
    return float(text) * scale if text.strip() else None


def _opt_int(text: str) -> int | None:
    return int(text) if text.strip() else None


def _spec_from_row(row: dict[str, str]) -> GpuSpec:
    major, minor = (int(p) for p in row["compute_capability"].split("."))
    bf16 = row["bf16"].strip().lower() == "yes"
    fp32 = _tflops(row["fp32_tflops"])
    tensor_fp16 = _tflops(row["tensor_fp16_tflops"])
    tf32 = _tflops(row["tf32_tflops"]) or fp32  # no TF32 on the chip: TF32 requests run as fp32
    return GpuSpec(
        name=row["model"].strip(),
        arch=row["arch"].strip(),
        compute_capability=(major, minor),
        memory_bytes=int(round(float(row["memory_gb"]) * 1e9)),
        mem_bw_bytes_per_s=float(row["mem_bw_gbps"]) * 1e9,
        peak_flops={"fp32": fp32, "tf32": tf32, "fp16": tensor_fp16, "bf16": tensor_fp16 if bf16 else 0.0},
        bf16=bf16,
        nvlink_gen=_opt_int(row["nvlink_gen"]),
        nvlink_bytes_per_s=_opt_float(row["nvlink_gbps"], 1e9),
        pcie_gen=_opt_int(row["pcie_gen"]),
        pcie_bytes_per_s=_opt_float(row["pcie_gbps"], 1e9),
        tdp_w=_opt_float(row["tdp_w"]),
        l2_bytes=_opt_float(row.get("l2_mb") or "", 1e6) or 0.0,
        power_reference=(row.get("power_reference") or "").strip().lower() == "yes",
        pcie_p2p=(row.get("pcie_p2p") or "").strip().lower() != "no",
    )


def parse_catalog_csv(text: str) -> dict[str, GpuSpec]:
    """Parse the catalog csv (lines starting with # are comments) into specs by name."""
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    specs = [_spec_from_row(row) for row in csv.DictReader(io.StringIO("\n".join(lines)))]
    return {spec.name: spec for spec in specs}


def _meminfo_bytes(key: str) -> int | None:
    """A field of /proc/meminfo ("MemTotal", "MemAvailable") in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room_bytes() -> int | None:
    """What this process's cgroup (v2) still lets it allocate (its memory.max less memory.current), or None."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def host_memory_bytes() -> int:
    """Total host RAM, from /proc/meminfo where present, else sysconf."""
    total = _meminfo_bytes("MemTotal")
    if total is not None:
        return total
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def host_available_bytes() -> int | None:
    """Host RAM a new allocation can take now: MemAvailable, or less where a container's memory limit
    leaves less; None where unknown."""
    known = [b for b in (_meminfo_bytes("MemAvailable"), _cgroup_room_bytes()) if b is not None]
    return min(known) if known else None


def host_cpu_count() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rank_threads(ranks_per_node: int) -> int:
    """Threads each of `ranks_per_node` CPU ranks runs on this machine: OMP_NUM_THREADS where set,
    else what `hetrain launch` gives them, the cores split evenly."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // max(1, ranks_per_node)))


def _cpu_spec() -> GpuSpec:
    fp32 = _CPU_FLOPS_PER_CORE * host_cpu_count()
    return GpuSpec(
        name="cpu",
        arch="cpu",
        compute_capability=(0, 0),
        memory_bytes=host_memory_bytes(),
        mem_bw_bytes_per_s=_CPU_MEM_BW,
        peak_flops={"fp32": fp32, "tf32": fp32, "fp16": 0.0, "bf16": 0.0},
        bf16=False,
        nvlink_gen=None,
        nvlink_bytes_per_s=None,
        pcie_gen=None,
        pcie_bytes_per_s=None,
        tdp_w=None,
    )


CPU_SPEC: GpuSpec = _cpu_spec()
"""The host CPU as a device: memory is this machine's RAM; flops and bandwidth are modest
estimates (10 GFLOP/s per core, 20 GB/s), not measurements. fp32 only."""


@lru_cache(maxsize=1)
def load_catalog() -> dict[str, GpuSpec]:
    """All catalog entries by name: the csv's GPUs, then "cpu" (CPU_SPEC)."""
    text = resources.files("hetrain").joinpath("data", "gpus.csv").read_text(encoding="utf-8")
    catalog = parse_catalog_csv(text)
    catalog[CPU_SPEC.name] = CPU_SPEC
    return catalog


def known_names() -> list[str]:
    """Every name get_gpu accepts: aliases first (they are what people type), then catalog names."""
    return list(ALIASES) + list(load_catalog())


def closest_names(name: str, n: int = 5) -> list[str]:
    """The known names nearest to `name` (difflib), for error messages."""
    key = name.strip().lower()
    names = known_names()
    close = difflib.get_close_matches(key, names, n=n, cutoff=0.5)
    if not close:
        close = difflib.get_close_matches(key, names, n=n, cutoff=0.0)
    return close


def get_gpu(name: str) -> GpuSpec:
    """The catalog entry for a catalog name or alias (case-insensitive)."""
    key = str(name).strip().lower()
    catalog = load_catalog()
    key = ALIASES.get(key, key)
    if key in catalog:
        return catalog[key]
    # a name as torch or nvidia-smi reports it ("NVIDIA A100 80GB PCIe"): the entries it may be, by memory size
    read = {match_device_name(str(name), memory_bytes=size) for size in (None, 1, 10**15)} - {None}
    if len(read) == 1:
        raise HetrainError(f"unknown GPU model {name!r}; fix: write {read.pop().name!r}, the catalog's name for it "
                           "(see `hetrain devices --catalog`)")
    if read:
        raise HetrainError(f"unknown GPU model {name!r}; fix: write the catalog's name for its memory size, one of "
                           f"{', '.join(sorted(s.name for s in read))} (see `hetrain devices --catalog`)")
    raise HetrainError(
        f"unknown GPU model {name!r}; closest catalog names: {', '.join(closest_names(str(name)))}; "
        "see `hetrain devices --catalog`"
    )


# Device-name families, most specific first; "a10" must not swallow "a100" (word boundaries).
_FAMILIES = (
    ("a100", r"\ba100\b"),
    ("a10", r"\ba10\b"),
    ("a30", r"\ba30\b"),
    ("a40", r"\ba40\b"),
    ("rtx-a6000", r"\ba6000\b"),
    ("rtx-6000-ada", r"\brtx 6000 ada\b"),
    ("l40s", r"\bl40s\b"),
    ("l40", r"\bl40\b"),
    ("v100", r"\bv100\b"),
    ("h100", r"\bh100\b"),
    ("h200", r"\bh200\b"),
    ("gh200", r"\bgh200\b"),
    ("b200", r"\bb200\b"),
    ("t4", r"\bt4\b"),
    ("l4", r"\bl4\b"),
    ("rtx-3090", r"\b3090\b"),
    ("rtx-4090", r"\b4090\b"),
    ("rtx-3080", r"\b3080\b"),
    ("rtx-3060", r"\b3060\b"),
    ("rtx-4080", r"\b4080\b"),
    ("rtx-2080-ti", r"\b2080 ti\b"),
    ("titan-rtx", r"\btitan rtx\b"),
    ("quadro-rtx-8000", r"\brtx 8000\b"),
    ("quadro-rtx-6000", r"\brtx 6000\b"),
    ("quadro-rtx-5000", r"\brtx 5000\b"),
)
_FAMILY_DEFAULT = {"a100": "a100-sxm4-80gb", "v100": "v100-sxm2-32gb", "h100": "h100-sxm5-80gb", "gh200": "gh200-96gb"}
# Families whose device name counts the CPU's memory with the GPU's ("NVIDIA GH200 480GB"): the size in
# the name does not pick the GPU; the memory the driver reports does.
_NAME_GB_IS_TOTAL = {"gh200"}
_GIB = 1024**3


def match_device_name(torch_name: str, memory_bytes: int | None = None) -> GpuSpec | None:
    """The catalog entry for a device name as torch or NVML reports it, or None if none fits.

    `memory_bytes` (total memory the driver reports) picks between sizes of one model when
    the name does not say (an A100 reports 80 GiB as about 85.9e9 bytes).
    """
    text = re.sub(r"[_\s]+", " ", torch_name.lower()).replace("-", " ")
    words = text.split()
    family = next((fam for fam, pattern in _FAMILIES if re.search(pattern, text)), None)
    if family is None or ({"nvl", "ti", "super", "ada"} - set(family.split("-"))) & set(words):
        return None  # NVL boards, Ti, Super and Ada cards are other products than the family's entries
    catalog = load_catalog()
    candidates = [s for s in catalog.values() if s.name == family or s.name.startswith(family + "-")]
    if "pcie" in words:
        candidates = [s for s in candidates if "pcie" in s.name] or candidates
    elif any(w.startswith("sxm") or w.startswith("hbm") for w in words):
        candidates = [s for s in candidates if "sxm" in s.name] or candidates
    elif any("pcie" in s.name for s in candidates) and any("sxm" in s.name for s in candidates):
        candidates = [s for s in candidates if "sxm" in s.name]
    named_gb = re.search(r"\b(\d+)\s?gb\b", text) if family not in _NAME_GB_IS_TOTAL else None
    if named_gb:
        gb = int(named_gb.group(1))
        candidates = [s for s in candidates if round(s.memory_bytes / 1e9) == gb]
    elif memory_bytes and len(candidates) > 1:
        gib = memory_bytes / _GIB
        best = min(abs(s.memory_bytes / 1e9 - gib) for s in candidates)
        candidates = [s for s in candidates if abs(s.memory_bytes / 1e9 - gib) == best]
    if not candidates:
        return None
    default = _FAMILY_DEFAULT.get(family)
    return next((s for s in candidates if s.name == default), candidates[0])
